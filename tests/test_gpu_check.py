"""`benchmarks/gpu_check.sh`, the prepared check that runs when a GPU is lent, keeps working between such loans.

- Its `--cpu-smoke` mode runs the same plumbing (every section, the same Python, the summary) at tiny sizes on the
  CPU, with the CUDA-only parts skipped and saying why, and must finish with every section that can run here passing.
- The pieces that decide what it reports (`benchmarks/gpu_check.py`) are checked on inputs made by hand: where a
  run's steady-state clock starts (never on a batch the trainer made itself, never before the generator's first
  batch), the SM utilisation of a window from `nvidia-smi dmon`, which runs are planned and which skipped, what fits
  the time left, the dtype-by-dtype comparison that a crashing dtype cannot stop, and the training arguments of each
  run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tarfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gpu_check_module():
    spec = importlib.util.spec_from_file_location(
        "gpu_check_under_test", os.path.join(ROOT, "benchmarks", "gpu_check.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


G = gpu_check_module()


def has_rows_per_decode() -> bool:
    from trl_async import AsyncGRPOConfig

    return G.ROWS_PER_DECODE_FIELD in {f.name for f in dataclasses.fields(AsyncGRPOConfig)}


# ------------------------------------------------------------------------------------------------ the steady window


def test_the_async_clock_starts_after_the_last_step_trained_on_a_batch_the_trainer_made_itself():
    # steps 1-3 trained on the trainer's own batches while the generation process started; step 4 on its first batch
    ends = [10.0, 20.0, 30.0, 31.0, 32.5, 33.5, 35.0]
    window = G.steady_window(ends, trainer_batches=[1, 1, 1, 0, 0, 0, 0])
    assert window == {"start_step": 4, "end_step": 7, "steps": 3, "seconds": 4.0, "start": 31.0, "end": 35.0}
    # a batch the trainer made after the generator's first (the queue fell behind): the clock starts after it
    window = G.steady_window(ends, trainer_batches=[1, 0, 1, 0, 0, 0, 0])
    assert (window["start_step"], window["steps"]) == (4, 3)
    # a step that logged no count is taken as the trainer's own: the clock can only start later
    window = G.steady_window(ends, trainer_batches=[1, 1, 0, 0, None, 0, 0])
    assert (window["start_step"], window["steps"], window["seconds"]) == (6, 1, 1.5)
    # steps beyond the logged counts are unknown too
    assert G.steady_window(ends, trainer_batches=[1, 0, 0])["steps"] == 0
    # no step trained on a batch of the generation process: no steady window, and why
    window = G.steady_window(ends, trainer_batches=[1] * 7)
    assert window["steps"] == 0 and "generation process" in window["reason"]


def test_the_async_clock_never_starts_before_the_generator_queued_its_first_batch():
    ends = [10.0, 20.0, 30.0, 31.0, 32.5, 33.5, 35.0]
    # the counts say step 2 already trained on a generator batch, the timeline that the first one was queued at 31.5
    window = G.steady_window(ends, trainer_batches=[1, 0, 0, 0, 0, 0, 0], first_batch_queued=31.5)
    assert (window["start_step"], window["start"], window["steps"]) == (5, 32.5, 2)
    window = G.steady_window(ends, trainer_batches=[1, 0, 0, 0, 0, 0, 0], first_batch_queued=5.0)
    assert (window["start_step"], window["steps"]) == (2, 5)


def test_a_synchronous_clock_starts_after_its_warm_up_on_whole_generation_cycles():
    ends = [float(t) for t in range(1, 11)]  # steps 1..10 end at 1 s, 2 s, ...
    assert G.steady_window(ends, warmup_steps=3)["start_step"] == 3
    window = G.steady_window(ends, warmup_steps=3, cycle=2)  # one generate call every 2 steps: steps 5-6, 7-8, 9-10
    assert (window["start_step"], window["end_step"], window["steps"], window["seconds"]) == (4, 10, 6, 6.0)
    window = G.steady_window(ends[:9], warmup_steps=3, cycle=2)
    assert (window["start_step"], window["end_step"]) == (4, 8)
    assert G.steady_window(ends[:3], warmup_steps=3)["steps"] == 0


# ------------------------------------------------------------------------------------------------ SM utilisation

DMON = """\
#Date       Time        gpu     sm    mem    enc    dec    jpg    ofa
#YYYYMMDD   HH:MM:SS    Idx      %      %      %      %      %      %
 20261205   10:00:00      0      5      1      0      0      0      0
 20261205   10:00:01      0     40      9      0      0      0      0
 20261205   10:00:02      0     60     10      0      0      0      0

 20261205   10:00:03      0      -      -      -      -      -      -
 20261205   10:00:04      0     80     20      0      0      0      0
 20261205   10:00:04      1     99     20      0      0      0      0
 20261205   10:00:05      0     10      1      0      0      0      0
"""


def test_sm_utilisation_is_the_median_of_the_dmon_samples_inside_the_window():
    import time

    samples = G.parse_dmon(DMON)
    t0 = time.mktime(time.strptime("20261205 10:00:00", "%Y%m%d %H:%M:%S"))
    assert [(t - t0, gpu, sm) for t, gpu, sm in samples][:4] == [(0, 0, 5.0), (1, 0, 40.0), (2, 0, 60.0), (3, 0, None)]
    assert len(samples) == 7
    # a window of 10:00:02-10:00:03 (widened by a second each side: 01-04) on GPU 0: 40, 60, 80 ('-' is no sample)
    assert G.sm_median(samples, t0 + 2, t0 + 3) == {"median": 60.0, "samples": 3}
    assert G.sm_median(samples, t0 + 4, t0 + 4, gpu=1) == {"median": 99.0, "samples": 1}
    assert G.sm_median(samples, t0 + 60, t0 + 70) == {"median": None, "samples": 0}
    # each run's steady window and whole run, from its own times
    section = {"runs": {"a": {"steady": {"steps": 3, "start": t0 + 4.5, "end": t0 + 5.0},
                              "train_start_unix": t0, "train_end_unix": t0 + 1},
                        "b": {"same_as": "a"}}}  # fmt: skip
    G.attach_sm(section, samples)
    assert section["runs"]["a"]["sm_percent_steady"] == {"median": 45.0, "samples": 2}  # 80 and 10
    assert section["runs"]["a"]["sm_percent_run"] == {"median": 40.0, "samples": 3}  # 5, 40, 60
    assert "sm_percent_steady" not in section["runs"]["b"]


# ------------------------------------------------------------------------------------------------ the plan and budget


def test_the_throughput_plan_sweeps_rows_per_decode_beside_trl_with_matched_steps_per_generation():
    shape = G.SHAPES["gpu"]
    assert (shape.rows_per_step, shape.completion_length, shape.min_steps) == (32, 64, 40)
    runs, skipped = G.plan_runs(shape, has_rows_per_decode=True)
    assert [r["name"] for r in runs] == [
        "trl/defaults", "async/defaults",
        "async/rows_per_decode=256", "trl/steps_per_generation=8",
        "async/rows_per_decode=128", "trl/steps_per_generation=4",
        "async/rows_per_decode=64", "trl/steps_per_generation=2",
        "async/rows_per_decode=32",
    ]  # fmt: skip
    assert skipped == {}
    by_name = {r["name"]: r for r in runs}
    assert by_name["trl/steps_per_generation=4"]["steps_per_generation"] == 4
    assert by_name["async/rows_per_decode=64"]["rows_per_decode"] == 64
    assert (
        by_name["async/defaults"]["rows_per_decode"] is None
        and by_name["trl/defaults"]["steps_per_generation"] is None
    )
    # each trains >= 40 steps and 20 at steady state: on whole cycles of its generate calls (TRL), 3 decodes (async)
    assert G.stop_after(by_name["trl/defaults"], shape) == {"min_steps": 40, "steady": 20, "cycle": 1}
    assert G.stop_after(by_name["trl/steps_per_generation=8"], shape) == {"min_steps": 40, "steady": 24, "cycle": 8}
    assert G.stop_after(by_name["async/rows_per_decode=256"], shape) == {"min_steps": 40, "steady": 24, "cycle": 1}
    assert G.stop_after(by_name["async/rows_per_decode=64"], shape) == {"min_steps": 40, "steady": 20, "cycle": 1}
    # without AsyncGRPOConfig.max_rows_per_decode the sweep is skipped, saying why; TRL's own lever still runs
    runs, skipped = G.plan_runs(shape, has_rows_per_decode=False)
    assert [r["name"] for r in runs] == ["trl/defaults", "async/defaults", "trl/steps_per_generation=8",
                                         "trl/steps_per_generation=4", "trl/steps_per_generation=2"]  # fmt: skip
    assert sorted(skipped) == [f"async/rows_per_decode={r}" for r in (128, 256, 32, 64)]
    assert all("max_rows_per_decode" in why for why in skipped.values())


def test_a_run_that_does_not_fit_the_time_left_is_skipped_and_one_that_fits_gets_a_cap():
    assert G.budget_decision(100.0, 80.0) == (None, "out of the section's time: needs ~100 s, 80 s left")
    assert G.budget_decision(50.0, 200.0) == (80.0, None)  # 50 s + 30 s
    assert G.budget_decision(100.0, 200.0) == (150.0, None)  # 1.5x
    assert G.budget_decision(50.0, 60.0) == (60.0, None)  # never past what is left
    # the estimates follow the costs: a slow-starting generator makes an async run dearer, not a TRL one
    shape, costs = G.SHAPES["gpu"], G.Costs(**G.COSTS["gpu"])
    run, trl = {"name": "a", "trainer": "async", "rows_per_decode": 256}, {"name": "t", "trainer": "trl"}
    slow = dataclasses.replace(costs, generator_start_s=costs.generator_start_s + 30)
    assert G.estimate_s(run, shape, slow) > G.estimate_s(run, shape, costs)
    assert G.estimate_s(trl, shape, slow) == G.estimate_s(trl, shape, costs)


def test_each_run_trains_with_the_arguments_its_name_says(tmp_path):
    from trl import GRPOConfig

    from trl_async import AsyncGRPOConfig

    shape = G.SHAPES["cpu-smoke"]
    runs = {r["name"]: r for r in G.plan_runs(shape, has_rows_per_decode=True)[0]}

    def args(name):
        return G.training_arguments(runs[name], shape, str(tmp_path / "run"), False, has_rows_per_decode())

    trl = args("trl/steps_per_generation=2")
    assert type(trl) is GRPOConfig and trl.steps_per_generation == 2 and trl.gradient_accumulation_steps == 1
    assert trl.generation_batch_size == 2 * shape.rows_per_step
    defaults = args("trl/defaults")
    assert type(defaults) is GRPOConfig and defaults.steps_per_generation == 1
    assert defaults.per_device_train_batch_size == shape.rows_per_step and defaults.logging_steps == 1
    assert type(args("async/defaults")) is AsyncGRPOConfig
    if has_rows_per_decode():
        swept = args("async/rows_per_decode=16")
        assert getattr(swept, G.ROWS_PER_DECODE_FIELD) == 16 and type(swept) is AsyncGRPOConfig
    else:
        with pytest.raises(ValueError, match="max_rows_per_decode"):
            args("async/rows_per_decode=16")


# ------------------------------------------------------------------------------------------------ dtypes, start-up


def test_a_dtype_that_crashes_is_recorded_and_the_others_are_still_compared():
    def compute(device, dtype):
        if dtype == torch.float64:
            raise RuntimeError("The size of tensor a (3304) must match the size of tensor b (1652)")
        grad = torch.ones(3, dtype=dtype)
        loss = torch.tensor(2.0, dtype=dtype) + (0.5 if device == "b" and dtype == torch.bfloat16 else 0.0)
        return loss, grad, {"masked_fraction": torch.tensor(0.25)}

    results = G.compare_dtypes(compute, ("a", "b"), (torch.float64, torch.float32, torch.bfloat16))
    assert results["float64"] == {
        "error": "RuntimeError: The size of tensor a (3304) must match the size of tensor b (1652)"
    }
    assert results["float32"]["loss_abs_diff"] == 0.0 and results["float32"]["stats_equal"] is True
    assert results["bfloat16"]["loss_abs_diff"] == 0.5 and results["bfloat16"]["loss_rel_diff"] == 0.25
    assert G.dtype_verdicts(results) == {"float64": False, "float32": True}
    # float32 judged within 1e-5 (relative loss, absolute gradient), float64 within 1e-9
    close = {"loss_rel_diff": 1e-7, "grad_max_abs_diff": 1e-7, "stats_equal": True}
    assert G.dtype_verdicts({"float32": close, "float64": close}) == {"float32": True, "float64": False}
    assert G.dtype_verdicts({"float32": {**close, "grad_max_abs_diff": 1e-3}})["float32"] is False
    assert G.dtype_verdicts({"float32": {**close, "stats_equal": False}})["float32"] is False


def test_the_generation_start_up_is_split_phase_by_phase_from_the_timeline_marks():
    instants = {"spawn": 1.0, "imports done": 14.5, "model built": 51.9, "ready": 52.1, "first batch queued": 57.2}
    figures = G.startup_phases(instants)
    assert figures["phases_s"] == pytest.approx({"spawn -> imports done": 13.5, "imports done -> model built": 37.4,
                                                 "model built -> ready": 0.2, "ready -> first batch queued": 5.1})  # fmt: skip
    assert figures["ready_after_spawn_s"] == pytest.approx(51.1)
    assert figures["first_batch_after_spawn_s"] == pytest.approx(56.2)
    assert G.startup_phases({"spawn": 1.0})["ready_after_spawn_s"] is None


# ------------------------------------------------------------------------------------------------ the whole check

FAKE_NVIDIA_SMI = """#!/usr/bin/env bash
# nvidia-smi as gpu_check.sh calls it: `dmon -s u -o DT -d 1` prints its header, then a sample every 0.2 s
if [ "$1" = dmon ]; then
    echo "#Date       Time        gpu     sm    mem    enc    dec    jpg    ofa"
    echo "#YYYYMMDD   HH:MM:SS    Idx      %      %      %      %      %      %"
    while true; do echo " $(date +%Y%m%d)   $(date +%H:%M:%S)      0     42      7      0      0      0      0"; sleep 0.2; done
fi
echo "Fake GPU, 1.0, 1 MiB"
"""


@pytest.mark.slow
def test_the_launcher_keeps_to_its_budget_and_records_dmon_for_the_whole_check(tmp_path):
    """gpu_check.sh in its GPU mode, on a machine that has no GPU but an `nvidia-smi` (a stand-in that prints dmon
    samples): 25 s of budget run the env section, then every section that no longer fits is skipped and says so;
    the sections that ran say they had no CUDA device; dmon ran for the whole check, was stopped, and merge read it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "GPU_CHECK_BUDGET_S": "25",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "GPU_CHECK_COMMIT": "feedface",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=600, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    sections = summary["sections"]
    assert summary["mode"] == "gpu" and summary["meta"]["commit"] == "feedface" and summary["meta"]["budget_s"] == 25
    assert sections["env"]["rc"] == 0 and sections["env"]["nvidia_smi"] == "Fake GPU, 1.0, 1 MiB"
    assert "out of the check's time budget (25s)" in sections["throughput"]["skipped"]
    for name in ("m2po_cuda", "loss_timing", "reward_sync", "sharded", "main_command"):
        section = sections[name]
        # which of the two depends on how long the env section took: either way the section says why it did not run
        skipped = section["skipped"]
        assert skipped.startswith("no CUDA device") or "out of the check's time budget" in skipped, section
        assert summary["ok"][name] is None
    lines = (out / "dmon.txt").read_text().splitlines()
    assert lines[0].startswith("#Date") and len(lines) > 2
    assert summary["dmon"] == {"file": "dmon.txt", "samples": len(lines) - 2}
    leftover = subprocess.run(["pgrep", "-f", str(bin_dir / "nvidia-smi")], capture_output=True, text=True)
    assert leftover.stdout == "", "dmon is still running"


@pytest.mark.slow
def test_the_gpu_check_script_runs_on_the_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), "--cpu-smoke"], env=env,
                          capture_output=True, text=True, timeout=1500, cwd=ROOT)  # fmt: skip
    log = (tmp_path / "gpu_check.log").read_text() if (tmp_path / "gpu_check.log").exists() else ""
    assert proc.returncode == 0, (proc.stdout + proc.stderr + log)[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    sections = summary["sections"]
    assert summary["format"] == 2 and summary["mode"] == "cpu-smoke"
    assert tuple(sections) == G.SECTIONS == ("env", "m2po_cuda", "loss_timing", "reward_sync", "sharded", "main_command",
                                             "throughput")  # fmt: skip
    # Every section ran to its end (none timed out or crashed), and those that run on a CPU passed.
    for name, section in sections.items():
        assert section.get("rc") == 0, (name, section, log[-3000:])
    assert summary["ok"]["throughput"] is True, (sections["throughput"], log[-3000:])
    assert summary["ok"]["main_command"] is True, (sections["main_command"], log[-3000:])
    # Without CUDA the CUDA-only sections say why they were skipped, and claim no result (tests/test_sharded.py runs
    # FSDP2 and ZeRO-3 on CPU processes).
    for name in ("m2po_cuda", "loss_timing", "reward_sync", "sharded"):
        assert summary["ok"][name] is None and "CUDA" in sections[name].get("skipped", ""), (name, sections[name])
    # The comparison ran dtype by dtype (CPU against CPU here: the same numbers), a crash recorded, not fatal.
    dtypes = sections["m2po_cuda"]["comparison"]["dtypes"]
    assert set(dtypes) == {"float32", "float64", "bfloat16", "float16"}
    assert dtypes["float32"]["loss_abs_diff"] == 0.0 and dtypes["float32"]["grad_max_abs_diff"] == 0.0
    assert all(("error" in r) != ("loss_abs_diff" in r) for r in dtypes.values())
    assert "pytest tests/test_losses.py -k cuda" == sections["m2po_cuda"]["pytest"]["command"]
    assert {(c["shape"], c["regime"]) for c in sections["loss_timing"]["cases"]} == {
        ("64x256", "a"), ("64x256", "b"), ("32x1024", "a"), ("32x1024", "b")}  # fmt: skip
    # README's main command, shortened, wrote its eval.json (accuracies before and after)
    main = sections["main_command"]
    assert main["command"].startswith("accelerate launch recipes/qwen_math.py --max_steps")
    assert main["eval_json"] and main["steps"] == 2 and main["beside"]
    # The throughput runs: each to its steady state, the async one after its generator's first batch, with the
    # generator's start-up phases and its timeline kept.
    throughput = sections["throughput"]
    runs = throughput["runs"]
    measured = {name: run for name, run in runs.items() if "same_as" not in run}  # a sweep point 'auto' already ran
    assert {"trl/defaults", "async/defaults", "trl/steps_per_generation=2"} <= set(measured)
    for name, run in measured.items():
        assert run["steady_state"] and run["steps"] >= run["stop_rule"]["min_steps"], (name, run)
    generator = runs["async/defaults"]
    assert generator["max_staleness"] is not None
    assert set(generator["startup"]["phases_s"]) == {"spawn -> imports done", "imports done -> model built",
                                                     "model built -> ready", "ready -> first batch queued"}  # fmt: skip
    with tarfile.open(tmp_path / "timelines.tar.gz") as tar:
        assert {generator["timeline"], "main_command.timeline.json"} <= set(tar.getnames())
    if has_rows_per_decode():
        for rows in (8, 16):
            run = runs[f"async/rows_per_decode={rows}"]
            assert "same_as" in run or (run["steady_state"] and run["rows_per_decode_logged"] is not None), run
    else:
        assert all("max_rows_per_decode" in throughput["skipped"][f"async/rows_per_decode={r}"] for r in (8, 16))
    # One summary table, in markdown too, saying it is no measurement; what the device brings back fits its 8 files.
    markdown = (tmp_path / "summary.md").read_text()
    assert "A CPU smoke run" in markdown and "| throughput | passed |" in markdown
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.log", "summary.json", "summary.md",
                                                          "timelines.tar.gz"]  # fmt: skip
