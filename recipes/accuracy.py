"""Greedy accuracy on held-out math problems, for the recipe's before/after evaluation.

Prompts are formatted exactly as TRL formats them for training (`trl.data_utils.maybe_apply_chat_template`),
generated greedily in batches with transformers' `generate` (left padding, the model's own EOS ids), and scored with
the text form of the training reward (`MathAnswerTextReward`: the last `####` / `\\boxed{` / "The answer is" marker
must be followed by the gold answer). Accuracy comes with its Wilson 95% interval.
"""

from __future__ import annotations

import math
import os

ARITHMETIC = "arithmetic"


def wilson_interval(correct: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (Wilson 1927; Brown, Cai & DasGupta 2001, eq. 4):
    (p + z²/2n ± z sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)."""
    if total <= 0:
        raise ValueError("wilson_interval needs at least one trial")
    p, n = correct / total, total
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, center - half), min(1.0, center + half)


def load_eval_dataset(recipe, seed: int):
    """The held-out problems named by the recipe's eval fields (`prompt` and `answer` columns), and their name.

    * default (`eval_dataset` unset): the arithmetic job's test split, or `eval_split` of the Hub dataset it trains on;
    * `eval_dataset: arithmetic`, a Hub id in GSM8K format, or a local GSM8K-format .json/.jsonl file or folder.

    Errors name the field to fix.
    """
    from trl_async.data import load_gsm8k, make_arithmetic_dataset

    name = recipe.eval_dataset
    if name is None:
        if recipe.dataset == ARITHMETIC:
            name = ARITHMETIC
        elif _is_local(recipe.dataset):
            raise ValueError(
                f"eval_dataset is unset and the training data is a local file ({recipe.dataset!r}), which has no "
                "held-out split: pass --eval_dataset path/to/test.jsonl (GSM8K format), or --eval_accuracy false."
            )
        else:
            name = recipe.dataset
    if name == ARITHMETIC:
        splits = make_arithmetic_dataset(
            num_train=recipe.num_train_prompts, num_test=recipe.num_test_prompts, seed=seed
        )
        if recipe.eval_split not in splits:
            raise ValueError(
                f"eval_split={recipe.eval_split!r} does not exist for the arithmetic dataset; its splits are "
                f"{sorted(splits)} (use 'test', the held-out problems)."
            )
        dataset = splits[recipe.eval_split]
    elif _is_local(name):
        if not os.path.exists(os.path.expanduser(name)):
            raise FileNotFoundError(f"eval_dataset={name!r} does not exist.")
        try:
            dataset = load_gsm8k(os.path.expanduser(name))
        except ValueError as error:
            raise ValueError(f"eval_dataset={name!r} cannot be used: {error}") from error
    else:
        try:
            dataset = load_gsm8k(name, split=recipe.eval_split)
        except ValueError as error:
            if "split" in str(error).lower():
                raise ValueError(f"eval_split={recipe.eval_split!r} does not exist in {name!r}: {error}") from error
            raise ValueError(f"eval_dataset={name!r} cannot be used: {error}") from error
    if recipe.eval_max_samples is not None:
        dataset = dataset.select(range(min(recipe.eval_max_samples, len(dataset))))
    if len(dataset) == 0:
        raise ValueError(f"eval_dataset={name!r} (split {recipe.eval_split!r}) has no rows.")
    return dataset, name


def _is_local(name: str) -> bool:
    return (
        name.startswith((".", "/", "~"))
        or name.lower().endswith((".json", ".jsonl"))
        or name.count("/") > 1
        or os.path.exists(name)
    )


def greedy_completions(model, tokenizer, prompts: list, max_new_tokens: int, batch_size: int) -> list[str]:
    """Greedy completions of `prompts` (TRL prompt format), batched with left padding; special tokens skipped."""
    import torch
    from trl.data_utils import maybe_apply_chat_template

    texts = [maybe_apply_chat_template({"prompt": p}, tokenizer)["prompt"] for p in prompts]
    was_training, padding_side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    device = next(model.parameters()).device
    completions: list[str] = []
    try:
        with torch.no_grad():
            for start in range(0, len(texts), batch_size):
                batch = tokenizer(
                    texts[start : start + batch_size], return_tensors="pt", padding=True, add_special_tokens=False
                ).to(device)
                output = model.generate(
                    **batch,
                    do_sample=False,
                    temperature=None,
                    top_p=None,
                    top_k=None,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=tokenizer.pad_token_id,
                )
                new_tokens = output[:, batch["input_ids"].shape[1] :]
                completions.extend(tokenizer.batch_decode(new_tokens, skip_special_tokens=True))
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    return completions


def evaluate_accuracy(model, tokenizer, dataset, max_new_tokens: int, batch_size: int) -> dict:
    """Greedy accuracy of `model` on `dataset` (columns `prompt`, `answer`): accuracy, counts and Wilson 95% CI."""
    from trl_async.rewards import MathAnswerTextReward

    scorer = MathAnswerTextReward()
    completions = greedy_completions(model, tokenizer, list(dataset["prompt"]), max_new_tokens, batch_size)
    hits = [scorer.score_text(text, gold) == 1.0 for text, gold in zip(completions, dataset["answer"], strict=True)]
    correct, total = sum(hits), len(hits)
    low, high = wilson_interval(correct, total)
    return {"accuracy": correct / total, "correct": correct, "total": total, "ci95": [low, high], "hits": hits}
