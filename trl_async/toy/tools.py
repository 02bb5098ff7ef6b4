"""The toy tool-calling task: three-digit multiplication with a calculator tool.

The bundled tiny model cannot multiply ``347*829`` itself, but the tools variant (``tiny_qwen2_tools/``, built by
``python -m trl_async.toy.build --tools``) has learned to call ``multiply`` in Qwen2.5's format, read the result and
answer ``#### 287663``::

    <|im_start|>assistant
    <tool_call>
    {"name": "multiply", "arguments": {"a": 347, "b": 829}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    287663
    </tool_response><|im_end|>
    <|im_start|>assistant
    #### 287663<|im_end|>

It was pre-trained on a mix of such transcripts and direct answers (which it cannot get right), and stopped early, so
that RL has headroom: raising the share of well-formed tool calls raises the accuracy.

* `multiply`: the calculator tool (TRL builds its JSON schema from the type hints and the docstring).
* `make_multiplication_dataset`: seeded problems in TRL's conversational format, with held-out splits; the gold
  answer in ``answer``, scored by `trl_async.rewards.math_answer_text_reward` (it reads the assistant messages only,
  so a copied tool response earns nothing unless the model writes it after ``####``).
* `tool_rollouts`, `tool_accuracy`: multi-turn generation with the tool calls executed by TRL 1.16's own
  `GRPOTrainer._generate` and `_tool_call_loop` (token ids concatenated: prompt + completion + tool suffix, as TRL
  trains on them), run on the generation process's host (`trl_async.rollout.agentic.ToolLoopHost`), and the task's
  evaluation on it.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable

__all__ = [
    "MULTIPLY_OPERAND_RANGE",
    "TOOL_SFT_FRACTION",
    "make_multiplication_dataset",
    "multiplication_prompt",
    "multiply",
    "tiny_tools_model_path",
    "tool_accuracy",
    "tool_call_text",
    "tool_rollouts",
    "tool_suffix_ids",
]

_TOOLS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_qwen2_tools")

MULTIPLY_OPERAND_RANGE = (100, 999)  # three-digit operands: six-digit products the tiny model cannot compute
TOOL_SFT_FRACTION = 0.4  # share of tool-calling transcripts in the tools variant's pre-training (the rest: direct)


def tiny_tools_model_path() -> str:
    """Absolute path of the bundled tool-calling tiny model folder (loadable with ``from_pretrained``)."""
    return _TOOLS_DIR


def multiply(a: int, b: int) -> int:
    """
    Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.

    Returns:
        The product of a and b.
    """
    # Strict on types: `"12" * 3` is "121212" in Python; a model that passes text gets an error it can learn from.
    for name, value in (("a", a), ("b", b)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"multiply: {name} must be an integer, got {value!r}")
    return a * b


def multiplication_prompt(a: int, b: int) -> str:
    """The user message of a multiplication problem, e.g. ``"What is 347*829?"``."""
    return f"What is {a}*{b}?"


def tool_call_text(name: str, arguments: dict) -> str:
    """An assistant tool call as the bundled chat template renders it (Qwen2.5's format), e.g.
    ``'<tool_call>\\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\\n</tool_call>'``."""
    import json

    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def make_multiplication_dataset(
    num_train: int = 2000,
    num_test: int = 200,
    seed: int = 0,
    operand_range: tuple[int, int] = MULTIPLY_OPERAND_RANGE,
):
    """Seeded multiplication problems as a ``datasets.DatasetDict`` with ``"train"`` and ``"test"`` splits.

    Each row has ``prompt`` = ``[{"role": "user", "content": "What is 347*829?"}]`` and ``answer`` = the product as a
    string. Problems are drawn one by one (without repeats, ``a*b`` and ``b*a`` count as different) from a generator
    seeded with ``seed``: the test split is the first ``num_test`` and the train split the next ``num_train``, so the
    test split does not depend on ``num_train`` and never shares a problem with it.
    """
    from datasets import Dataset, DatasetDict

    for name, v in (("num_train", num_train), ("num_test", num_test)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}.")
    lo, hi = (int(x) for x in operand_range)
    if lo < 0 or hi < lo:
        raise ValueError(f"operand_range must satisfy 0 <= low <= high, got {operand_range!r}.")
    total, space = num_train + num_test, (hi - lo + 1) ** 2
    if total > space // 2:  # drawing without repeats slows down as the space fills; half of it is plenty
        raise ValueError(f"num_train + num_test = {total} exceeds half of the {space} problems in {operand_range}.")
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    problems: list[tuple[int, int]] = []
    while len(problems) < total:
        problem = (rng.randint(lo, hi), rng.randint(lo, hi))
        if problem not in seen:
            seen.add(problem)
            problems.append(problem)

    def rows(chunk):
        return {
            "prompt": [[{"role": "user", "content": multiplication_prompt(a, b)}] for a, b in chunk],
            "answer": [str(a * b) for a, b in chunk],
        }

    return DatasetDict(
        {"train": Dataset.from_dict(rows(problems[num_test:])), "test": Dataset.from_dict(rows(problems[:num_test]))}
    )


def _host(tokenizer, model=None, tools=(), max_completion_length=64, max_tool_calling_iterations=None, sampling=None):
    """TRL 1.16's multi-turn code on `rollout.agentic.ToolLoopHost` (the generation process's host), generating with
    transformers' `generate` (no log-probs: the toy evaluates, it does not train on these)."""
    from ..rollout.agentic import ToolLoopHost

    def generate_turn(prompt_ids):
        return _generate_ids(model, tokenizer, prompt_ids, max_completion_length, **(sampling or {})), None

    return ToolLoopHost(
        tokenizer,
        generate_turn,
        model_config=getattr(model, "config", None),
        tools=tools,
        max_completion_length=max_completion_length,
        max_tool_calling_iterations=max_tool_calling_iterations,
    )


def tool_suffix_ids(processing_class, tool_messages: list[dict]) -> list[int]:
    """The token ids that follow a completion ending in a tool call: the tool responses and the next assistant header,
    computed by TRL's own `GRPOTrainer._get_tool_suffix_ids` (a dummy tool-call conversation rendered with and without
    `tool_messages`, the first cut after its last EOS)."""
    return list(_host(processing_class)._get_tool_suffix_ids(tool_messages))


def _generate_ids(model, tokenizer, sequences, max_new_tokens, do_sample=False, temperature=1.0, batch_size=128):
    """Completions of token-id sequences (left-padded batches), each cut after its first EOS, as TRL cuts them."""
    import torch

    gen_kwargs = dict(
        max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    if do_sample:
        gen_kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        gen_kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    out: list[list[int]] = []
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start : start + batch_size]
        width = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, s in enumerate(chunk):
            ids[i, width - len(s) :] = torch.tensor(s)
            mask[i, width - len(s) :] = 1
        with torch.no_grad():
            generated = model.generate(
                input_ids=ids.to(model.device), attention_mask=mask.to(model.device), **gen_kwargs
            )
        for row in generated[:, width:].tolist():
            cut = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
            out.append(row[:cut])
    return out


def tool_rollouts(
    model,
    tokenizer,
    prompts: list,
    tools: list[Callable] = (multiply,),
    max_completion_length: int = 64,
    max_tool_calling_iterations: int | None = 2,
    do_sample: bool = False,
    temperature: float = 1.0,
    seed: int | None = None,
    batch_size: int = 128,
) -> dict:
    """Multi-turn completions of conversational `prompts` with the tool calls executed: TRL 1.16's own
    `GRPOTrainer._generate` and `_tool_call_loop` (the prompts rendered with the tools, sampled, parsed with
    `parse_response`; then the tools run, the tool suffix ids appended, sampled again, a round dropped that would not
    fit in `max_completion_length` or the model's context), run on the generation process's host
    (`trl_async.rollout.agentic.ToolLoopHost`). Sampling, when asked for, is pure
    temperature sampling (``top_k=0``, ``top_p=1``), like RL rollouts.

    Returns ``completions`` (TRL's conversational completions: lists of messages), ``completion_ids``, ``tool_mask``
    (1 for sampled tokens, 0 for tool-result tokens), per row ``tool_calls`` and ``tool_failures`` (the tool messages
    and those reporting an error), and TRL's batch totals ``tool_call_count`` and ``tool_failure_count``.
    """
    import torch

    from ..trl_contract import generate_fields

    if seed is not None:
        torch.manual_seed(seed)
    prompts, tools = list(prompts), list(tools)  # a dataset column is not a list of conversations to transformers
    sampling = dict(do_sample=do_sample, temperature=temperature, batch_size=batch_size)
    host = _host(tokenizer, model, tools, max_completion_length, max_tool_calling_iterations, sampling)
    tools_by_name = {tool.__name__: tool for tool in tools}
    host._sync_tool_dicts = [dict(tools_by_name) for _ in prompts]
    host._async_tool_dicts = [{} for _ in prompts]
    was_training = model.training
    model.eval()
    try:
        fields = generate_fields(host.run(prompts))
    finally:
        model.train(was_training)
    completions, completion_ids = fields["completions"], fields["completion_ids"]
    tool_mask = fields["tool_mask"] if fields["tool_mask"] is not None else [[1] * len(c) for c in completion_ids]
    call_count, failure_count = host.tool_call_count, host.tool_failure_count
    tool_messages = [[m for m in c if m["role"] == "tool"] for c in completions]
    return dict(
        completions=completions,
        completion_ids=completion_ids,
        tool_mask=tool_mask,
        tool_calls=[len(m) for m in tool_messages],
        tool_failures=[sum(str(t["content"]).startswith("{'error'") for t in m) for m in tool_messages],
        tool_call_count=call_count,
        tool_failure_count=failure_count,
    )


def _well_formed_multiply_call(completion: list[dict]) -> bool:
    """The first assistant turn is exactly one `multiply` call with two integer arguments."""
    calls = completion[0].get("tool_calls") or []
    if len(calls) != 1:
        return False
    function = calls[0].get("function", {})
    args = function.get("arguments")
    return (
        function.get("name") == "multiply"
        and isinstance(args, dict)
        and set(args) == {"a", "b"}
        and all(isinstance(v, int) and not isinstance(v, bool) for v in args.values())
    )


def tool_accuracy(
    model,
    tokenizer,
    dataset,
    num_samples: int = 1,
    do_sample: bool = False,
    temperature: float = 1.0,
    seed: int = 0,
    max_completion_length: int = 64,
    max_tool_calling_iterations: int = 2,
    batch_size: int = 128,
) -> dict:
    """The tool task's evaluation on `dataset` (``prompt``, ``answer``), with the tool calls executed.

    Returns fractions over ``len(dataset) * num_samples`` rollouts: ``accuracy`` (`math_answer_text_reward`),
    ``tool_call_rate`` (at least one tool call), ``well_formed_rate`` (the first turn is one `multiply` call with two
    integer arguments) and ``correct_call_rate`` (that call multiplies the problem's own operands), plus ``n``.
    """
    from ..rewards import math_answer_text_reward

    prompts = [p for p in dataset["prompt"] for _ in range(num_samples)]
    answers = [str(a) for a in dataset["answer"] for _ in range(num_samples)]
    if not prompts:
        raise ValueError("tool_accuracy needs a non-empty dataset.")
    out = tool_rollouts(
        model,
        tokenizer,
        prompts,
        max_completion_length=max_completion_length,
        max_tool_calling_iterations=max_tool_calling_iterations,
        do_sample=do_sample,
        temperature=temperature,
        seed=seed,
        batch_size=batch_size,
    )
    completions = out["completions"]
    rewards = math_answer_text_reward(completions, answer=answers)
    well_formed = [_well_formed_multiply_call(c) for c in completions]
    correct_call = [
        ok and multiplication_prompt(**c[0]["tool_calls"][0]["function"]["arguments"]) == p[-1]["content"]
        for ok, c, p in zip(well_formed, completions, prompts, strict=True)
    ]
    n = len(prompts)
    return dict(
        accuracy=sum(r or 0.0 for r in rewards) / n,
        tool_call_rate=sum(c > 0 for c in out["tool_calls"]) / n,
        well_formed_rate=sum(well_formed) / n,
        correct_call_rate=sum(correct_call) / n,
        n=n,
    )
