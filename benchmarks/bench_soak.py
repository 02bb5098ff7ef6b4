"""Soak: long asynchronous runs of the tiny job keep memory, file descriptors, threads, processes and /dev/shm flat.

    python benchmarks/bench_soak.py                                  # LoRA and full fine-tuning, 1,000 steps each
    python benchmarks/bench_soak.py --steps 120 --sample-every 10 --warmup-steps 40   # the short version (CI's test)

Each mode runs in a fresh process: the README's tiny job (`recipes/configs/tiny.yaml`: the bundled model, arithmetic
prompts, the tensor-native reward, M2PO, max_staleness 1) for `--steps` optimizer steps, with no checkpoints, under the
caller's thread settings (unset: as a user runs it), once as a full fine-tune and once with LoRA (r=8 on every linear
layer). Every `--sample-every` steps, at the end of the step, it samples:

* the resident memory (RSS) of the trainer and of its generation process;
* their open file descriptors and OS threads, and the number of processes below the trainer (the generation
  process, its fork server, the spool janitor, multiprocessing's resource tracker);
* the files in the queue's spool folder and the /dev/shm entries that belong to the run (named after its pids).

Checks, after the warm-up (`--warmup-steps`; the reference is its last 3 samples): RSS of each process never exceeds
their mean by more than 10%, and no count grows: the smallest value over the last quarter of the samples is at most
their largest (a transient file open at one sample is not growth; a leak of one per interval is). The one allowance:
with core lending, a process's OpenMP pool grows once, from its share of threads to the rank's budget, the first time
it computes on lent cores (`allowance`). Writes
benchmarks/results/bench_soak.json (every sample, the checks and their verdicts) and bench_soak.png beside it;
exits non-zero if a check fails. `tests/test_soak.py` runs the short version and checks the samples itself.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
MODES = {"full": [], "lora": ["--use_peft", "true", "--lora_r", "8", "--lora_alpha", "16", "--lora_target_modules", "all-linear"]}  # fmt: skip
RSS_GROWTH_LIMIT = 0.10
REFERENCE_SAMPLES = 3  # the end of the warm-up: its last samples
COUNTS = ("trainer_fds", "generator_fds", "trainer_threads", "generator_threads", "processes", "spool_files", "shm_entries")  # fmt: skip


# ------------------------------------------------------------------------------------------------- worker (one mode)
def _descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _sample(trainer, step: int, started: float) -> dict:
    import psutil

    rollout = trainer._rollout
    me, generator = psutil.Process(), psutil.Process(rollout.process.pid)
    pids = (str(os.getpid()), str(generator.pid))
    shm = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    lending = rollout._lending  # with core lending, a process's OpenMP pool grows to the lent count the first time
    pool_growth = (0, 0) if lending is None else tuple(lending.cores - share for share in lending.shares)
    return {
        "step": step,
        "seconds": round(time.perf_counter() - started, 1),
        "trainer_rss_mib": me.memory_info().rss / 2**20,
        "generator_rss_mib": generator.memory_info().rss / 2**20,
        "trainer_fds": me.num_fds(),
        "generator_fds": generator.num_fds(),
        "trainer_threads": me.num_threads(),
        "generator_threads": generator.num_threads(),
        "trainer_pool_growth": pool_growth[0],
        "generator_pool_growth": pool_growth[1],
        "processes": len(_descendants(os.getpid())),
        "spool_files": len(os.listdir(rollout.queue.spool_dir)),
        "shm_entries": sum(1 for e in shm if any(f"-{pid}-" in e or e.startswith(f"torch_{pid}_") for pid in pids)),
    }


def run_mode(mode: str, steps: int, every: int, out: str) -> None:
    """One soak run (in this process); writes its samples to `out`."""
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    from qwen_math import load_model_and_tokenizer, load_train_dataset, make_rewards, parse_args
    from transformers import TrainerCallback
    from trl import get_peft_config

    from trl_async import AsyncGRPOTrainer

    samples: list[dict] = []

    class Sampler(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % every == 0:
                samples.append(_sample(trainer, state.global_step, self.started))

    with tempfile.TemporaryDirectory(prefix="bench_soak-") as output_dir:
        argv = ["--max_steps", str(steps), "--output_dir", output_dir, "--save_strategy", "no", *MODES[mode]]
        recipe, training_args, model_args = parse_args(argv)
        model, tokenizer = load_model_and_tokenizer(model_args.model_name_or_path, model_args)
        trainer = AsyncGRPOTrainer(
            model=model,
            reward_funcs=make_rewards(recipe, tokenizer),
            args=training_args,
            train_dataset=load_train_dataset(recipe, seed=training_args.seed),
            processing_class=tokenizer,
            peft_config=get_peft_config(model_args),
        )
        trainer.add_callback(Sampler())
        trainer.train()
    with open(out, "w") as f:
        json.dump({"mode": mode, "steps": steps, "samples": samples}, f)


# ------------------------------------------------------------------------------------------------- checks
def allowance(key: str, reference: dict) -> int:
    """How far a count may exceed its reference without growing: a process's OS threads by the OpenMP threads its pool
    adds the first time it computes on cores lent by the other process (`rollout.cores`: from its share to the rank's
    budget, once); nothing else."""
    if key in ("trainer_threads", "generator_threads"):
        return reference[key.replace("threads", "pool_growth")]
    return 0


def checks(samples: list[dict], warmup_steps: int) -> dict:
    """The soak's verdicts on one run's samples (see the module docstring). The reference is the end of the warm-up,
    its last `REFERENCE_SAMPLES` samples, so that one sample taken at a dip or a transient does not set it: their mean
    RSS, and the largest value of each count."""
    end = max(i for i, s in enumerate(samples) if s["step"] <= max(warmup_steps, samples[0]["step"]))
    window, after = samples[max(0, end + 1 - REFERENCE_SAMPLES) : end + 1], samples[end + 1 :]
    if len(after) < 2:
        raise ValueError("too few samples after the warm-up: run more steps or sample more often")
    last_quarter = after[-max(2, len(after) // 4) :]
    result = {"reference_steps": [s["step"] for s in window]}
    for key in ("trainer_rss_mib", "generator_rss_mib"):
        reference = sum(s[key] for s in window) / len(window)
        growth = max(s[key] for s in after) / reference - 1.0
        result[key] = {"reference": reference, "max_growth": growth, "ok": growth <= RSS_GROWTH_LIMIT}
    for key in COUNTS:
        reference = max(s[key] for s in window)
        floor = min(s[key] for s in last_quarter)
        allowed = reference + allowance(key, window[-1])
        result[key] = {"reference": reference, "allowed": allowed, "last_quarter_min": floor, "ok": floor <= allowed}
    result["ok"] = all(v["ok"] for v in result.values() if isinstance(v, dict))
    return result


def plot(runs: dict, warmup_steps: int, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = [
        ("RSS (MiB)", ("trainer_rss_mib", "generator_rss_mib")),
        ("open file descriptors", ("trainer_fds", "generator_fds")),
        ("OS threads", ("trainer_threads", "generator_threads")),
        ("processes, spool files, /dev/shm entries", ("processes", "spool_files", "shm_entries")),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (title, keys) in zip(axes, panels, strict=True):
        for mode, run in runs.items():
            steps = [s["step"] for s in run["samples"]]
            for key in keys:
                ax.plot(steps, [s[key] for s in run["samples"]], marker=".", label=f"{mode}: {key}")
        ax.axvline(warmup_steps, color="grey", linestyle=":", linewidth=1)
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.legend(fontsize=7)
    fig.suptitle("trl_async soak: the tiny job, asynchronous (warm-up ends at the dotted line)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--sample-every", type=int, default=50)
    parser.add_argument("--warmup-steps", type=int, default=200)
    parser.add_argument("--modes", default="lora,full")
    parser.add_argument("--out", default=os.path.join(RESULTS, "bench_soak.json"))
    parser.add_argument("--run-mode", help=argparse.SUPPRESS)  # internal: run one mode in this process
    parser.add_argument("--run-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_mode:
        run_mode(args.run_mode, args.steps, args.sample_every, args.run_out)
        return 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    env.setdefault("HF_HUB_OFFLINE", "1")
    runs = {}
    with tempfile.TemporaryDirectory(prefix="bench_soak-") as scratch:
        for mode in args.modes.split(","):
            run_out = os.path.join(scratch, f"{mode}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--run-mode", mode, "--run-out", run_out,
                   "--steps", str(args.steps), "--sample-every", str(args.sample_every)]  # fmt: skip
            started = time.perf_counter()
            proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"the {mode} soak run failed:\n{proc.stderr[-5000:]}")
            with open(run_out) as f:
                runs[mode] = json.load(f)
            runs[mode]["wall_seconds"] = round(time.perf_counter() - started, 1)
            runs[mode]["checks"] = checks(runs[mode]["samples"], args.warmup_steps)
            print(f"[bench_soak] {mode}: {'flat' if runs[mode]['checks']['ok'] else 'GROWS'} "
                  f"{json.dumps(runs[mode]['checks'])}", flush=True)  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    picture = plot(runs, args.warmup_steps, os.path.splitext(args.out)[0] + ".png")
    result = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "steps": args.steps,
        "sample_every": args.sample_every,
        "warmup_steps": args.warmup_steps,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "rss_growth_limit": RSS_GROWTH_LIMIT,
        "runs": runs,
        "ok": all(r["checks"]["ok"] for r in runs.values()),
        "picture": picture,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(
        f"[bench_soak] {'flat' if result['ok'] else 'SOMETHING GROWS'}: {args.out}"
        + (f", {picture}" if picture else "")
    )
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
