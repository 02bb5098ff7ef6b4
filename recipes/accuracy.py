"""Greedy accuracy on held-out math problems, for the recipe's before/after evaluation.

Prompts are formatted exactly as TRL formats them for training (`trl.data_utils.maybe_apply_chat_template`),
generated greedily in batches with transformers' `generate` (left padding, the model's own EOS ids), and scored with
the text form of the training reward (`MathAnswerTextReward`: the last `####` / `\\boxed{` / "The answer is" marker
must be followed by the gold answer). Accuracy comes with its Wilson 95% interval. With tools, the completions are
multi-turn and the tool calls are executed, by TRL's own multi-turn code as in training
(`trl_async.toy.tools.tool_rollouts`); the assistant turns are scored, and the share of problems the model called a
tool for is reported (`tool_call_rate`).
"""

from __future__ import annotations

import math

ARITHMETIC = "arithmetic"
MULTIPLICATION = "multiplication"


def wilson_interval(correct: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (Wilson 1927; Brown, Cai & DasGupta 2001, eq. 4):
    (p + z²/2n ± z sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)."""
    if total <= 0:
        raise ValueError("wilson_interval needs at least one trial")
    p, n = correct / total, total
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, center - half), min(1.0, center + half)


def load_math_dataset(name: str, split: str, name_field: str, split_field: str):
    """GSM8K-format rows (`prompt`, `answer`) from a local .json/.jsonl file or folder, or a split of a Hub dataset
    (`trl_async.data.load_gsm8k`), with errors that name the recipe field to fix (`name_field`, `split_field`)."""
    from trl_async.data import load_gsm8k, looks_like_local_path

    local = looks_like_local_path(name)
    try:
        return load_gsm8k(name, split=split)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"{name_field}={name!r}: {error}") from error
    except ValueError as error:
        if not local and "split" in str(error).lower():
            raise ValueError(f"{split_field}={split!r} does not exist in {name!r}: {error}") from error
        raise ValueError(f"{name_field}={name!r} cannot be used: {error}") from error
    except Exception as error:  # offline, missing repo, network: all say the same thing to the user
        if local:
            raise
        raise OSError(
            f"Could not load {name_field}={name!r} (split {split!r}) from the Hugging Face Hub; the Hub must be "
            f"reachable (or the dataset cached), and this machine may be offline. Original error: "
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        ) from error


def load_eval_dataset(recipe, seed: int):
    """The held-out problems named by the recipe's eval fields (`prompt` and `answer` columns), and their name.

    * default (`eval_dataset` unset): the arithmetic job's test split, or `eval_split` of the Hub dataset it trains on;
    * `eval_dataset: arithmetic`, a Hub id in GSM8K format, or a local GSM8K-format .json/.jsonl file or folder.

    Errors name the field to fix.
    """
    from trl_async.data import looks_like_local_path
    from trl_async.toy import make_arithmetic_dataset

    name = recipe.eval_dataset
    if name is None:
        if recipe.dataset in (ARITHMETIC, MULTIPLICATION):
            name = recipe.dataset
        elif looks_like_local_path(recipe.dataset):
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
    elif name == MULTIPLICATION:
        from trl_async.toy import make_multiplication_dataset

        splits = make_multiplication_dataset(recipe.num_train_prompts, recipe.num_test_prompts, seed=seed)
        if recipe.eval_split not in splits:
            raise ValueError(
                f"eval_split={recipe.eval_split!r} does not exist for the multiplication dataset; its splits are "
                f"{sorted(splits)} (use 'test', the held-out problems)."
            )
        dataset = splits[recipe.eval_split]
    else:
        dataset = load_math_dataset(name, recipe.eval_split, "eval_dataset", "eval_split")
    if recipe.eval_max_samples is not None:
        dataset = dataset.select(range(min(recipe.eval_max_samples, len(dataset))))
    if len(dataset) == 0:
        raise ValueError(f"eval_dataset={name!r} (split {recipe.eval_split!r}) has no rows.")
    return dataset, name


# On CPU, intra-op threads only pay off for matrices large enough to split. Below this size one thread is faster:
# the bundled 1M-parameter model evaluates the 500 arithmetic problems in 5 s with 1 thread and in 95-147 s with 2
# (2-core shared machine, load ~9), where the threads spend their time synchronising.
SMALL_MODEL_PARAMETERS = 50_000_000


def eval_threads(model, requested: int | None) -> int | None:
    """torch CPU threads for the evaluation: `requested`, else 1 for small models on CPU, else None (leave as is)."""
    if requested is not None:
        return requested
    if next(model.parameters()).device.type != "cpu":
        return None
    return 1 if sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMETERS else None


def greedy_completions(
    model, tokenizer, prompts: list, max_new_tokens: int, batch_size: int, num_threads: int | None = None
) -> list[str]:
    """Greedy completions of `prompts` (TRL prompt format), batched with left padding; special tokens skipped."""
    import torch
    from trl.data_utils import maybe_apply_chat_template

    texts = [maybe_apply_chat_template({"prompt": p}, tokenizer)["prompt"] for p in prompts]
    was_training, padding_side, threads = model.training, tokenizer.padding_side, torch.get_num_threads()
    model.eval()
    tokenizer.padding_side = "left"
    if num_threads is not None:
        torch.set_num_threads(num_threads)
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
        torch.set_num_threads(threads)
    return completions


def tool_completions(
    model,
    tokenizer,
    prompts: list,
    tools: list,
    max_new_tokens: int,
    max_tool_calling_iterations,
    batch_size: int,
    num_threads: int | None = None,
) -> tuple[list, list[bool]]:
    """Greedy multi-turn completions with the tools executed (TRL's code: `trl_async.toy.tools.tool_rollouts`), and
    per prompt whether the model called a tool."""
    import torch

    from trl_async.toy.tools import tool_rollouts

    threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        out = tool_rollouts(model, tokenizer, prompts, tools=tools, max_completion_length=max_new_tokens,
                            max_tool_calling_iterations=max_tool_calling_iterations, batch_size=batch_size)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return out["completions"], [calls > 0 for calls in out["tool_calls"]]


def evaluate_accuracy(
    model,
    tokenizer,
    dataset,
    max_new_tokens: int,
    batch_size: int,
    num_threads: int | None = None,
    tools=(),
    max_tool_calling_iterations: int | None = None,
) -> dict:
    """Greedy accuracy of `model` on `dataset` (columns `prompt`, `answer`): accuracy, counts and Wilson 95% CI;
    with `tools`, the tool calls executed and `tool_call_rate` added."""
    from trl_async.rewards import MathAnswerTextReward
    from trl_async.rewards.text import completion_text

    scorer = MathAnswerTextReward()
    threads = eval_threads(model, num_threads)
    prompts = list(dataset["prompt"])
    called = None
    if tools:
        completions, called = tool_completions(model, tokenizer, prompts, list(tools), max_new_tokens,
                                               max_tool_calling_iterations, batch_size, threads)  # fmt: skip
        texts = [completion_text(c) for c in completions]
    else:
        texts = greedy_completions(model, tokenizer, prompts, max_new_tokens, batch_size, threads)
    hits = [scorer.score_text(text, gold) == 1.0 for text, gold in zip(texts, dataset["answer"], strict=True)]
    return accuracy_from_hits(hits, called)


def accuracy_from_hits(hits: list[bool], called: list[bool] | None = None) -> dict:
    """Accuracy, counts, Wilson 95% interval, and the per-problem hits (kept for the paired comparison); with tools,
    the share of problems with a tool call and the per-problem flags."""
    correct, total = sum(hits), len(hits)
    low, high = wilson_interval(correct, total)
    result = {"accuracy": correct / total, "correct": correct, "total": total, "ci95": [low, high], "hits": list(hits)}
    if called is not None:
        result.update(tool_call_rate=sum(called) / total, tool_calls=list(called))
    return result


def evaluate_sharded(state, model, tokenizer, dataset, **kwargs) -> dict:
    """`evaluate_accuracy` with the problems split across the processes of `state` (accelerate's `PartialState`),
    each taking a contiguous shard, and the hits gathered back in dataset order; every process gets the result."""
    from accelerate.utils import gather_object

    if state.num_processes == 1:
        return evaluate_accuracy(model, tokenizer, dataset, **kwargs)
    shard = dataset.shard(num_shards=state.num_processes, index=state.process_index, contiguous=True)
    local = evaluate_accuracy(model, tokenizer, shard, **kwargs) if len(shard) else {"hits": []}
    called = gather_object(local.get("tool_calls", [])) if kwargs.get("tools") else None
    return accuracy_from_hits(gather_object(local["hits"]), called)
