"""Forward+backward time of the policy losses, given log-prob tensors that require grad.

Contenders (all side by side in one run):
  dapo               TRL 1.16 ``_compute_loss`` with loss_type="dapo" (token-level PPO clip, sum / valid tokens)
  grpo               TRL 1.16 ``_compute_loss`` with loss_type="grpo" (mean over sequences of the per-sequence mean)
  m2po               trl_async.algorithms.m2po.m2po_loss, rule="paper" (Algorithm 1 of arXiv:2510.01161; the default)
  m2po_all_tokens    m2po_loss, rule="all_tokens" (AReaL's candidate set)
  m2po_authors_code  m2po_loss, rule="authors_code" (the authors' training code: capped-mean cut as a PPO clip)
  m2po_ref           benchmarks/reference_page_m2po.py (the reference page's per-token rule)

Staleness regimes for the log ratios delta = logp - logmu (tau = 0.04), calibrated on the "paper" rule:
  a  near on-policy: nothing masked
  b  stale: ~1% of the valid tokens masked
  c  very stale: ~20% masked

Timing: the contenders are interleaved inside every repeat, in a fresh random order each repeat, so machine noise
and whatever a predecessor leaves behind hit all of them alike.  The headline is the *paired* ratio to dapo: for every repeat, contender time / dapo time of the
same repeat; the table and the JSON give the median, min and max of those ratios (ratios of medians are in the JSON
too, for reference only).

    OMP_NUM_THREADS=1 python benchmarks/bench_losses.py            # full run (~1-2 min), JSON -> benchmarks/results/
    python benchmarks/bench_losses.py --quick                       # a few repeats, smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.reference_page_m2po import reference_page_m2po_loss  # noqa: E402
from trl_async.algorithms.m2po import m2po_loss, m2po_mask  # noqa: E402

TAU = 0.04
EPS_LOW = EPS_HIGH = 0.2
REGIMES = {"a": ("near on-policy", 0.0), "b": ("stale", 0.01), "c": ("very stale", 0.20)}
BAR = 1.3  # "paper" m2po <= 1.3x dapo at 64x256 in regimes a and b (paired median)


# ---- TRL 1.16 per-token PPO-clip loss (grpo_trainer.py `_compute_loss`, importance_sampling_level="token",
# ---- beta=0, no delta, no entropy mask / off-policy mask / vLLM IS correction) ---------------------------
def _trl_per_token_loss(per_token_logps, old_per_token_logps, advantages):
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    log_ratio = per_token_logps - old_per_token_logps
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - EPS_LOW, 1 + EPS_HIGH)
    per_token_loss1 = coef_1 * advantages
    per_token_loss2 = coef_2 * advantages
    return -torch.min(per_token_loss1, per_token_loss2)


def trl_dapo(logp, old, adv, mask):
    per_token_loss = _trl_per_token_loss(logp, old, adv)
    # TRL divides by num_items_in_batch (the valid-token count) / num_processes; one process here.
    normalizer = mask.sum().clamp(min=1.0)
    return (per_token_loss * mask).sum() / normalizer


def trl_grpo(logp, old, adv, mask):
    per_token_loss = _trl_per_token_loss(logp, old, adv)
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def _m2po(rule):
    def loss(logp, old, adv, mask):
        return m2po_loss(logp, old, adv, mask, threshold=TAU, rule=rule)[0]

    return loss


def ours_m2po_ref(logp, old, adv, mask):
    return reference_page_m2po_loss(logp, old, adv, mask, gamma=2.0, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH)[0]


CONTENDERS = {
    "dapo": trl_dapo,
    "grpo": trl_grpo,
    "m2po": _m2po("paper"),
    "m2po_all_tokens": _m2po("all_tokens"),
    "m2po_authors_code": _m2po("authors_code"),
    "m2po_ref": ours_m2po_ref,
}
RULE_OF = {"m2po": "paper", "m2po_all_tokens": "all_tokens", "m2po_authors_code": "authors_code"}


# ---- inputs --------------------------------------------------------------------------------------------
def _masked_fraction(delta, mask, adv, rule="paper"):
    keep = m2po_mask(delta, mask, TAU, adv, rule)
    n = int(mask.sum())
    return 1.0 - int(keep.sum()) / max(n, 1)


def make_inputs(B: int, L: int, regime: str, seed: int, device: str):
    """Random completion lengths (padding), GRPO-like advantages (one per row) and log ratios for one regime.

    (a) Gaussian delta with mean delta^2 = tau / 4.  (b), (c): heavy-tailed delta = s * t_3 (Student t, 3 dof);
    the scale s is bisected so that the "paper" rule masks the target fraction of the valid tokens.
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, L + 1, (B,), generator=g)
    mask = (torch.arange(L)[None, :] < lengths[:, None]).long()  # TRL's completion_mask is an integer tensor
    old = -torch.rand(B, L, generator=g) * 3.0
    adv = torch.randn(B, generator=g)
    target = REGIMES[regime][1]
    if target == 0.0:
        delta = torch.randn(B, L, generator=g) * (TAU / 4) ** 0.5
    else:
        chi2_3 = torch.randn(3, B, L, generator=g).square().sum(0)
        z = torch.randn(B, L, generator=g) / torch.sqrt(chi2_3 / 3.0)
        lo, hi = 0.01, 5.0
        for _ in range(40):
            mid = (lo * hi) ** 0.5
            if _masked_fraction(z * mid, mask, adv) < target:
                lo = mid
            else:
                hi = mid
        delta = z * hi
    logp = (old + delta).to(device).requires_grad_()
    return logp, old.to(device), adv.to(device), mask.to(device)


# ---- timing --------------------------------------------------------------------------------------------
def _sync(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def time_case(B, L, regime, repeats, warmup, seed, device, names):
    logp, old, adv, mask = make_inputs(B, L, regime, seed, device)
    times = {k: [] for k in names}
    order_rng = random.Random(seed)
    for it in range(warmup + repeats):
        # A fresh random order every repeat: with a fixed (even rotating) cycle each contender always runs right
        # after the same one, and what the predecessor leaves behind (allocator, caches) biases the pair.
        order = list(names)
        order_rng.shuffle(order)
        for name in order:
            fn = CONTENDERS[name]
            logp.grad = None
            _sync(device)
            t0 = time.perf_counter()
            loss = fn(logp, old, adv, mask)
            loss.backward()
            _sync(device)
            dt = time.perf_counter() - t0
            if it >= warmup:
                times[name].append(dt)
    paired = {k: _summary([a / b for a, b in zip(times[k], times["dapo"], strict=True)]) for k in names}
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    masked = {k: _masked_fraction(logp.detach() - old, mask, adv, rule) for k, rule in RULE_OF.items() if k in names}
    if "m2po_ref" in names:
        masked["m2po_ref"] = reference_page_m2po_loss(logp.detach(), old, adv, mask)[1]
    return {
        "B": B,
        "L": L,
        "regime": regime,
        "regime_name": REGIMES[regime][0],
        "valid_tokens": int(mask.sum()),
        "repeats": repeats,
        "paired_ratio_to_dapo": paired,
        "median_ms": med,
        "ratio_of_medians_to_dapo": {k: med[k] / med["dapo"] for k in names},
        "masked_fraction": masked,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats for the small shape (default 1000)")
    ap.add_argument("--repeats-large", type=int, default=None, help="timed repeats for the large shape (default 30)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="few repeats (smoke test)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--shapes", default="64x256,256x1024")
    ap.add_argument("--regimes", default="abc")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated subset (dapo is required)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench_losses[_quick].json)")
    args = ap.parse_args(argv)
    if args.out is None:
        name = "bench_losses_quick.json" if args.quick else "bench_losses.json"
        args.out = str(Path(__file__).resolve().parent / "results" / name)

    torch.set_num_threads(args.threads)
    rep_small = args.repeats or (20 if args.quick else 1000)
    rep_large = args.repeats_large or (3 if args.quick else 30)
    warmup = 2 if args.quick else args.warmup

    names = [k for k in CONTENDERS if k in args.contenders.split(",")]
    if "dapo" not in names:
        ap.error("--contenders must include dapo (ratios are relative to it)")
    started = time.perf_counter()
    results = []
    print(f"torch {torch.__version__}, device={args.device}, threads={torch.get_num_threads()}, tau={TAU}")
    print("paired ratio to dapo per repeat: median [min, max]; dapo column: median ms")
    header = f"{'shape':>9} {'regime':>16} {'masked':>7} {'dapo ms':>8} " + " ".join(f"{k:>24}" for k in names[1:])
    print(header)
    print("-" * len(header))
    for shape in args.shapes.split(","):
        B, L = (int(x) for x in shape.split("x"))
        reps = rep_small if B * L <= 64 * 256 else rep_large
        for regime in args.regimes:
            r = time_case(B, L, regime, reps, warmup, args.seed, args.device, names)
            results.append(r)
            cells = " ".join(
                "{:>24}".format(
                    f"{r['paired_ratio_to_dapo'][k]['median']:.2f} "
                    f"[{r['paired_ratio_to_dapo'][k]['min']:.2f}, {r['paired_ratio_to_dapo'][k]['max']:.2f}]"
                )
                for k in names[1:]
            )
            masked = r["masked_fraction"].get("m2po", float("nan"))
            print(
                f"{shape:>9} {regime + ' ' + r['regime_name']:>16} {masked:>7.2%} {r['median_ms']['dapo']:>8.3f} {cells}",
                flush=True,
            )

    bar = [r for r in results if (r["B"], r["L"]) == (64, 256) and r["regime"] in "ab"]
    bar_ok = all(r["paired_ratio_to_dapo"]["m2po"]["median"] <= BAR for r in bar) if bar and "m2po" in names else None
    if bar_ok is not None:
        print(
            f"bar (m2po 'paper' <= {BAR}x dapo at 64x256, regimes a and b, paired median): {'PASS' if bar_ok else 'FAIL'}"
        )
    print(f"total {time.perf_counter() - started:.0f} s")
    out = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "device": args.device,
        "threads": torch.get_num_threads(),
        "tau": TAU,
        "epsilon": [EPS_LOW, EPS_HIGH],
        "quick": args.quick,
        "command": " ".join(["python", "benchmarks/bench_losses.py", *(argv if argv is not None else sys.argv[1:])]),
        "headline": "paired_ratio_to_dapo (per-repeat contender/dapo time: median, min, max)",
        "bar_m2po_paper_le_1.3x_dapo_64x256_ab": bar_ok,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
