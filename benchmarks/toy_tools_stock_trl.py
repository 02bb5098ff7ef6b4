"""Does RL with tool calls raise the toy tools model's accuracy? Stock TRL, synchronous, `tools=[multiply]`.

    PYTHONPATH=. python benchmarks/toy_tools_stock_trl.py                # 200 steps, 4-10 min on 2 shared CPU cores
    PYTHONPATH=. python benchmarks/toy_tools_stock_trl.py --max-steps 20 --output /tmp/quick.json

The model is the bundled tools variant (`trl_async/toy/tiny_qwen2_tools`): pre-trained on three-digit multiplication,
a share of the problems solved with a `multiply` tool call and the rest answered directly (which it cannot learn),
stopped early. Trainer: `trl.GRPOTrainer` exactly as TRL ships it, given `tools=[multiply]` and
`trl_async.rewards.math_answer_text_reward` (the final `#### ` answer of the assistant turns; a copied tool response
only counts once the model writes it as its answer). Held-out problems (the build's 200 test problems, never trained
on) are evaluated before and after with the tools executed (`trl_async.toy.tools.tool_accuracy`, TRL's token-id
concatenation): greedy, and 4 samples per problem at T=1.0. Writes benchmarks/results/toy_tools_stock_trl.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # this checkout's trl_async, also when run as a script


def _parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--learning-rate", type=float, default=1e-4)
    ap.add_argument("--batch-size", type=int, default=32, help="per_device_train_batch_size (rows per step)")
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--num-train", type=int, default=2000, help="RL training problems")
    ap.add_argument("--num-samples", type=int, default=4, help="samples per held-out problem for sampled accuracy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: reproducible on a shared machine)")
    ap.add_argument("--output", default=os.path.join(HERE, "results", "toy_tools_stock_trl.json"))
    return ap.parse_args(argv)


def evaluate(model, tokenizer, test, num_samples: int, seed: int) -> dict:
    from trl_async.toy.tools import tool_accuracy

    t0 = time.perf_counter()
    greedy = tool_accuracy(model, tokenizer, test)
    sampled = tool_accuracy(
        model, tokenizer, test, do_sample=True, temperature=1.0, num_samples=num_samples, seed=seed
    )
    return {"greedy": greedy, "sampled_T1": sampled, "eval_s": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> int:
    args = _parse_args(argv)
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from trl_async.rewards import math_answer_text_reward
    from trl_async.toy.tools import make_multiplication_dataset, multiply, tiny_tools_model_path

    torch.set_num_threads(args.threads)
    path = tiny_tools_model_path()
    # The build's held-out split (seed 0, the first 200 problems); the RL problems are the next ones.
    data = make_multiplication_dataset(num_train=args.num_train, num_test=200, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    before = evaluate(model, tokenizer, data["test"], args.num_samples, args.seed)
    print(f"before: {json.dumps(before)}", flush=True)

    with tempfile.TemporaryDirectory() as output_dir:
        config = GRPOConfig(
            output_dir=output_dir,
            max_steps=args.max_steps,
            per_device_train_batch_size=args.batch_size,
            num_generations=args.num_generations,
            max_completion_length=64,
            max_tool_calling_iterations=2,
            temperature=1.0,
            learning_rate=args.learning_rate,
            lr_scheduler_type="constant",
            warmup_steps=0,
            beta=0.0,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            gradient_checkpointing=False,  # a 1M-parameter model needs no activation checkpointing
            use_cpu=True,
            bf16=False,
            seed=args.seed,
        )
        trainer = GRPOTrainer(
            model=model,
            processing_class=tokenizer,
            reward_funcs=math_answer_text_reward,
            args=config,
            train_dataset=data["train"],
            tools=[multiply],
        )
        t0 = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - t0
    after = evaluate(trainer.model, tokenizer, data["test"], args.num_samples, args.seed)
    print(f"after: {json.dumps(after)}", flush=True)

    history = [h for h in trainer.state.log_history if "reward" in h]
    keys = ("reward", "tools/call_frequency", "tools/failure_frequency", "completions/mean_length")
    curve = [{"step": h["step"], **{k: h.get(k) for k in keys}} for h in history]
    quarter = max(1, len(history) // 4)
    result = {
        "benchmark": "toy_tools_stock_trl",
        "command": " ".join(["PYTHONPATH=. python benchmarks/toy_tools_stock_trl.py", *(argv or sys.argv[1:])]),
        "model": os.path.relpath(path, ROOT),
        "trainer": "trl.GRPOTrainer (stock, synchronous), tools=[multiply], reward math_answer_text_reward",
        "settings": {k: v for k, v in vars(args).items() if k != "output"}
        | {"max_completion_length": 64, "max_tool_calling_iterations": 2, "beta": 0.0, "loss_type": config.loss_type},
        "held_out_problems": len(data["test"]),
        "before": before,
        "after": after,
        "train_s": round(train_s, 1),
        "s_per_step": round(train_s / max(args.max_steps, 1), 2),
        "reward_first_quarter": sum(h["reward"] for h in history[:quarter]) / quarter,
        "reward_last_quarter": sum(h["reward"] for h in history[-quarter:]) / quarter,
        "curve": curve,
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_1m_at_end": os.getloadavg()[0],
        },
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    b, a = before, after
    print(
        f"held-out accuracy, greedy {b['greedy']['accuracy']:.3f} -> {a['greedy']['accuracy']:.3f}; sampled T=1 "
        f"{b['sampled_T1']['accuracy']:.3f} -> {a['sampled_T1']['accuracy']:.3f}; tool-call rate (sampled) "
        f"{b['sampled_T1']['tool_call_rate']:.3f} -> {a['sampled_T1']['tool_call_rate']:.3f}; "
        f"{args.max_steps} steps in {train_s:.0f}s -> {args.output}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
