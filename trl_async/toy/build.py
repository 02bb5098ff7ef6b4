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

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
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

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=tiny_model_path(), help="output folder (default: the bundled tiny_qwen2/)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-train", type=int, default=8000, help="SFT problems (the test split stays the same)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--max-steps", type=int, default=3000)
    ap.add_argument("--eval-every", type=int, default=25, help="eval interval before accuracy starts rising")
    ap.add_argument("--eval-every-close", type=int, default=5, help="eval interval once accuracy >= 8 %%")
    ap.add_argument("--time-limit", type=float, default=280.0, help="seconds; save the best fallback then")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: reproducible, and much faster than 2 on a busy 2-core machine; 0: torch default)",
    )
    return ap.parse_args(argv)


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
    tokenizer = build_tokenizer(corpus)
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
        max_position_embeddings=256,
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


def _train_into_band(model, tokenizer, examples, test, args, t0):
    """SFT until the greedy accuracy on `test` lands in TARGET_BAND (or the best checkpoint in REQUIRED_BAND);
    returns (accuracy, step, state_dict or None for the current weights), or None."""
    import torch

    from .model import greedy_accuracy

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = 30
    rng = random.Random(args.seed)
    order: list[int] = []
    fallback = None  # (acc, step, state_dict) inside REQUIRED_BAND, closest to 0.30
    eval_every, last_acc, step = args.eval_every, 0.0, 0
    model.train()
    while step < args.max_steps:
        if len(order) < args.batch_size:
            idx = list(range(len(examples)))
            rng.shuffle(idx)
            order += idx
        batch = [examples[i] for i in order[: args.batch_size]]
        del order[: args.batch_size]
        ids, mask, labels = _collate(batch, tokenizer.pad_token_id)
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / warmup)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
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


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    t0 = time.time()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
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
