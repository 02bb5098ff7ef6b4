"""`benchmarks/run_all.py --render-only`: RESULTS.md and README's table come from the results files, computed from
their per-run records, and a missing file fails loudly.

Every registered benchmark gets a small results file here, in the format its script writes, with figures chosen by
hand so that the expected text can be worked out on paper (ratios per pair, medians, standard errors). The command
runs for real, in a subprocess, on a temporary results folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_ALL = os.path.join(ROOT, "benchmarks", "run_all.py")


def run_all_module():
    spec = importlib.util.spec_from_file_location("run_all_under_test", RUN_ALL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def registry():
    return run_all_module().REGISTRY


# ------------------------------------------------------------------------------------------------ fixtures


def main_job(pairs, regime=None, seeds=None):
    """pairs: [(async train s, sync train s, async accuracy after, sync accuracy after)]."""
    runs = []
    for index, (a, s, acc_a, acc_s) in enumerate(pairs):
        seed = seeds[index] if seeds else None
        for mode, seconds, acc in (("async", a, acc_a), ("sync", s, acc_s)):
            runs.append({"mode": mode, "train_seconds": seconds, "wall_seconds": seconds + 10.0, "steps": 240,
                         "reward_first_quarter": 0.2, "reward_last_quarter": 0.4, "reward_gain": 0.2,
                         "accuracy_before": 0.25, "accuracy_after": acc, "eval_samples": 500, "pair": index,
                         "position": 0 if mode == "async" else 1, "seed": seed})  # fmt: skip
    data = {"command": "python recipes/qwen_math.py [--async_generation false]", "pairs": len(pairs), "runs": runs,
            # a stale summary: the renderer must compute from the runs, not copy this
            "summary": {"speedup_train_seconds_sync_over_async": {"median": 9.99, "min": 9.99, "max": 9.99}}}  # fmt: skip
    if regime:
        data["regime"] = regime
        data["environment"] = {"seen_by_the_recipe": {"OMP_NUM_THREADS": None, "torch_num_threads": 2}}
    return data


def async_bench(regime, trl_seconds, dapo_seconds):
    def run(seconds):
        return {"train_s": seconds, "step_end": [seconds * (k + 1) / 10 for k in range(10)], "rows_per_step": 32,
                "reward": [0.1, 0.1, 0.2, 0.3], "mean_length": 20.0, "evicted_rows": 0,
                "trainer_wait_s": [0.0] * 10, "generator_wait_s": [0.0] * 10}  # fmt: skip

    runs = {"trl": [run(s) for s in trl_seconds], "async-dapo": [run(s) for s in dapo_seconds]}
    return {"steps": 10, "repeats": len(trl_seconds), "regimes": {regime: {"probe": {"generate_s": 0.1, "train_s": 0.2},
                                                                           "runs": runs}}}  # fmt: skip


def inflight_bench():
    """Completions forced to 256 tokens: TRL 36 s, gate-only 24 s (accuracy 0.50), in-flight 20 s (accuracy 0.47);
    in-flight steps at 1 s each against the gate-only 2.4 s, so its steady ratio (2.40) differs from end to end."""
    base = async_bench("forced256", [36.0], [24.0])
    runs = base["regimes"]["forced256"]["runs"]
    inflight = json.loads(json.dumps(runs["async-dapo"][0]))
    inflight.update(train_s=20.0, step_end=[1.0 * (k + 1) for k in range(10)], held_out_accuracy=0.47,
                    token_age_mean=0.75)  # fmt: skip
    runs["trl"][0]["held_out_accuracy"] = 0.40
    runs["async-dapo"][0]["held_out_accuracy"] = 0.50
    runs["async-dapo-inflight"] = [inflight]
    return base


def staleness_cell(contender, k, seed, accuracy):
    return {"contender": contender, "k": k, "seed": seed, "accuracy_before": 0.25, "accuracy_after": accuracy,
            "last_quarter_reward": 0.3, "grad_norm_variance": 0.1, "offpolicy/delta_sq_before": 0.01 * k,
            "offpolicy/ess": 0.9, "offpolicy/masked_fraction": 0.001, "reward_curve": [0.1, 0.2]}  # fmt: skip


def soak_run(growth):
    samples = [{"step": step, "trainer_rss_mib": 500.0, "generator_rss_mib": 400.0, "trainer_fds": 30,
                "generator_fds": 20, "processes": 4, "shm_entries": 2} for step in (50, 100)]  # fmt: skip
    checks = {"trainer_rss_mib": {"max_growth": growth, "ok": True},
              "generator_rss_mib": {"max_growth": 0.01, "ok": True}, "ok": True}  # fmt: skip
    return {"samples": samples, "checks": checks, "wall_seconds": 100.0}


def real_size_run(mode, pair, step_seconds, limit=None):
    """A run of a results file from before the TRL arms (two arms, `mode` per run)."""
    run = {
        "mode": mode,
        "pair": pair,
        "train_seconds": step_seconds * 4,
        "wall_seconds": step_seconds * 5,
        "step_seconds_median": step_seconds,
        "step_seconds": [step_seconds] * 2,
        "peak_rss_mib": {"trainer:0": 8192, "generator:0": 4096},
        "lora_publish_seconds_median": 0.25,
    }
    if limit:
        run["limit"] = {"ideal_overlap_ratio": limit, "generation_s": 20.0, "training_s": 100.0}
    else:
        run["idle_causes"] = [{"process": "trainer:0", "cause": "wait_batch", "seconds": 30.0, "fraction": 0.1}]
    return run


def gpu_run(trainer, steady, end_to_end, *, sm=None, steady_state=True, **extra):
    """One throughput run of gpu_check's summary (benchmarks/gpu_check.py `train_run`)."""
    return {"trainer": trainer, "rows_per_step": 32, "steps": 40, "steady_state": steady_state,
            "steady": {"start_step": 3, "end_step": 40, "steps": 37, "seconds": 60.0, "start": 0.0, "end": 60.0},
            "rows_per_s_steady": steady, "rows_per_s_end_to_end": end_to_end,
            "sm_percent_steady": {"median": sm, "samples": 60}, **extra}  # fmt: skip


def gpu_check_summary():
    """gpu_check.sh's summary.json on one GPU (format 2), its figures chosen by hand."""
    runs = {
        "trl/defaults": gpu_run("trl", 20.0, 16.0, sm=20.0, steps_per_generation=1),
        "async/defaults": gpu_run("async", 50.0, 32.0, sm=60.0, max_staleness=8, rows_per_decode_logged=256,
                                  generator_start="cold",
                                  startup={"phases_s": {"spawn -> imports done": 3.0}, "ready_after_spawn_s": 8.0,
                                           "first_batch_after_spawn_s": 9.5}),
        "async/rows_per_decode=256": {"same_as": "async/defaults", "note": "'auto' chose 256 rows per decode"},
        "trl/steps_per_generation=8": gpu_run("trl", 40.0, 30.0, sm=35.0, steps_per_generation=8),
        "async/rows_per_decode=128": gpu_run("async", 30.0, 20.0, steady_state=False, not_steady="stopped by cap"),
    }  # fmt: skip
    sections = {
        "env": {"rc": 0, "seconds": 4, "limit_s": 30, "gpus": ["NVIDIA H200"], "cuda": "13.0",
                "versions": {"torch": "2.11.0", "transformers": "5.17.0", "trl": "1.16.0"}},
        "loss_timing": {"rc": 0, "seconds": 12, "limit_s": 45, "ok": True, "device": "NVIDIA H200",
                        "clock": "CUDA events", "repeats": 50, "warmup": 10,
                        "reference_page": {"gpu": "RTX 4070 Laptop", "shape": "64x256", "grpo_ms": 2.03, "m2po_ms": 5.98},
                        "cases": [{"shape": "64x256", "regime": "a", "regime_name": "near on-policy",
                                   "median_ms": {"dapo": 0.25, "grpo": 0.3, "m2po": 0.5},
                                   "paired_ratio_to_dapo": {"dapo": 1.0, "grpo": 1.2, "m2po": 2.0}}]},
        "m2po_cuda": {"rc": 0, "seconds": 20, "limit_s": 150, "ok": True,
                      "pytest": {"command": "pytest tests/test_losses.py -k cuda", "rc": 0, "summary": "12 passed"}},
        "reward_sync": {"rc": 0, "seconds": 20, "limit_s": 150, "ok": True, "ran": True, "math": "no host sync",
                        "pattern": "no host sync", "pattern_per_row": "no host sync", "format": "no host sync",
                        "length": "no host sync", "math_matches_cpu": True},
        "sharded": {"rc": 0, "seconds": 50, "limit_s": 150, "ok": True,
                    "runs": {"fsdp2/full/x1": {"checks": "passed", "mu_gaps": [[3e-6, 8e-6]], "control_gaps": [[9.5, 12.0]]}}},
        "main_command": {"rc": 0, "seconds": 60, "limit_s": 150, "ok": True, "wall_s": 58.0, "train_runtime_s": 21.5,
                         "command": "accelerate launch recipes/qwen_math.py --max_steps 30", "accuracy_before": 0.1,
                         "accuracy_after": 0.3, "eval_samples": 500, "beside": ["sharded"]},
        "throughput": {"rc": 0, "seconds": 300, "limit_s": 360, "ok": False, "runs": runs,
                       "shape": {"model": "standin", "rows_per_step": 32, "completion_length": 64, "min_steps": 40,
                                 "min_steady_steps": 20, "sweep": [32, 64, 128, 256]},
                       "model": {"parameters": 494_032_768, "dtype": "bfloat16"},
                       "skipped": {"async/rows_per_decode=32": "out of the section's time: needs ~96 s, 20 s left"},
                       # a stale copy of the pairs: the renderer must compute them from the runs
                       "pairs": {"defaults": {"async": "async/defaults", "trl": "trl/defaults", "steady": 9.99}}},
    }  # fmt: skip
    return {"format": 2, "mode": "gpu", "sections": sections, "dmon": {"samples": 400},
            "meta": {"command": "bash benchmarks/gpu_check.sh", "date": "2026-12-05T10:00:00+00:00",
                     "commit": "0123456789abcdef", "machine": "NVIDIA H200, 580.159.04, 143771 MiB",
                     "budget_s": 480, "seconds": 466}}  # fmt: skip


REAL_SIZE_TWO_ARMS = {
    "command": "python benchmarks/bench_real_size.py --pairs 2 --steps 4 --completion-length 64",
    "settings": {"steps": 4, "rows_per_step": 8, "completion_length": 64},
    "runs": [
        real_size_run("async", 0, 100.0),
        real_size_run("sync", 0, 130.0, limit=1.2),
        real_size_run("sync", 1, 110.0, limit=1.4),
        real_size_run("async", 1, 100.0),
    ],
    # a stale summary: the renderer must compute from the runs
    "summary": {"parameters": 494_000_000, "step_time_ratio_sync_over_async": {"median": 9.99}},
}  # 1.30 and 1.10: median 1.20; limits 1.2 and 1.4: median 1.30


def real_size_arm(arm, pair, position, train_seconds, step_seconds, first_generator_step=None, phases=None,
                  spawned=None):  # fmt: skip
    """A run of bench_real_size's four arms. For the async arm: the trainer made the batches of the steps before
    `first_generator_step` itself, spawned its generation process `spawned` seconds after its first step began, and
    the generation process's start-up took `phases` (spawn -> imports done -> model built -> ready -> first batch
    queued, seconds each)."""
    run = {"arm": arm, "pair": pair, "position": position, "train_seconds": train_seconds,
           "wall_seconds": train_seconds + 10.0, "step_seconds": step_seconds}  # fmt: skip
    if arm == "async":
        steps, first = len(step_seconds), first_generator_step
        run.update(
            batch_source=["trainer"] * (first - 1) + ["generator"] * (steps - first + 1),
            trainer_generated_batches=[1.0] * (first - 1) + [0.0] * (steps - first + 1),
            rows_per_decode=[8.0] * (first - 1) + [16.0] * (steps - first + 1),
            startup={"phases": [{"from": a, "to": b, "seconds": s} for a, b, s in zip(
                ("spawn", "imports done", "model built", "ready"),
                ("imports done", "model built", "ready", "first batch queued"), phases, strict=True)]},
            peak_rss_mib={"trainer rank 0": 8192, "generator rank 0": 4096},
            spawn_after_training_start_s=spawned,
        )  # fmt: skip
    if arm == "sync":
        run["limit"] = {"ideal_overlap_ratio": 1.8, "generation_s": 80.0, "training_s": 70.0}
    return run


FIXTURES = {
    # ratios 100/50 = 2.0 and 90/60 = 1.5: median 1.75 [1.50, 2.00]
    "main_job": main_job([(50.0, 100.0, 0.6, 0.5), (60.0, 90.0, 0.6, 0.5)], regime="same_cores"),
    # ratios 30/20 = 1.5 and 33/30 = 1.1
    "main_job_accelerate": main_job([(20.0, 30.0, 0.6, 0.5), (30.0, 33.0, 0.6, 0.5)], regime="accelerate_launch"),
    # accuracy differences +0.04 and -0.02: mean +0.010, standard error stdev / sqrt(2) = 0.030
    "main_job_seeds": main_job([(10.0, 10.0, 0.54, 0.50), (10.0, 10.0, 0.48, 0.50)], seeds=[1, 2]),
    # async − sync accuracy +0.04, −0.02, +0.01: mean +0.010, sd 0.030, se 0.0173; t(0.975, 2 df) = 4.303 gives the
    # 95% interval +0.010 ± 0.0745 = [−0.065, +0.085]. Training time sync / async 1.3, 1.2, 1.4.
    "main_job_seeds_omp2": main_job(
        [(10.0, 13.0, 0.54, 0.50), (10.0, 12.0, 0.48, 0.50), (10.0, 14.0, 0.51, 0.50)],
        regime="omp_num_threads_2",
        seeds=[1, 2, 3],
    ),
    "docs_style": {
        "summary": {"steps": 120},
        "runs": [
            {
                "trainer": t,
                "train_s": s,
                "wall_s": s + 5,
                "rewards": [0.1, 0.2, 0.3, 0.4],
                "pair": p,
                "async_last_log": {"async/trainer_lent_cores_fraction": 0.25} if t == "async" else None,
            }
            for p, (trl, a) in enumerate([(30.0, 20.0), (36.0, 30.0)])
            for t, s in (("trl", trl), ("async", a))
        ],
    },  # ratios 30/20 = 1.5 and 36/30 = 1.2: median 1.35 [1.20, 1.50]
    # Held-out accuracy over 8 seeds: GRPOTrainer 0.40, 0.44, 0.42, 0.38, 0.46, 0.40, 0.42, 0.44; AsyncGRPOTrainer
    # 0.48, 0.40, 0.42, 0.50, 0.38, 0.44, 0.42, 0.48. Async − TRL: +0.08, −0.04, 0, +0.12, −0.08, +0.04, 0, +0.04:
    # mean +0.020, sample sd 0.06414 (squared deviations 0.0036 in all over 7 df), standard error 0.02268;
    # t(0.975, 7 df) = 2.365 gives +0.020 ± 0.05363 = [−0.034, +0.074] (8 df would give [−0.032, +0.072], the
    # normal's 1.96 [−0.024, +0.064]). Time 30 s / 20 s per seed: 1.50×.
    "docs_style_seeds": {
        "summary": {"steps": 120, "seeds": list(range(8))},
        "runs": [
            {"trainer": t, "train_s": s, "wall_s": s + 5, "held_out_accuracy": acc, "seed": seed, "pair": seed}
            for seed, (trl, a) in enumerate(
                zip(
                    (0.40, 0.44, 0.42, 0.38, 0.46, 0.40, 0.42, 0.44),
                    (0.48, 0.40, 0.42, 0.50, 0.38, 0.44, 0.42, 0.48),
                    strict=True,
                )
            )
            for t, s, acc in (
                (("trl", 30.0, trl), ("async", 20.0, a)) if seed % 2 == 0 else (("async", 20.0, a), ("trl", 30.0, trl))
            )
        ],
    },  # fmt: skip
    "tools": {
        # a stale summary ratio: the renderer must compute from the runs
        "summary": {
            "steps": 120,
            "tool_latency_ms": 50.0,
            "speedup_train_s_sync_over_async": {"median": 9.9},
            "held_out_accuracy_before": {"accuracy": 0.0, "n": 200},
        },
        "runs": [
            {"arm": arm, "train_s": seconds, "pair": p, "accuracy_after": {"accuracy": 0.1}}
            for p, (sync, a) in enumerate([(40.0, 20.0), (48.0, 30.0)])
            for arm, seconds in (("sync", sync), ("async", a))
        ],
    },  # ratios 40/20 = 2.0 and 48/30 = 1.6: median 1.80 [1.60, 2.00]
    "async_free": async_bench("free", [20.0, 24.0], [10.0, 16.0]),  # 2.0 and 1.5
    "async_forced64": async_bench("forced64", [40.0], [32.0]),  # 1.25, one repeat
    "components": {
        regime: {
            "completion_length_mean": 20.0,
            "medians_s": {"generate_trl": 0.3, "generate_ours": 0.2, "train_trl": 0.4, "train_ours": 0.25},
        }
        for regime in ("free", "forced64")
    },
    "losses": {
        "threads": 1,
        "tau": 0.04,
        "results": [
            {
                "B": 64,
                "L": 256,
                "regime": r,
                "regime_name": r,
                "repeats": 5,
                "median_ms": {"dapo": 0.5},
                "masked_fraction": {"m2po": m},
                "paired_ratio_to_dapo": {
                    "dapo": {"median": 1.0, "min": 1.0, "max": 1.0},
                    "m2po": {"median": x, "min": x - 0.1, "max": x + 0.1},
                },
            }
            for r, m, x in (("a", 0.0, 0.8), ("b", 0.01, 1.25))
        ],
    },
    "rewards": {
        "regimes": [
            {
                "batch": 64,
                "length": 256,
                "new_golds_per_batch": 8,
                "repeats": 3,
                "cold_ms": {"tensor (prepared)": {"median": 0.5}},
                "paired_ratios": {
                    "decode+regex (prepared) / tensor (prepared)": {"median": 12.0, "min": 3.0, "max": 40.0}
                },
                "paired_ratios_of_cpu_time": {
                    "decode+regex (prepared) / tensor (prepared)": {"median": 7.0, "min": 5.0, "max": 9.0}
                },
            }
        ],
    },
    "is_modes": {
        "steps": 4,
        "seeds": 2,
        "learning_rate": 1e-4,
        "runs": {
            f"{mode}/S1": [{"reward": [0.0, 0.1, 0.2, r], "clipped_fraction": [0.01]} for r in (0.2, 0.4)]
            for mode in ("sequence_mask", "token_truncate")
        },
    },
    "ppo_vs_grpo": {
        "settings": {"steps": 4, "rows_per_step": 64, "temperature": 0.7, "seeds": [0, 1]},
        "runs": [
            {"method": m, "seed": s, "seconds": 10.0, "reward": [0.0, 0.1, 0.2, g], "explained_variance": [None]}
            for m, gains in (("ppo", (0.3, 0.5)), ("grpo", (0.2, 0.2)))
            for s, g in zip((0, 1), gains, strict=True)
        ],
    },  # PPO gains 0.3 and 0.5: +0.400 ± 0.100
    "trl_compat": {
        # three stock passes, two of them kept; the summary's figures are stale and must not be used
        "summary": {"kept": 99, "stock_passes": 100, "collected": 5},
        "tests": {
            "t1": {"stock": {"outcome": "passed"}, "swapped": {"outcome": "passed"}},
            "t2": {"stock": {"outcome": "passed"}, "swapped": {"outcome": "failed"}},
            "t3": {"stock": {"outcome": "passed"}, "swapped": {"outcome": "passed"}},
            "t4": {"stock": {"outcome": "failed"}, "swapped": {"outcome": "passed"}},
        },
    },
    "async_vllm": async_bench("free", [20.0], [25.0]),  # 0.8
    "async_forced256": inflight_bench(),  # in-flight vs gate-only 24/20 = 1.20; accuracy 0.47 - 0.50 = -0.030
    "main_job_omp2": main_job(
        [(40.0, 60.0, 0.6, 0.5), (50.0, 70.0, 0.6, 0.5)], regime="omp_num_threads_2"
    ),  # 1.5, 1.4
    "main_job_two_processes": main_job(
        [(40.0, 64.0, 0.6, 0.5), (50.0, 65.0, 0.6, 0.5)], regime="two_processes"
    ),  # 1.6, 1.3
    "staleness": {
        "regime": "a tiny regime",
        "cells": {
            f"{c}/k={k}/seed={s}": staleness_cell(c, k, s, a)
            for c, k, s, a in (
                ("dapo_is", 0, 0, 0.5),
                ("dapo_is", 0, 1, 0.6),
                ("m2po_paper", 8, 0, 0.4),
                ("m2po_paper", 8, 1, 0.5),
            )
        },
    },  # dapo_is at k=0: 0.550 ± 0.050
    "soak": {
        "command": "python benchmarks/bench_soak.py",
        "steps": 100,
        "sample_every": 50,
        "warmup_steps": 10,
        "rss_growth_limit": 0.1,
        "ok": True,
        "runs": {"lora": soak_run(0.03), "full": soak_run(0.02)},
    },
    "before_after": {
        "commits": {"before": "a" * 40, "after": "b" * 40},
        "jobs": {"docs_style": {"per_pair": [1.1, 0.9], "before_s": [11.0, 9.0], "after_s": [10.0, 10.0]}},
    },  # median 1.00 [0.90, 1.10]
    # Four arms, 7 steps, 2 generation batches per decode: steady state over blocks of 2 steps. Pair 0: the async
    # trainer first trains on a generator batch at step 3, so steps 4-7 are measured: async 22, 20 | 19, 17 -> blocks
    # 21, 18 -> 19.5 s; trl 40, 40 | 38, 38 -> 39 (2.00); trl_spg 48, 10 | 46, 13 -> 29.25 (1.50); sync 23.4 (1.20).
    # Pair 1: first at step 2, steps 3-7 leave 5, the earliest dropped: steps 4-7; async 20, trl 36 (1.80), trl_spg
    # 26 (1.30), sync 20 (1.00). Steady: 1.90x [1.80, 2.00], 1.40x [1.30, 1.50], 1.10x [1.00, 1.20]. End to end
    # (train seconds / async's 200): trl 340, 380 -> 1.80x [1.70, 1.90]; trl_spg 280, 300 -> 1.45x [1.40, 1.50];
    # sync 260, 240 -> 1.25x [1.20, 1.30]. Start-up after spawn: pair 0 1.0, 2.5, 2.8, 32.8; pair 1 1.2, 2.9, 3.2,
    # 31.2: medians imports 1.1, built 2.7, ready 3.0 [2.8, 3.2], first batch 32.0. Spawned 19 and 21 s after the
    # trainer's first step began: median 20.0; ready 21.8 and 24.2 s after it: median 23.0.
    "real_size": {
        "command": "python benchmarks/bench_real_size.py --pairs 2 --steps 7 --completion-length 64",
        "settings": {
            "steps": 7,
            "rows_per_step": 8,
            "completion_length": 64,
            "shape": "0.5b",
            "items_per_decode": 2,
            "rows_per_generation_batch": 8,
            "max_staleness": 3,
            "min_steady_steps": 4,
        },
        "runs": [
            real_size_arm(
                "async", 0, 0, 200.0, [40.0, 35.0, 30.0, 22.0, 20.0, 19.0, 17.0], 3, (1.0, 1.5, 0.3, 30.0), 19.0
            ),
            real_size_arm("sync", 0, 1, 260.0, [30.0, 30.0, 30.0, 23.4, 23.4, 23.4, 23.4]),
            real_size_arm("trl", 0, 2, 340.0, [50.0, 40.0, 40.0, 40.0, 40.0, 38.0, 38.0]),
            real_size_arm("trl_spg", 0, 3, 280.0, [60.0, 20.0, 50.0, 48.0, 10.0, 46.0, 13.0]),
            real_size_arm("trl_spg", 1, 0, 300.0, [60.0, 20.0, 50.0, 26.0, 26.0, 26.0, 26.0]),
            real_size_arm("trl", 1, 1, 380.0, [50.0, 40.0, 40.0, 36.0, 36.0, 36.0, 36.0]),
            real_size_arm("sync", 1, 2, 240.0, [30.0, 30.0, 30.0, 20.0, 20.0, 20.0, 20.0]),
            real_size_arm(
                "async", 1, 3, 200.0, [40.0, 30.0, 25.0, 20.0, 20.0, 20.0, 20.0], 2, (1.2, 1.7, 0.3, 28.0), 21.0
            ),
        ],
        "summary": {"parameters": 494_000_000},
    },
    "timeline_overhead": {
        "per_call_ns": {"span_kept_ns": 300.0, "set_step_ns": 500.0},
        "per_step_ns": 14000.0,
        "merge_10k_steps_s": 0.07,
        "merge_10k_steps_trace_mb": 1.4,
        "overhead": {
            "step_0.2s": {"recording_fraction": 7e-5, "with_merges_fraction": 0.0012},
            "step_0.5s": {"recording_fraction": 3e-5, "with_merges_fraction": 0.0010},
        },
    },
    "gpu_check": gpu_check_summary(),
    "vllm_backends": {
        "settings": {"rows": 8, "max_new_tokens": 4, "threads": 1},
        "startup_s": {"hf": 1.0, "vllm": 9.0},
        "repeats": [
            {
                "hf": {"update_s": 0.001, "generate_s": 0.2, "tokens": 32},
                "vllm": {"update_s": 0.05, "generate_s": 0.3, "tokens": 32},
            }
        ],
    },
}
# The same four arms, the asynchronous run with a `max_rows_per_decode` of its own (its bound derived for it).
FIXTURES["real_size_rows32"] = {
    **FIXTURES["real_size"],
    "settings": {**FIXTURES["real_size"]["settings"], "max_rows_per_decode": 16},
}

README = "# Project\n\nIntro.\n\n{start}\nold table\n{end}\n\n## After\n\nUnchanged text.\n"


def render_only(tmp_path, *extra) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    cmd = [sys.executable, RUN_ALL, "--render-only", "--results-dir", str(tmp_path / "results"),
           "--earlier-dir", str(tmp_path / "results"),
           "--output", str(tmp_path / "RESULTS.md"), "--readme", str(tmp_path / "README.md"), *extra]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def write_results(tmp_path, names) -> dict:
    module = run_all_module()
    benchmarks = {b.name: b for b in module.REGISTRY}
    folder = tmp_path / "results"
    folder.mkdir(exist_ok=True)
    for name in names:
        (folder / benchmarks[name].output).write_text(json.dumps(FIXTURES[name]))
    (tmp_path / "README.md").write_text(README.format(start=module.README_START, end=module.README_END))
    return benchmarks


# ------------------------------------------------------------------------------------------------ tests


def test_every_registered_benchmark_has_a_fixture_here():
    """A benchmark added to the registry without a fixture here would go unrendered by this test: add one."""
    assert {b.name for b in registry()} == set(FIXTURES)


def test_render_only_renders_every_section_from_the_per_run_records(tmp_path):
    benchmarks = write_results(tmp_path, FIXTURES)
    proc = render_only(tmp_path, "--strict")
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (tmp_path / "RESULTS.md").read_text()
    assert "Do not edit by hand" in text
    for index, bench in enumerate(benchmarks.values(), 1):
        assert f"## {index}. {bench.title}" in text
        assert f"]({os.path.join('results', bench.output)})" in text  # each section links its own results file
    assert "_Not measured yet._" not in text
    # figures worked out by hand from the runs above (never the stale summaries)
    assert "**1.75× [1.50, 2.00] over 2 pairs**" in text  # main job, same cores
    assert "**1.30× [1.10, 1.50] over 2 pairs**" in text  # main job, accelerate launch
    assert "**1.35× [1.20, 1.50] over 2 pairs**" in text  # docs-style script
    assert "**1.80× [1.60, 2.00] over 2 pairs**" in text  # a tool of 50 ms per call
    assert "9.99" not in text
    assert "+0.010 ± 0.030 (mean ± standard error over 2 seeds)" in text  # accuracy over seeds
    assert "the synchronous gain alone ranges from +0.200 to +0.200" in text
    assert "+0.010 ± 0.017 (mean ± standard error over 3 seeds), 95% interval [-0.065, +0.085]" in text  # omp2 seeds
    assert "median 1.30× [1.20, 1.40] over 3 pairs" in text  # the seeds study's paired training time
    assert "1.75× [1.50, 2.00] over 2 repeats" in text  # bench_async, free
    assert "1.25× (1 repeat)" in text  # bench_async, forced 64
    assert "0.80× (1 repeat)" in text  # vLLM backend in training
    assert "PPO +0.400 ± 0.100" in text
    assert "2 of the 3 stock passes kept (66.7%)" in text
    assert "7.0× by CPU time, 12.0× by wall time" in text
    assert "0.80× with 0% masked; 1.25× with 1% masked" in text
    assert "1.50× (1 repeat)" in text  # vLLM / hf generation seconds, 0.3 / 0.2
    assert "1.20× (1 repeat)" in text and "-0.030" in text  # in-flight against the gate-only engine
    assert "**1.45× [1.40, 1.50] over 2 pairs**" in text  # main job, OMP_NUM_THREADS=2
    assert "0.550 ± 0.050 (n=2)" in text and "0.450 ± 0.050 (n=2)" in text  # staleness cells over seeds
    assert "flat (largest RSS growth after warm-up +3.0%)" in text
    assert "1.00× [0.90, 1.10] over 2 pairs" in text  # before / after
    # real size: each arm against the asynchronous run, on the steps after its generation process's first batch
    assert (
        "vs TRL's `GRPOTrainer` **1.90× [1.80, 2.00] over 2 pairs** (end to end 1.80× [1.70, 1.90] over 2 pairs); "
        "vs TRL with `steps_per_generation=2` **1.40× [1.30, 1.50] over 2 pairs** (end to end 1.45× [1.40, 1.50] over "
        "2 pairs); vs our synchronous mode **1.10× [1.00, 1.20] over 2 pairs** (end to end 1.25× [1.20, 1.30] over 2 "
        "pairs); generation process ready 3.0 s after spawn, 23.0 s after training began"
    ) in text
    assert "imports done 1.1 s, model built 2.7 s, ready 3.0 s, first batch queued 32.0 s" in text
    assert (
        "Built and ready **3.0 s [2.8, 3.2] after spawn**. The trainer spawned it **20.0 s** after its first step "
        "began, so it was ready 23.0 s after training began." in text
    )
    assert (
        "per pair: 3, 2 (the `async/trainer_generated_batches` metric agrees); steps measured after it: 4, 4." in text
    )
    assert (
        "`async/rows_per_decode` from the first step on a generation-process batch on: median 16 (the config "
        "decodes 2 generation batches of 8 rows = 16 rows per call)" in text
    )
    # how the asynchronous arm decodes: the config's defaults, or the rows the run chose
    assert "M2PO, at its defaults: 2 generation batches decoded per call, max_staleness 3" in text
    assert "async `--max_rows_per_decode 16`: 2 generation batches decoded per call, max_staleness 3" in text
    assert "≤ 0.12% (upper bound" in text  # timeline overhead: the larger share
    # the GPU check: pairs from the runs (50 / 20, 50 / 40: 'auto' chose 256 rows, matched by TRL's 8 steps), never
    # from a run that did not reach its steady state (128 rows per decode)
    assert "**2.50×** (SM 60% / 20%)" in text
    assert "`async/defaults` / `trl/defaults` | **2.50×** | 2.00×" in text
    assert "256 rows per decode vs TRL, same steps_per_generation: `async/rows_per_decode=256` / " in text
    assert "**1.25×** | 1.07×" in text
    assert "128 rows per decode" not in text and "**not steady**" in text
    assert "≥ 3× TRL's default rows/s: best 2.50×" in text and "not met" in text
    assert "SM utilisation ≥ 50%: best 60% (`async/defaults`), met" in text
    assert "generator ready ≤ 10 s after spawn: 8.0 s (`async/defaults`), met" in text
    # the docs-style script over seeds: async − TRL paired by seed, Student's t with n − 1 = 7 degrees of freedom
    assert "+0.020 ± 0.023 (mean ± standard error over 8 seeds, 95% interval [-0.034, +0.074])" in text
    assert (
        "`AsyncGRPOTrainer` higher on 4 of 8 seeds, lower on 2. `GRPOTrainer` alone ranges from 0.380 to 0.460."
        in text
    )
    assert "paired by seed: 1.50× [1.50, 1.50] over 8 pairs." in text


def test_render_only_rewrites_only_the_readme_table(tmp_path):
    write_results(tmp_path, FIXTURES)
    proc = render_only(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    readme = (tmp_path / "README.md").read_text()
    module = run_all_module()
    head, rest = readme.split(module.README_START, 1)
    table, tail = rest.split(module.README_END, 1)
    assert head == "# Project\n\nIntro.\n\n" and tail == "\n\n## After\n\nUnchanged text.\n"
    assert "old table" not in table
    assert "**1.75× [1.50, 2.00] over 2 pairs**" in table
    assert "](results/bench_main_job.json)" in table  # links from README's folder to the results file


def test_the_table_legend_explains_only_the_marks_its_rows_use(tmp_path):
    """README's legend defines _earlier_ only while a row is marked earlier (issue 33: no 'earlier' row left)."""
    benchmarks = write_results(tmp_path, FIXTURES)
    module = run_all_module()

    def table() -> str:
        proc = render_only(tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return (tmp_path / "README.md").read_text().split(module.README_START, 1)[1].split(module.README_END, 1)[0]

    assert "(earlier)" not in table() and "_earlier_" not in table()
    # one benchmark known only from its earlier measurement: its row is marked, and the legend says what that means
    bench = benchmarks["docs_style"]
    earlier = tmp_path / "results" / bench.earlier.files[0]
    earlier.parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "results" / bench.output).rename(earlier)
    shown = table()
    assert "(earlier)" in shown and "_earlier_: measured before `benchmarks/run_all.py` existed" in shown


def test_the_main_job_states_what_the_cores_allow_from_a_one_thread_run_of_the_same_machine(tmp_path):
    """The bound that no overlap can beat on C cores: the synchronous run's median over (the one-thread synchronous
    median / C). Here 95 s (sync 100 and 90) over 76 s / 2 cores = 2.50×; drawn only from a reference whose
    synchronous run computed on one thread, on the same kind of machine."""
    write_results(tmp_path, FIXTURES)
    machine = {"cpu": "Test CPU", "cores": 2}
    stamp = {"mode": "full", "command": "python benchmarks/bench_main_job.py", "started": "2026-12-04T10:00:00+00:00",
             "seconds": 100.0, "machine": machine}  # fmt: skip
    same_cores = json.loads(json.dumps(FIXTURES["main_job"]))
    same_cores["run_all"] = stamp
    reference = main_job([(40.0, 76.0, 0.6, 0.5), (40.0, 76.0, 0.6, 0.5)], regime="accelerate_launch")
    reference["environment"]["seen_by_the_recipe"].update(torch_num_threads=1, usable_cores=2)
    reference["run_all"] = dict(stamp)
    folder = tmp_path / "results"

    def rendered(reference_file: dict) -> tuple[str, str]:
        (folder / "bench_main_job.json").write_text(json.dumps(same_cores))
        (folder / "bench_main_job_accelerate.json").write_text(json.dumps(reference_file))
        proc = render_only(tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return (tmp_path / "RESULTS.md").read_text(), (tmp_path / "README.md").read_text()

    results, readme = rendered(reference)
    assert "**1.75× [1.50, 2.00] over 2 pairs** (55 s vs 95 s, 2 cores allow at most 2.50×)" in readme
    assert "takes 76.0 s" in results and "no less than 38.0 s" in results and "95.0 / 38.0 = **2.50×**" in results
    # no bound from a reference run on two threads, or on another kind of machine
    two_threads = json.loads(json.dumps(reference))
    two_threads["environment"]["seen_by_the_recipe"]["torch_num_threads"] = 2
    other_machine = json.loads(json.dumps(reference))
    other_machine["run_all"]["machine"] = {"cpu": "Another CPU", "cores": 2}
    for unusable in (two_threads, other_machine):
        results, readme = rendered(unusable)
        assert "cores allow" not in results and "cores allow" not in readme


def test_a_real_size_file_from_before_the_trl_arms_still_renders(tmp_path):
    """The two-arm results (async and sync, `mode` per run) render as they did: sync / async per pair."""
    write_results(tmp_path, FIXTURES)
    (tmp_path / "results" / "bench_real_size.json").write_text(json.dumps(REAL_SIZE_TWO_ARMS))
    proc = render_only(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (tmp_path / "RESULTS.md").read_text()
    assert "**1.20× [1.10, 1.30] over 2 pairs** (limit 1.30×)" in text
    assert "9.99" not in text


def test_the_main_job_seeds_section_links_its_picture_of_learning_at_equal_wall_time(tmp_path):
    write_results(tmp_path, FIXTURES)
    (tmp_path / "results" / "bench_main_job_seeds_equal_time.png").write_bytes(b"not really a PNG")
    proc = render_only(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (tmp_path / "RESULTS.md").read_text()
    section = text.split("## 5. The main job over seeds", 1)[1].split("\n## ", 1)[0]
    assert "(the accuracy reached at equal wall time)](results/bench_main_job_seeds_equal_time.png)" in section


def test_the_main_job_places_the_steps_its_timeline_did_not_keep_between_the_kept_ones():
    """`bench_main_job.step_end_seconds`: the kept steps' ends from the track's start (0.5 s); steps 3 and 4, not
    kept, on the line from step 2 (ending at 4.5 s) to step 5 (10.5 s): 6.5 and 8.5 s; step 6, after the last kept
    one, on the line to the end of training (13 s)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("bench_main_job_under_test", os.path.join(ROOT, "benchmarks",
                                                      "bench_main_job.py"))  # fmt: skip
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    kept = [(None, 0.5, 0.8), (0, 0.8, 2.5), (1, 2.5, 5.0), (4, 8.5, 11.0)]
    assert module.step_end_seconds(kept, last_step=6, train_seconds=13.0) == [2.0, 4.5, 6.5, 8.5, 10.5, 13.0]


def test_a_missing_results_file_is_never_rendered_silently(tmp_path):
    benchmarks = write_results(tmp_path, [n for n in FIXTURES if n != "main_job"])
    # without --strict: the headline is shown as not measured, with the command that measures it
    proc = render_only(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (tmp_path / "RESULTS.md").read_text()
    section = text.split(f"## 1. {benchmarks['main_job'].title}", 1)[1].split("\n## ", 1)[0]
    assert "_Not measured yet._" in section and "benchmarks/bench_main_job.py" in section
    # --strict: an error that names it
    proc = render_only(tmp_path, "--strict")
    assert proc.returncode != 0 and "main_job" in proc.stderr
    # a benchmark whose own file and earlier measurement are both missing: an error naming the earlier file
    (tmp_path / "results" / benchmarks["docs_style"].output).unlink()
    proc = render_only(tmp_path)
    assert proc.returncode != 0
    assert benchmarks["docs_style"].earlier.files[0] in proc.stderr
