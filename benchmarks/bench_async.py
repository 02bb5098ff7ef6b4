"""Throughput and learning of AsyncGRPOTrainer against TRL's GRPOTrainer, side by side in one invocation.

    python benchmarks/bench_async.py                      # headline (free length) + forced 64 tokens, 3 repeats
    python benchmarks/bench_async.py --quick              # smoke: 10 steps, one repeat, free length only

Setup: the bundled tiny model, generated arithmetic, 4 prompts x 8 generations per optimizer step, 60 optimizer
steps, the same text reward. Every contender runs the SAME configuration, TRL's defaults (gradient checkpointing on,
`use_cache` as TRL leaves it), and every run is a fresh Python process with default thread settings, as a user runs
it (OMP_NUM_THREADS is removed from the environment). Contenders, interleaved within each repeat so machine noise hits
all alike:

* `trl`: TRL's GRPOTrainer (synchronous: generate, then train), the baseline every ratio is taken against;
* `async-dapo`: AsyncGRPOTrainer with TRL's default loss (dapo) and its importance correction, default staleness;
* `async-m2po`: AsyncGRPOTrainer with loss_type m2po, default staleness;
* `async-dapo-S2`: dapo with max_staleness=2;
* `async-vllm` (only when asked for, with `--vllm-python`): dapo with the vLLM backend, in the vLLM environment;
* `async-dapo-inflight`, `async-dapo-S2-inflight` (asked for with `--contenders`): the same with in-flight weight
  updates (`inflight_weight_updates=True`), beside the gate-only engine at the same staleness.

Headline: completions left free (the tiny model stops after ~20 tokens; the cap is TRL's default), end to end: the
seconds of `trainer.train()`, start-up of the generation process included. Ratios are paired per repeat (trl seconds
/ contender seconds in the same repeat), reported as median [min, max]. Beside it, a regime chosen to make generation
heavy: completions forced to 64 tokens with `min_new_tokens`. Steady-state rows/s (after step 5) are reported too,
never instead of the end-to-end figure. The learning check: the mean reward of the last quarter of steps (mean ±
standard error over repeats) must not fall below TRL's.
Cores: every contender gets the same cores. Each run is `python` on this file with OMP_NUM_THREADS and MKL_NUM_THREADS
removed (no launcher that sets them), so TRL's GRPOTrainer computes on every core with torch's default thread count,
and AsyncGRPOTrainer splits the same cores between its trainer and its generation process.
Writes benchmarks/results/bench_async{tag}.json (or --output) and, beside it, a PNG of reward against wall-clock time
per regime.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

# Every contender runs TRL's default configuration; only the trainer class, the loss type and the staleness differ.
CONTENDERS = {
    "trl": {"trainer": "trl", "loss_type": "dapo"},
    "async-dapo": {"trainer": "async", "loss_type": "dapo"},
    "async-m2po": {"trainer": "async", "loss_type": "m2po"},
    "async-dapo-S2": {"trainer": "async", "loss_type": "dapo", "max_staleness": 2},
    # The vLLM backend (colocated engine in the generation process) beside the hf one. Its runs use the interpreter
    # of the vLLM environment (--vllm-python; vLLM pins other transformers/torch builds than the main venv), so they
    # run only when asked for: --contenders trl,async-dapo,async-vllm --vllm-python /work/venv-vllm/bin/python.
    "async-vllm": {"trainer": "async", "loss_type": "dapo", "generation_backend": "vllm"},
    "async-dapo-inflight": {"trainer": "async", "loss_type": "dapo", "inflight_weight_updates": True},
    "async-dapo-S2-inflight": {
        "trainer": "async",
        "loss_type": "dapo",
        "max_staleness": 2,
        "inflight_weight_updates": True,
    },
}
DEFAULT_CONTENDERS = ("trl", "async-dapo", "async-m2po", "async-dapo-S2")
REGIMES = {
    "free": {"force_length": False},
    "forced64": {"force_length": True, "completion_length": 64},
    # Past the tiny model's 256 positions with the prompt (RoPE extrapolates; the text is not the point): generation
    # heavy, as real completion lengths are (asked for with --regimes).
    "forced256": {"force_length": True, "completion_length": 256},
}


# ------------------------------------------------------------------------------------------------ one run (worker)
def run_worker(config: dict) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl_async.rewards import math_answer_text_reward
    from trl_async.toy import make_arithmetic_dataset, tiny_model_path

    class Clock(TrainerCallback):
        def __init__(self):
            self.step_end = []

        def on_step_end(self, args, state, control, **kwargs):
            self.step_end.append(time.perf_counter())

    length = config.get("completion_length")
    optional = {"max_completion_length": length} if length else {}  # free: TRL's default cap
    for name in ("max_staleness", "generation_backend", "inflight_weight_updates"):
        if name in config:
            optional[name] = config[name]
    args = AsyncGRPOConfig(
        output_dir=config["output_dir"],
        max_steps=config["steps"],
        per_device_train_batch_size=32,
        num_generations=8,
        generation_kwargs={"min_new_tokens": length} if config["force_length"] else None,
        learning_rate=config["learning_rate"],
        lr_scheduler_type="constant",
        temperature=1.0,
        beta=0.0,
        loss_type=config["loss_type"],
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        seed=config["seed"],
        **optional,
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    trainer_cls = AsyncGRPOTrainer if config["trainer"] == "async" else GRPOTrainer
    clock = Clock()
    trainer = trainer_cls(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_path()),
        reward_funcs=math_answer_text_reward,
        args=args,
        train_dataset=make_arithmetic_dataset(num_train=2000, seed=config["seed"])["train"],
        processing_class=tokenizer,
        callbacks=[clock],
    )
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start
    logs = [h for h in trainer.state.log_history if "reward" in h]
    accuracy = None
    if config.get("eval_accuracy"):  # held-out greedy accuracy after training, beside the reward
        from trl_async.toy import greedy_accuracy

        held_out = make_arithmetic_dataset(num_train=2000, num_test=500, seed=config["seed"])["test"]
        accuracy = greedy_accuracy(trainer.accelerator.unwrap_model(trainer.model).eval(), tokenizer, held_out)
    return {
        "config": config,
        "start": start,
        "train_s": train_s,
        "step_end": [t - start for t in clock.step_end],
        "reward": [h["reward"] for h in logs],
        "mean_length": statistics.mean(h["completions/mean_length"] for h in logs),
        "trainer_wait_s": [h.get("async/trainer_wait_s", 0.0) for h in logs],
        "generator_wait_s": [h.get("async/generator_wait_s", 0.0) for h in logs],
        "evicted_rows": sum(h.get("async/evicted", 0.0) for h in logs),
        "staleness_mean": statistics.mean(h.get("async/staleness_mean", 0.0) for h in logs),
        "rows_per_step": 32,
        "held_out_accuracy": accuracy,
        "token_age_mean": statistics.mean(
            h.get("offpolicy/token_age_mean", h.get("async/staleness_mean", 0.0)) for h in logs
        ),  # fmt: skip
        "offpolicy_ess": statistics.mean(h["offpolicy/ess"] for h in logs if "offpolicy/ess" in h)
        if any("offpolicy/ess" in h for h in logs)
        else None,
    }


def run_probe(config: dict) -> dict:
    """Single-threaded time of one generation batch and one training step (forward + backward + AdamW)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from trl_async.toy import make_arithmetic_dataset, tiny_model_path

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    prompts = [p for p in make_arithmetic_dataset(num_train=64, num_test=8)["train"]["prompt"][:4] for _ in range(8)]
    inputs = tokenizer.apply_chat_template(
        prompts, add_generation_prompt=True, tokenize=True, return_dict=True, padding=True, return_tensors="pt"
    )
    length = config.get("completion_length") or 24  # free regime: about what the tiny model writes
    generation_config = GenerationConfig(
        max_new_tokens=length,
        min_new_tokens=length if config["force_length"] else 0,
        do_sample=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.eval()
    gen_times, train_times = [], []
    for _ in range(5):
        t = time.perf_counter()
        with torch.no_grad():
            sequences = model.generate(**inputs, generation_config=generation_config)
        gen_times.append(time.perf_counter() - t)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for _ in range(5):
        t = time.perf_counter()
        logps = model(sequences).logits.float().log_softmax(-1)
        logps.mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        train_times.append(time.perf_counter() - t)
    return {"generate_s": statistics.median(gen_times), "train_s": statistics.median(train_times)}


def spawn(kind: str, config: dict, python: str = sys.executable) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["HF_HUB_OFFLINE"] = "1"
    if python != sys.executable:  # another environment (vLLM's): this checkout's trl_async comes first
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(HERE), env.get("PYTHONPATH")]))
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [python, os.path.abspath(__file__), f"--{kind}", json.dumps(config), "--out", out.name]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"{kind} run failed:\n{proc.stderr[-4000:]}")
        return json.load(open(out.name))


# ------------------------------------------------------------------------------------------------ analysis
def summarize(run: dict, warmup_steps: int) -> dict:
    ends = run["step_end"]
    steady_s = ends[-1] - ends[warmup_steps - 1]
    steady_steps = len(ends) - warmup_steps
    steady_wall = sum(b - a for a, b in zip(ends[warmup_steps - 1 : -1], ends[warmup_steps:], strict=True))
    trainer_wait = sum(run["trainer_wait_s"][warmup_steps:])
    generator_wait = sum(run["generator_wait_s"][warmup_steps:])
    quarter = max(1, len(run["reward"]) // 4)
    return {
        "train_s": run["train_s"],
        "rows_per_s_end_to_end": len(ends) * run["rows_per_step"] / run["train_s"],
        "rows_per_s_steady": steady_steps * run["rows_per_step"] / steady_s,
        "trainer_wait_fraction": trainer_wait / steady_wall,
        "generator_wait_fraction": generator_wait / steady_wall,
        "eviction_rate": run["evicted_rows"] / (len(ends) * run["rows_per_step"]),
        "last_quarter_reward": statistics.mean(run["reward"][-quarter:]),
        "mean_completion_length": run["mean_length"],
        "staleness_mean": run["staleness_mean"],
        "held_out_accuracy": run.get("held_out_accuracy"),
        "token_age_mean": run.get("token_age_mean"),
        "offpolicy_ess": run.get("offpolicy_ess"),
    }


def mean_se(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], float("nan")
    return statistics.mean(values), statistics.stdev(values) / len(values) ** 0.5


def paired(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "per_repeat": values}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--regimes", default="free,forced64", help="free (headline), forced64, forced256")
    parser.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS), help=", ".join(CONTENDERS))
    parser.add_argument(
        "--vllm-python", default=os.environ.get("VLLM_PYTHON"), help="interpreter of the vLLM environment (async-vllm)"
    )
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--eval-accuracy", action="store_true", help="held-out greedy accuracy (500 problems) per run")
    parser.add_argument("--quick", action="store_true", help="10 steps, 1 repeat, free length only")
    parser.add_argument("--tag", default="", help="suffix of the output files")
    parser.add_argument(
        "--output", default=None, help="JSON path (default benchmarks/results/bench_async{tag}.json); PNGs beside it"
    )
    parser.add_argument("--replot", metavar="JSON", help="only redraw the PNGs from a results file")
    args = parser.parse_args()
    if args.replot:
        return replot(args.replot)
    if args.worker or args.probe:
        result = run_worker(json.loads(args.worker)) if args.worker else run_probe(json.loads(args.probe))
        with open(args.out, "w") as f:
            json.dump(result, f)
        return
    if args.quick:
        args.repeats, args.steps, args.regimes = 1, 10, "free"
    names = args.contenders.split(",")
    if names[0] != "trl":
        raise SystemExit("the first contender must be trl (the baseline of every ratio)")
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        raise SystemExit(f"unknown contenders {unknown}; choose from {list(CONTENDERS)}")
    if any(CONTENDERS[n].get("generation_backend") == "vllm" for n in names) and not args.vllm_python:
        raise SystemExit("async-vllm runs in the vLLM environment: pass --vllm-python (see docs/vllm.md)")
    warmup = min(5, args.steps // 2)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)) if args.output else RESULTS, exist_ok=True)
    report = {
        "steps": args.steps,
        "repeats": args.repeats,
        "learning_rate": args.learning_rate,
        "environment": {
            "removed_from_the_environment": ["OMP_NUM_THREADS", "MKL_NUM_THREADS"],
            "cpus": os.cpu_count(),
        },
        "regimes": {},
    }
    for regime in args.regimes.split(","):
        base = {**REGIMES[regime], "steps": args.steps, "learning_rate": args.learning_rate,
                "eval_accuracy": args.eval_accuracy}  # fmt: skip
        probe = spawn("probe", base)
        runs = {name: [] for name in names}
        for repeat in range(args.repeats):
            for name in names:
                config = {**base, **CONTENDERS[name], "seed": repeat, "output_dir": tempfile.mkdtemp()}
                t = time.time()
                vllm = CONTENDERS[name].get("generation_backend") == "vllm"
                run = spawn("worker", config, args.vllm_python if vllm else sys.executable)
                run["summary"] = summarize(run, warmup)
                runs[name].append(run)
                s = run["summary"]
                print(f"{regime} repeat {repeat} {name:14s} train {s['train_s']:6.1f}s  trainer wait "
                      f"{s['trainer_wait_fraction']:.0%}  reward(last q) {s['last_quarter_reward']:.3f}  "
                      f"({time.time() - t:.0f}s)", flush=True)  # fmt: skip
        table = {}
        for name in names:
            summaries = [r["summary"] for r in runs[name]]
            table[name] = {
                key: statistics.median(s[key] for s in summaries) if summaries[0][key] is not None else None
                for key in summaries[0]
            }
            if args.eval_accuracy:
                table[name]["accuracy_mean"], table[name]["accuracy_se"] = mean_se(
                    [s["held_out_accuracy"] for s in summaries]
                )
            table[name]["reward_mean"], table[name]["reward_se"] = mean_se(
                [s["last_quarter_reward"] for s in summaries]
            )
            sync = [r["summary"] for r in runs["trl"]]
            table[name]["speedup_end_to_end"] = paired(
                [b["train_s"] / s["train_s"] for b, s in zip(sync, summaries, strict=True)]
            )
            table[name]["speedup_steady"] = paired(
                [s["rows_per_s_steady"] / b["rows_per_s_steady"] for b, s in zip(sync, summaries, strict=True)]
            )
        g, t = probe["generate_s"], probe["train_s"]
        report["regimes"][regime] = {"probe": probe, "overlap_limit": (g + t) / max(g, t), "table": table,
                                     "runs": {n: list(rs) for n, rs in runs.items()}}  # fmt: skip
        print(f"\n=== {regime}: {args.repeats} repeats, paired ratios median [min, max] ===")
        print(f"single-threaded: generation {g:.3f}s/batch, training {t:.3f}s/step -> overlap limit "
              f"{(g + t) / max(g, t):.2f}x")  # fmt: skip
        print(f"{'contender':15s} {'train s':>8s} {'end-to-end vs trl':>22s} {'steady vs trl':>20s} {'evicted':>8s} "
              f"{'len':>5s} {'reward last q':>18s}")  # fmt: skip
        for name, row in table.items():
            e, st = row["speedup_end_to_end"], row["speedup_steady"]
            print(f"{name:15s} {row['train_s']:8.1f} {e['median']:7.2f}x [{e['min']:.2f}, {e['max']:.2f}] "
                  f"{st['median']:6.2f}x [{st['min']:.2f}, {st['max']:.2f}] {row['eviction_rate']:8.2%} "
                  f"{row['mean_completion_length']:5.1f} {row['reward_mean']:8.3f} ± {row['reward_se']:.3f}")  # fmt: skip
        plot(runs, regime, args.tag, png_path(args, regime))
    path = args.output or os.path.join(RESULTS, f"bench_async{args.tag}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {path}")


def png_path(args, regime: str) -> str:
    """The reward-against-time picture of `regime`: beside --output when given, else under benchmarks/results/."""
    if args.output:
        return f"{os.path.splitext(args.output)[0]}_reward_vs_time_{regime}.png"
    return os.path.join(RESULTS, f"bench_async_reward_vs_time_{regime}{args.tag}.png")


def plot(runs: dict, regime: str, tag: str, path: str | None = None, window: int = 10) -> None:
    """Reward against wall-clock time: per contender, a rolling mean over `window` steps, averaged over repeats."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for index, (name, rs) in enumerate(runs.items()):
        steps = min(len(run["reward"]) for run in rs)
        times = [statistics.mean(run["step_end"][k] for run in rs) for k in range(steps)]
        rewards = [statistics.mean(run["reward"][k] for run in rs) for k in range(steps)]
        smooth = [statistics.mean(rewards[max(0, k - window + 1) : k + 1]) for k in range(steps)]
        ax.plot(times, smooth, color=f"C{index}", label=name)
    ax.set_xlabel("wall-clock seconds (mean over repeats)")
    ax.set_ylabel(f"reward, rolling mean of {window} steps")
    ax.set_title(f"Tiny model, {os.cpu_count()} CPU cores, completions: {regime}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path or os.path.join(RESULTS, f"bench_async_reward_vs_time_{regime}{tag}.png"), dpi=110)
    plt.close(fig)


def replot(path: str) -> None:
    report = json.load(open(path))
    for regime, entry in report["regimes"].items():
        plot(entry["runs"], regime, "")


if __name__ == "__main__":
    main()
