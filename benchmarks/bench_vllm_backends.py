"""Per-batch generation and weight-update time of the hf and vllm backends on the tiny model, side by side.

Both backends run in this process on the same prompts, with the same threads; each repeat times one batch of each,
back to back, after publishing new weights, so the paired ratio vllm/hf is robust to a shared machine's load.

    OMP_NUM_THREADS=1 python benchmarks/bench_vllm_backends.py [--rows 64] [--max-new-tokens 32] [--repeats 7]

Writes benchmarks/results/bench_vllm_backends.json (or --out): the settings, each backend's start-up seconds, and per
repeat each backend's weight-update seconds, generation seconds and generated tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

if __name__ == "__main__":  # vLLM may start processes: keep the work behind the guard
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: its test helpers
    from tests.support.vllm import (
        EOS,
        PAD,
        generation_config,
        model_spec,
        perturb_,
        stores_for,
        tiny_model,
        tiny_prompts,
    )
    from trl_async.rollout.backends import BackendContext, HFBackend
    from trl_async.rollout.backends.vllm import VLLMBackend

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64, help="completions per batch (GRPO: prompts x generations)")
    parser.add_argument("--generations", type=int, default=8, help="copies of each prompt in a batch")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--out",
        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_vllm_backends.json"),
        help="JSON results path",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = tiny_model()
    frozen_store, trainable_store = stores_for(model)
    config = generation_config(args.max_new_tokens)
    context = BackendContext(model_spec(model), frozen_store, trainable_store, config, 1.0, [EOS], PAD)
    t0 = time.perf_counter()
    hf = HFBackend(context)
    hf.load()
    t1 = time.perf_counter()
    vllm_backend = VLLMBackend(context)
    vllm_backend.load()
    t2 = time.perf_counter()
    torch.set_num_threads(args.threads)
    print(f"start-up: hf {t1 - t0:.1f}s, vllm {t2 - t1:.1f}s (engine build, in-process)")

    unique = tiny_prompts(max(1, args.rows // args.generations), seed=0)
    prompts = [p for p in unique for _ in range(args.generations)][: args.rows]
    generator = torch.Generator().manual_seed(0)
    rows = []
    for repeat in range(args.repeats + 1):  # the first repeat warms both up and is not counted
        perturb_(model, 0.001, generator)
        trainable_store.publish(model.named_parameters(), version=repeat + 1)
        timings = {}
        for name, backend in (("hf", hf), ("vllm", vllm_backend)):
            s = time.perf_counter()
            backend.update_weights()
            u = time.perf_counter()
            out = backend.generate(prompts) if name == "hf" else backend.generate(prompts, seed=repeat)
            g = time.perf_counter()
            timings[name] = (u - s, g - u, int(out.completion_mask.sum()))
        if repeat:
            rows.append(timings)
            print(
                f"repeat {repeat}: "
                + ", ".join(
                    f"{n}: update {t[0] * 1e3:.0f} ms, generate {t[1]:.2f} s ({t[2]} tokens)"
                    for n, t in timings.items()
                )
            )

    def summary(values):
        return f"median {statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f})"

    print(f"\n{args.rows} rows x up to {args.max_new_tokens} tokens, {args.threads} thread(s), {args.repeats} repeats")
    for name in ("hf", "vllm"):
        print(f"{name:>5} generate s/batch: {summary([r[name][1] for r in rows])}")
        print(f"{name:>5} tokens/s:         {summary([r[name][2] / r[name][1] for r in rows])}")
        print(f"{name:>5} update ms:        {summary([r[name][0] * 1e3 for r in rows])}")
    print(f"paired ratio vllm/hf, s/batch:  {summary([r['vllm'][1] / r['hf'][1] for r in rows])}")
    print(
        f"paired ratio vllm/hf, tokens/s: {summary([(r['vllm'][2] / r['vllm'][1]) / (r['hf'][2] / r['hf'][1]) for r in rows])}"
    )
    vllm_backend.close()
    import vllm

    record = {
        "command": "OMP_NUM_THREADS=1 python benchmarks/bench_vllm_backends.py"
        + f" --rows {args.rows} --generations {args.generations} --max-new-tokens {args.max_new_tokens}"
        + f" --repeats {args.repeats} --threads {args.threads}",
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "versions": {"torch": torch.__version__, "vllm": vllm.__version__, "python": platform.python_version()},
        "cpus": os.cpu_count(),
        "startup_s": {"hf": t1 - t0, "vllm": t2 - t1},
        "repeats": [
            {name: {"update_s": t[0], "generate_s": t[1], "tokens": t[2]} for name, t in timings.items()}
            for timings in rows
        ],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {args.out}")
