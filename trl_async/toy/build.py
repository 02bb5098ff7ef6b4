"""Build the bundled tiny model: ``python -m trl_async.toy.build [--out DIR]``.

1. Trains a byte-level BPE tokenizer on generated arithmetic chat text. Digits are split off one by one
   before BPE, so every digit is a single token. Special tokens: ``<|endoftext|>`` (pad), ``<|im_start|>``
   and ``<|im_end|>`` (EOS); ChatML chat template.
2. Trains a ~1.0 M-parameter ``Qwen2ForCausalLM`` from scratch (seeded) on chat-formatted SFT examples:
   the prompts of ``make_arithmetic_dataset``'s train split, target ``arithmetic_solution(...) + <|im_end|>``,
   loss on the completion tokens only.
3. Evaluates greedy accuracy on the 200 held-out test problems as training goes and saves EARLY, at the
   first checkpoint whose accuracy is in the target band, so that RL (sampling at T=1.0) has headroom.
   The target band is 25-40 % (inside the required 20-45 %, with margin for small numeric differences
   when the accuracy is recomputed on another machine or thread count); a checkpoint inside 20-45 % is
   kept as a fallback in case training jumps over the target band.

Takes about 2-4 minutes on 2 CPU cores; prints the elapsed time and the greedy and sampled accuracies.

``python -m trl_async.toy.build --tools`` builds the tool-calling variant ``tiny_qwen2_tools/`` instead (see
`trl_async.toy.tools`): its own tokenizer (trained on the tool-calling chat text, with ``<tool_call>``,
``</tool_call>``, ``<tool_response>``, ``</tool_response>`` as single tokens, and TRL's Qwen ``response_template`` saved
in its config so that TRL parses the calls), the same model shape with 512 positions, SFT on three-digit
multiplication: ``TOOL_SFT_FRACTION`` of the problems as tool-calling transcripts (loss on the model's turns only, not
on the tool response) and the rest as direct answers, which the model cannot learn. It saves at the first checkpoint
whose sampled tool calls (T=1, tools executed, 200 held-out problems) are well-formed in ``TOOLS_WELL_FORMED_BAND`` with
accuracy in ``TOOLS_ACCURACY_BAND``, so that RL has a signal and headroom (more tool calls, better copying).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import shutil
import sys
import tempfile
import time

PAD, BOS_IM, EOS_IM = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# ChatML, plus Qwen2.5's tool calling: the tools listed inside `<tools>` in a system turn, an assistant tool call as
# `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`, tool results in a user turn inside `<tool_response>` (so
# that TRL's `supports_tool_calling` accepts it and TRL's Qwen `response_template` parses the calls). Unlike Qwen2.5, a
# tool is listed as a one-line signature, `multiply(a, b): Multiply two integers.`, not its whole JSON schema (~130
# tokens for one tool with this tokenizer, longer than the tiny model's problems), and there is no default system
# prompt. Messages without tools or tool calls render exactly as the plain ChatML template did (`tests/test_toy_tools.py`
# checks it), so no prompt of the plain task changes.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n' }}{%- endif %}"
    "{{- '<tools>' }}"
    "{%- for tool in tools %}"
    "{%- set function = tool['function'] if tool['function'] is defined else tool %}"
    "{{- '\\n' + function['name'] + '(' }}"
    "{%- if function['parameters'] is defined and function['parameters']['properties'] is defined %}"
    "{{- function['parameters']['properties'] | list | join(', ') }}"
    "{%- endif %}"
    "{{- ')' }}"
    "{%- if function['description'] is defined %}{{- ': ' + function['description'] }}{%- endif %}"
    "{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if tool_call['function'] is defined %}{%- set tool_call = tool_call['function'] %}{%- endif %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call['name'] + '\", \"arguments\": ' }}"
    "{%- if tool_call['arguments'] is string %}{{- tool_call['arguments'] }}"
    "{%- else %}{{- tool_call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# A little English so that the BPE also learns some general merges (GSM8K-style prompts stay readable).
_EXTRA_TEXT = [
    "What is the answer? Solve the problem step by step.",
    'Solve the problem step by step, then finish with a final line "#### <number>".',
    "The answer is the number after the marker.",
    "She has some apples and he gives her more; how many apples does she have in total?",
    "There are students in the class, and each of them reads books every week.",
    "How much money does he spend on the tickets for the whole family?",
    "The system says: you are a helpful assistant that thinks before it answers.",
]

TARGET_BAND = (0.25, 0.40)  # stop at the first checkpoint in here (aim ~30 %)
REQUIRED_BAND = (0.20, 0.45)  # what the committed model must satisfy

# The tools variant (`--tools`).
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")  # single tokens, as in Qwen2.5
TOOLS_WELL_FORMED_BAND = (0.30, 0.60)  # sampled rollouts whose first turn is a well-formed `multiply` call
# ... while this many are right: some, so that RL's groups are not all-zero, and few, so that RL has headroom.
TOOLS_ACCURACY_BAND = (0.10, 0.30)


def build_tokenizer(corpus: list[str], vocab_size: int = 400):
    """Train a byte-level BPE (``tokenizers``) with single-digit tokens; return it as a ``Qwen2Tokenizer``.

    The normalizer / pre-tokenizer / decoder are exactly those ``Qwen2Tokenizer`` builds on load (transformers
    5 rebuilds them for ``model_type="qwen2"`` checkpoints, whatever ``tokenizer.json`` says): NFC, then
    Qwen2's split regex, whose ``\\p{N}`` alternative isolates every digit, then byte-level encoding. Training
    with the same pipeline makes the saved tokenizer load back identically through ``AutoTokenizer``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[PAD, BOS_IM, EOS_IM],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    state = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    return Qwen2Tokenizer(
        vocab=state["vocab"],
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token=EOS_IM,
        pad_token=PAD,
        extra_special_tokens=[BOS_IM],
        chat_template=CHAT_TEMPLATE,
        padding_side="right",
        model_max_length=256,
        clean_up_tokenization_spaces=False,
    )


def _problem_of(prompt_text: str) -> tuple[int, str, int]:
    """Parse ``"What is 23+58?"`` back into ``(23, "+", 58)``."""
    import re

    m = re.fullmatch(r"What is (\d+)([+-])(\d+)\?", prompt_text)
    if m is None:
        raise ValueError(f"Not an arithmetic prompt: {prompt_text!r}")
    return int(m.group(1)), m.group(2), int(m.group(3))


def _encode_examples(tokenizer, rows) -> list[tuple[list[int], list[int]]]:
    from .arithmetic import arithmetic_solution

    prompt_texts = [tokenizer.apply_chat_template(r, add_generation_prompt=True, tokenize=False) for r in rows]
    completions = [arithmetic_solution(*_problem_of(r[0]["content"])) + EOS_IM for r in rows]
    p_ids = tokenizer(prompt_texts, add_special_tokens=False)["input_ids"]
    c_ids = tokenizer(completions, add_special_tokens=False)["input_ids"]
    return list(zip(p_ids, c_ids, strict=True))


def _collate(examples, pad_id):
    import torch

    n = max(len(p) + len(c) for p, c in examples)
    ids = torch.full((len(examples), n), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), n), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), n), dtype=torch.long)
    for i, (p, c) in enumerate(examples):
        seq = p + c
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p) : len(seq)] = torch.tensor(c)
        mask[i, : len(seq)] = 1
    return ids, mask, labels


def _parse_args(argv):
    from . import tiny_model_path
    from .tools import TOOL_SFT_FRACTION, tiny_tools_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out",
        default=None,
        help="output folder (default: the bundled tiny_qwen2/, or tiny_qwen2_tools/ with --tools)",
    )
    ap.add_argument("--tools", action="store_true", help="build the tool-calling variant (trl_async.toy.tools)")
    ap.add_argument("--tool-fraction", type=float, default=None, help="--tools: share of tool-calling transcripts")
    ap.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary (default 400; 500 with --tools)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-train", type=int, default=8000, help="SFT problems (the test split stays the same)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--max-steps", type=int, default=3000)
    ap.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="eval interval before accuracy starts rising (25; 50 with --tools)",
    )
    ap.add_argument(
        "--eval-every-close",
        type=int,
        default=None,
        help="eval interval once accuracy >= 8 %% (--tools: once operands are copied); default 5 (10 with --tools)",
    )
    ap.add_argument(
        "--time-limit", type=float, default=None, help="seconds (280; 3600 with --tools); save the best fallback then"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: reproducible, and much faster than 2 on a busy 2-core machine; 0: torch default)",
    )
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = tiny_tools_model_path() if args.tools else tiny_model_path()
    if args.tool_fraction is None:
        args.tool_fraction = TOOL_SFT_FRACTION
    if args.time_limit is None:
        args.time_limit = 3600.0 if args.tools else 280.0  # the tools variant learns to copy after ~600 steps
    if args.eval_every is None:
        args.eval_every = 50 if args.tools else 25
    if args.eval_every_close is None:
        args.eval_every_close = 10 if args.tools else 5  # a tools eval runs 200 multi-turn rollouts
    if args.vocab_size is None:
        args.vocab_size = 500 if args.tools else 400  # the tools variant: merges for the tool-calling text too
    args.max_positions = 512 if args.tools else 256  # the tools variant: room for tool schemas and several turns
    return args


def _tokenizer_and_examples(args):
    """(tokenizer, SFT examples, held-out test split): the tokenizer trained on the chat-formatted train text."""
    from .arithmetic import arithmetic_solution, make_arithmetic_dataset

    data = make_arithmetic_dataset(num_train=args.num_train, num_test=200, seed=args.seed)
    train_rows, test = list(data["train"]["prompt"]), data["test"]
    corpus = []
    for r in train_rows:
        a, op, b = _problem_of(r[0]["content"])
        corpus.append(f"user\nWhat is {a}{op}{b}?")
        corpus.append(f"assistant\n{arithmetic_solution(a, op, b)}")
    corpus += _EXTRA_TEXT * 4
    tokenizer = build_tokenizer(corpus, vocab_size=args.vocab_size)
    digit_ids = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    assert all(tokenizer.encode(str(d), add_special_tokens=False) == [i] for d, i in enumerate(digit_ids))
    print(
        f"tokenizer: {len(tokenizer)} tokens; eos={tokenizer.eos_token}({tokenizer.eos_token_id}) "
        f"pad={tokenizer.pad_token}({tokenizer.pad_token_id})",
        flush=True,
    )
    examples = _encode_examples(tokenizer, train_rows)
    c_lens = [len(c) for _, c in examples]
    print(
        f"SFT examples: {len(examples)}; completion tokens min/mean/max = "
        f"{min(c_lens)}/{sum(c_lens) / len(c_lens):.1f}/{max(c_lens)}",
        flush=True,
    )
    return tokenizer, examples, test


def _new_model(tokenizer, args):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.max_positions,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS_IM),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        use_cache=True,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = config.bos_token_id
    print(f"model: Qwen2ForCausalLM, {sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
    return model


def _sft_steps(model, examples, collate, pad_id, args):
    """Supervised fine-tuning, one optimizer step at a time: yields (step, loss) after each, up to `args.max_steps`
    (AdamW, linear warm-up over 30 steps, gradient norm clipped at 1, shuffled epochs of `args.batch_size` rows)."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = 30
    rng = random.Random(args.seed)
    order: list[int] = []
    step = 0
    model.train()
    while step < args.max_steps:
        if len(order) < args.batch_size:
            idx = list(range(len(examples)))
            rng.shuffle(idx)
            order += idx
        batch = [examples[i] for i in order[: args.batch_size]]
        del order[: args.batch_size]
        ids, mask, labels = collate(batch, pad_id)
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / warmup)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        yield step, loss


def _train_into_band(model, tokenizer, examples, test, args, t0):
    """SFT until the greedy accuracy on `test` lands in TARGET_BAND (or the best checkpoint in REQUIRED_BAND);
    returns (accuracy, step, state_dict or None for the current weights), or None."""
    from .model import greedy_accuracy

    fallback = None  # (acc, step, state_dict) inside REQUIRED_BAND, closest to 0.30
    eval_every, last_acc, step = args.eval_every, 0.0, 0
    for step, loss in _sft_steps(model, examples, _collate, tokenizer.pad_token_id, args):
        if step % eval_every:
            continue
        acc = greedy_accuracy(model, tokenizer, test)
        el = time.time() - t0
        print(f"step {step:5d}  loss {loss.item():.4f}  greedy acc {acc:.3f}  ({el:.0f}s)", flush=True)
        if acc >= 0.08:
            eval_every = args.eval_every_close
        last_acc = acc
        if TARGET_BAND[0] <= acc <= TARGET_BAND[1]:
            return acc, step, None
        if REQUIRED_BAND[0] <= acc <= REQUIRED_BAND[1]:
            if fallback is None or abs(acc - 0.30) < abs(fallback[0] - 0.30):
                fallback = (acc, step, copy.deepcopy(model.state_dict()))
        if (acc > REQUIRED_BAND[1] and fallback is not None) or el > args.time_limit:
            break
    if fallback is None:
        print(
            f"FAILED: no checkpoint with greedy accuracy in {REQUIRED_BAND} (last {last_acc:.3f} at step {step}); "
            "try --lr, --eval-every-close or --time-limit.",
            file=sys.stderr,
        )
    return fallback


def _save(model, tokenizer, out: str) -> None:
    """Save into `out` through a temporary folder beside it (never a half-written model), float32 in config.json."""
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="tiny_qwen2_", dir=os.path.dirname(out))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        cfg_path = os.path.join(tmp, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg["torch_dtype"] = "float32"
        cfg["dtype"] = "float32"
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
            f.write("\n")
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
        os.chmod(out, 0o755)  # mkdtemp makes it 0700
        for name in os.listdir(out):
            os.chmod(os.path.join(out, name), 0o644)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)


def _check_saved(out: str, test, seed: int, t0: float) -> int:
    """Reload from disk and re-measure; 1 when the reloaded accuracy is outside REQUIRED_BAND."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .model import greedy_accuracy, sampled_accuracy

    tok2 = AutoTokenizer.from_pretrained(out)
    model2 = AutoModelForCausalLM.from_pretrained(out)
    g_acc = greedy_accuracy(model2, tok2, test)
    s_acc = sampled_accuracy(model2, tok2, test, temperature=1.0, num_samples=8, seed=seed)
    size_mb = os.path.getsize(os.path.join(out, "model.safetensors")) / 1e6
    n_params = sum(p.numel() for p in model2.parameters())
    print(f"saved {out} ({size_mb:.1f} MB model.safetensors, {n_params:,} parameters)")
    print(f"greedy accuracy (reloaded, 200 held-out): {g_acc:.3f}")
    print(f"sampled accuracy at T=1.0 (8 samples x 200 held-out): {s_acc:.3f}")
    print(f"build time: {time.time() - t0:.1f}s")
    if not REQUIRED_BAND[0] <= g_acc <= REQUIRED_BAND[1]:
        print(f"WARNING: reloaded greedy accuracy {g_acc:.3f} is outside {REQUIRED_BAND}", file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------------------------------- the tools variant
def _tool_conversation(a: int, b: int, uses_tool: bool) -> list[dict]:
    """One SFT conversation of `a*b`: a `multiply` call, its result and the answer, or the answer directly."""
    from .tools import multiplication_prompt

    user = {"role": "user", "content": multiplication_prompt(a, b)}
    answer = {"role": "assistant", "content": f"#### {a * b}"}
    if not uses_tool:
        return [user, answer]
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
    return [
        user,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "multiply", "content": str(a * b)},
        answer,
    ]


def _tools_tokenizer_and_examples(args):
    """(tokenizer, SFT examples as (ids, loss mask), held-out test split) of the tools variant.

    The token ids of a tool-calling example are those TRL's tool loop builds at RL time: the prompt rendered with the
    tool schema, the sampled call, the tool suffix (`tools.tool_suffix_ids`, as TRL computes it) and the sampled answer,
    concatenated; the loss covers the two sampled parts only."""
    import re

    from tokenizers import AddedToken
    from transformers.utils.chat_template_utils import render_jinja_template
    from trl.chat_template_utils import qwen3_template

    from .tools import make_multiplication_dataset, multiply, tool_call_text, tool_suffix_ids

    data = make_multiplication_dataset(num_train=args.num_train, num_test=200, seed=args.seed)
    rng = random.Random(args.seed + 1)
    problems = []
    for prompt in data["train"]["prompt"]:
        a, b = (int(x) for x in re.fullmatch(r"What is (\d+)\*(\d+)\?", prompt[0]["content"]).groups())
        problems.append((a, b, rng.random() < args.tool_fraction))
    # The BPE learns from the rendered chats, without the tokens that are added whole (special or tool tokens).
    whole = re.compile("|".join(re.escape(t) for t in (PAD, BOS_IM, EOS_IM, *TOOL_TOKENS)))
    rendered, _ = render_jinja_template(
        [_tool_conversation(a, b, uses_tool) for a, b, uses_tool in problems],
        tools=[multiply],
        chat_template=CHAT_TEMPLATE,
    )
    corpus = [piece for text in rendered for piece in whole.split(text) if piece] + _EXTRA_TEXT * 4
    tokenizer = build_tokenizer(corpus, vocab_size=args.vocab_size)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tokenizer.response_template = qwen3_template  # TRL's parser for Qwen-format tool calls, saved with the tokenizer
    tokenizer.model_max_length = args.max_positions
    prompt_ids = tokenizer.apply_chat_template(
        [[{"role": "user", "content": "What is 1*1?"}]], tools=[multiply], add_generation_prompt=True, tokenize=True
    )
    print(
        f"tokenizer: {len(tokenizer)} tokens; a tool prompt is {len(prompt_ids['input_ids'][0])} tokens",
        flush=True,
    )

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    examples = []
    for (a, b, uses_tool), prompt in zip(problems, data["train"]["prompt"], strict=True):
        ids = tokenizer.apply_chat_template(prompt, tools=[multiply], add_generation_prompt=True, return_dict=False)
        ids = list(ids)
        mask = [0] * len(ids)
        if uses_tool:
            call = encode(tool_call_text("multiply", {"a": a, "b": b}) + EOS_IM)
            suffix = tool_suffix_ids(tokenizer, [{"role": "tool", "name": "multiply", "content": str(a * b)}])
            ids, mask = ids + call + suffix, mask + [1] * len(call) + [0] * len(suffix)
        final = encode(f"#### {a * b}{EOS_IM}")
        examples.append((ids + final, mask + [1] * len(final)))
    lengths = [len(ids) for ids, _ in examples]
    print(
        f"SFT examples: {len(examples)} ({sum(p[2] for p in problems)} with a tool call); tokens min/mean/max = "
        f"{min(lengths)}/{sum(lengths) / len(lengths):.1f}/{max(lengths)}",
        flush=True,
    )
    return tokenizer, examples, data["test"]


def _collate_masked(examples, pad_id):
    import torch

    n = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), n), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), n), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), n), dtype=torch.long)
    for i, (seq, loss_mask) in enumerate(examples):
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, : len(seq)] = torch.tensor([t if m else -100 for t, m in zip(seq, loss_mask, strict=True)])
        mask[i, : len(seq)] = 1
    return ids, mask, labels


def _tools_metrics(model, tokenizer, test, seed: int) -> dict:
    """Sampled (T=1, one per problem) and greedy figures of the tool task on `test`, tools executed."""
    from .tools import tool_accuracy

    sampled = tool_accuracy(model, tokenizer, test, do_sample=True, temperature=1.0, seed=seed)
    greedy = tool_accuracy(model, tokenizer, test)
    return {"sampled": sampled, "greedy": greedy}


def _train_tools_into_band(model, tokenizer, examples, test, args, t0):
    """SFT until the sampled well-formed tool-call rate is in TOOLS_WELL_FORMED_BAND with accuracy at most
    TOOLS_ACCURACY_BAND; returns (metrics, step) for the current weights, or None."""
    from .tools import tool_accuracy

    step, eval_every = 0, args.eval_every
    for step, loss in _sft_steps(model, examples, _collate_masked, tokenizer.pad_token_id, args):
        if step % eval_every:
            continue
        sampled = tool_accuracy(model, tokenizer, test, do_sample=True, temperature=1.0, seed=args.seed)
        el = time.time() - t0
        print(
            f"step {step:5d}  loss {loss.item():.4f}  sampled: tool calls {sampled['tool_call_rate']:.3f} well-formed "
            f"{sampled['well_formed_rate']:.3f} right operands {sampled['correct_call_rate']:.3f} accuracy "
            f"{sampled['accuracy']:.3f}  ({el:.0f}s)",
            flush=True,
        )
        if _in_tools_target(sampled):
            return sampled, step
        if sampled["correct_call_rate"] > 0:
            eval_every = args.eval_every_close  # the operands are being copied: the band is near
        if sampled["accuracy"] > TOOLS_ACCURACY_BAND[1] or el > args.time_limit:
            break
    print(
        f"FAILED: no checkpoint with a well-formed tool-call rate in {TOOLS_WELL_FORMED_BAND} and accuracy in "
        f"{TOOLS_ACCURACY_BAND} by step {step}; try --lr, --eval-every-close or --time-limit.",
        file=sys.stderr,
    )
    return None


def _in_tools_target(sampled: dict) -> bool:
    low, high = TOOLS_WELL_FORMED_BAND
    return low <= sampled["well_formed_rate"] <= high and (
        TOOLS_ACCURACY_BAND[0] <= sampled["accuracy"] <= TOOLS_ACCURACY_BAND[1]
    )


def _main_tools(args, t0: float) -> int:
    tokenizer, examples, test = _tools_tokenizer_and_examples(args)
    model = _new_model(tokenizer, args)
    chosen = _train_tools_into_band(model, tokenizer, examples, test, args, t0)
    if chosen is None:
        return 1
    _, step = chosen
    print(f"selected step {step}", flush=True)
    out = os.path.abspath(args.out)
    _save(model, tokenizer, out)
    return _check_saved_tools(out, test, args.seed, t0)


def _check_saved_tools(out: str, test, seed: int, t0: float) -> int:
    """Reload from disk and re-measure; 1 when the reloaded figures are outside the target."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok2 = AutoTokenizer.from_pretrained(out)
    model2 = AutoModelForCausalLM.from_pretrained(out)
    metrics = _tools_metrics(model2, tok2, test, seed)
    size_mb = os.path.getsize(os.path.join(out, "model.safetensors")) / 1e6
    print(
        f"saved {out} ({size_mb:.1f} MB model.safetensors, {sum(p.numel() for p in model2.parameters()):,} parameters)"
    )
    for kind, m in metrics.items():
        print(
            f"{kind} (reloaded, 200 held-out): tool calls {m['tool_call_rate']:.3f}, well-formed "
            f"{m['well_formed_rate']:.3f}, right operands {m['correct_call_rate']:.3f}, accuracy {m['accuracy']:.3f}"
        )
    print(f"build time: {time.time() - t0:.1f}s")
    if not _in_tools_target(metrics["sampled"]):
        print("WARNING: the reloaded model is outside the target", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    t0 = time.time()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    if args.tools:
        return _main_tools(args, t0)
    tokenizer, examples, test = _tokenizer_and_examples(args)
    model = _new_model(tokenizer, args)
    chosen = _train_into_band(model, tokenizer, examples, test, args, t0)
    if chosen is None:
        return 1
    acc, best_step, state = chosen
    if state is not None:
        model.load_state_dict(state)
    print(f"selected step {best_step}: greedy accuracy {acc:.3f}", flush=True)
    out = os.path.abspath(args.out)
    _save(model, tokenizer, out)
    return _check_saved(out, test, args.seed, t0)


if __name__ == "__main__":
    raise SystemExit(main())
