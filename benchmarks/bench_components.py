"""Where the asynchronous trainer's work got cheaper than TRL's: one generation batch and one training forward +
backward, each measured alone on one core, TRL's way and ours, side by side.

    python benchmarks/bench_components.py              # free-length and forced-64-token batches, 31 repeats each

The batch is the docs-style one (`benchmarks/docs_style_grpo.py`): the bundled tiny model, 4 arithmetic prompts x 8
generations, TRL's default generation settings and gradient checkpointing, from a real `AsyncGRPOTrainer` (built with
`async_generation=False`, so no generation process runs). Measured, alternating within each repeat, medians:

* generation: TRL's call (`model.generate` with the trainer's generation config, as `GRPOTrainer._generate` makes it)
  against `generate_with_behaviour_logprobs` (the generation process's call: each distinct prompt prefilled once, the
  behaviour log-probs μ recorded);
* training: `GRPOTrainer._get_per_token_logps_and_entropies` (TRL's forward: every row `[prompt, completion]` padded
  to the longest) against `AsyncGRPOTrainer`'s (short completions: one packed sequence per prompt group, padding cut;
  long ones: each prompt once as a key/value prefix), each followed by the backward of a loss over every completion
  token, with gradient checkpointing on as `Trainer.train` turns it on.

Writes benchmarks/results/bench_components.json. Single-thread figures: in the asynchronous trainer each process
starts on its share of the cores (one each on a 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
REGIMES = {"free": None, "forced64": 64}


def build_trainer(output_dir: str, forced_length: int | None):
    from transformers import AutoTokenizer

    from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl_async.toy import make_arithmetic_dataset, tiny_model_path

    optional = {"max_completion_length": forced_length} if forced_length else {}
    args = AsyncGRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=32,
        report_to="none",
        bf16=False,
        use_cpu=True,
        generation_kwargs={"min_new_tokens": forced_length} if forced_length else None,
        async_generation=False,
        **optional,
    )
    return AsyncGRPOTrainer(
        model=tiny_model_path(),
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=args,
        train_dataset=make_arithmetic_dataset(num_train=64, num_test=4, seed=0)["train"],
        processing_class=AutoTokenizer.from_pretrained(tiny_model_path()),
    )


def measure(forced_length: int | None, repeats: int) -> dict:
    import torch
    from trl import GRPOTrainer

    from trl_async.rollout.backends import generate_with_behaviour_logprobs, generation_config_for_rollouts

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        trainer = build_trainer(out, forced_length)
    # As `Trainer.train` does before the first step (TRL's default: on, non-reentrant); constructing the trainer
    # does not turn it on.
    trainer.model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs
    )
    tokenizer = trainer.processing_class
    prompts = [
        tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        for p in trainer.train_dataset["prompt"][:4]
        for _ in range(8)
    ]
    model = trainer.model
    pad, eos = tokenizer.pad_token_id, list(trainer.eos_token_ids)
    width = max(len(p) for p in prompts)
    prompt_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    prompt_mask = (torch.arange(width) >= (width - torch.tensor([len(p) for p in prompts])).unsqueeze(1)).long()
    rollout_config = generation_config_for_rollouts(trainer.generation_config)

    def generate_trl(seed):
        torch.manual_seed(seed)
        with torch.no_grad():
            return model.generate(
                input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=trainer.generation_config
            )

    def generate_ours(seed):
        with torch.inference_mode():
            return generate_with_behaviour_logprobs(model, prompts, rollout_config, eos, pad, "cpu", seed=seed)

    model.eval()
    batch = generate_ours(0)
    ids = torch.cat([prompt_ids, batch.completion_ids], dim=1)
    mask = torch.cat([prompt_mask, batch.completion_mask.long()], dim=1)
    logits_to_keep = batch.completion_ids.size(1)
    model.train()

    def train(forward):
        def step():
            logps, entropies, _ = forward(trainer, model, ids, mask, logits_to_keep, compute_entropy=True)
            (logps.sum() + entropies.sum()).backward()
            model.zero_grad(set_to_none=True)

        return step

    timings = {"generate_trl": [], "generate_ours": [], "train_trl": [], "train_ours": []}
    steps = {
        "generate_trl": generate_trl,
        "generate_ours": generate_ours,
        "train_trl": train(GRPOTrainer._get_per_token_logps_and_entropies),
        "train_ours": train(type(trainer)._get_per_token_logps_and_entropies),
    }
    for name, step in steps.items():  # warm-up
        model.train(name.startswith("train"))
        step(0) if name.startswith("generate") else step()
    for repeat in range(repeats):
        for name, step in steps.items():
            model.train(name.startswith("train"))
            start = time.perf_counter()
            step(repeat + 1) if name.startswith("generate") else step()
            timings[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in timings.items()}
    lengths = batch.completion_mask.sum(1).float()
    return {
        "completion_length_mean": lengths.mean().item(),
        "completion_length_max": lengths.max().item(),
        "prompt_length": width,
        "medians_s": medians,
        "generation_speedup": medians["generate_trl"] / medians["generate_ours"],
        "training_speedup": medians["train_trl"] / medians["train_ours"],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--output", default=os.path.join(RESULTS, "bench_components.json"))
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(HERE))
    results = {}
    for regime, length in REGIMES.items():
        results[regime] = measure(length, args.repeats)
        r = results[regime]
        print(
            f"{regime:9s} completions {r['completion_length_mean']:.1f} (max {r['completion_length_max']:.0f}) | "
            f"generation TRL {r['medians_s']['generate_trl'] * 1e3:.0f} ms, ours "
            f"{r['medians_s']['generate_ours'] * 1e3:.0f} ms ({r['generation_speedup']:.2f}x) | training TRL "
            f"{r['medians_s']['train_trl'] * 1e3:.0f} ms, ours {r['medians_s']['train_ours'] * 1e3:.0f} ms "
            f"({r['training_speedup']:.2f}x)",
            flush=True,
        )
    results["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "threads": 1}
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
