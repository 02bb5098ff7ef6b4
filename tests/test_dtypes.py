"""Every dtype a policy's log-probs come in: `m2po_mask`, `m2po_loss` and the importance correction accept float16,
bfloat16, float32 and float64, and give what an independent derivation gives on the same numbers.

M2PO ranks delta^2 in float32 ("float64 inputs are rounded to float32 first", `m2po_select`), so each dtype is compared
with Algorithm 1's one-token-at-a-time reference (`algorithms/m2po/reference.py`) or the brute forces of
`tests/test_losses.py`, run on the float32-rounded inputs. The float64 grid is what crashed on the H200 check
(`RuntimeError: The size of tensor a (3304) must match the size of tensor b (1652)`: float64 advantages promoted the
ranked delta^2 to float64, whose int32 view has twice the elements). No model.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.references import reference_weights
from tests.test_losses import _regime_case, brute_keep, flat, token_advantages
from trl_async.algorithms.m2po import M2PO_RULES, m2po_loss, m2po_mask
from trl_async.algorithms.m2po.reference import m2po_mask_reference
from trl_async.algorithms.offpolicy import OFFPOLICY_SUM_KEYS
from trl_async.trainers.correction import WEIGHT_SUMS, CorrectionSettings, behaviour_correction, m2po_correction

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
DTYPE_IDS = ["float16", "bfloat16", "float32", "float64"]
TAU = 0.04


def _log_ratios(regime: str, rule: str, dtype: torch.dtype, seed: int = 21):
    """A regime's log ratios in `dtype`. Nudged off float32 first, so that float64 inputs really are rounded."""
    delta, mask, adv = _regime_case(seed, 4, 200, regime, "all_tokens" if rule == "all_tokens" else "paper")
    return (delta.double() * (1 + 2.0**-35)).to(dtype), mask, adv


def _expected_keep(rule: str, delta: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor) -> list:
    """What the rule keeps, derived independently on the float32-rounded inputs."""
    delta32, adv32 = delta.float(), adv.float()
    if rule == "paper":
        return flat(m2po_mask_reference(delta32, mask, adv32, TAU))
    return brute_keep(rule, flat(delta32), token_advantages(adv32, delta.shape), flat(mask.bool()), TAU)


@pytest.mark.parametrize("branch", ["host", "accelerator"])
@pytest.mark.parametrize("regime", ["none", "1pct", "20pct", "all"])
@pytest.mark.parametrize("rule", M2PO_RULES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_m2po_mask_in_every_dtype_keeps_what_the_reference_keeps(dtype, rule, regime, branch):
    delta, mask, adv = _log_ratios(regime, rule, dtype)
    for adv_dtype in {dtype, torch.float32}:  # the advantages in the log-probs' dtype, and in TRL's float32
        keep = m2po_mask(delta, mask, TAU, adv.to(adv_dtype), rule, host_memory=branch == "host")
        expected = _expected_keep(rule, delta, mask, adv)
        assert keep.dtype == torch.bool and flat(keep) == expected
    if regime in ("1pct", "20pct"):
        assert 0 < expected.count(False) - flat(~mask.bool()).count(True)  # the case masks something


_TOLERANCE = {torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5, torch.float64: 1e-12}


@pytest.mark.parametrize("branch", ["host", "accelerator"])
@pytest.mark.parametrize("rule", M2PO_RULES)
@pytest.mark.parametrize("adv_dtype", [torch.float32, torch.float64], ids=["adv_float32", "adv_float64"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_m2po_loss_in_every_dtype(dtype, adv_dtype, rule, branch):
    delta, mask, adv = _log_ratios("20pct", rule, dtype)
    behaviour = torch.full(delta.shape, -1.5, dtype=dtype)
    logp = (behaviour + delta).detach().requires_grad_()
    seen = (logp - behaviour).detach()  # the log ratio the loss is given, in `dtype`
    adv = adv.to(adv_dtype)
    loss, _ = m2po_loss(logp, behaviour, adv, mask, TAU, rule=rule, host_memory=branch == "host")
    loss.backward()
    keep = _expected_keep(rule, seen, mask, adv)
    assert torch.isfinite(loss) and logp.grad.dtype == dtype
    a = token_advantages(adv.double(), delta.shape)
    d = flat(seen.double())
    n = sum(flat(mask.bool()))
    # A token without gradient is exactly one the rule does not keep (or with A = 0; "authors_code" also holds
    # clipped tokens at their bound, without gradient).
    assert [g != 0 for g in flat(logp.grad)] == [k and ai != 0 for k, ai in zip(keep, a, strict=True)]
    grads = [-k * math.exp(di) * ai / n for k, di, ai in zip(keep, d, a, strict=True)]
    expected_grad = torch.tensor(grads, dtype=torch.float64).view(delta.shape)
    torch.testing.assert_close(logp.grad.double(), expected_grad, rtol=_TOLERANCE[dtype], atol=0)
    if rule != "authors_code":  # J = (1/N) sum_t M_t r_t A_t, loss = -J
        expected = -math.fsum(k * math.exp(di) * ai for k, di, ai in zip(keep, d, a, strict=True)) / n
        assert float(loss.detach()) == pytest.approx(expected, rel=_TOLERANCE[dtype])


# Per-token ratios pi_old / mu far enough from the bounds (clip 0.1 .. 1.2) that bfloat16 rounds none across one.
_RATIOS = [[5.0, 1.0, 0.01, 1.1], [0.5, 8.0, 1.15, 0.02], [0.9, 1.0, 0.3, 0.6]]
_MASK = [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]]


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_importance_correction_in_every_dtype(dtype, mode):
    behaviour = torch.full((3, 4), -2.0, dtype=dtype)
    old = behaviour + torch.tensor([[math.log(r) for r in row] for row in _RATIOS], dtype=dtype)
    mask = torch.tensor(_MASK, dtype=torch.float32)
    clip_min, clip_max = 0.1, 1.2
    settings = CorrectionSettings(corrects=True, mode=mode, clip_min=clip_min, clip_max=clip_max)
    result = behaviour_correction(old, behaviour, mask, settings)
    want = reference_weights(old.double(), behaviour.double(), mask.double(), mode, clip_min, clip_max)
    torch.testing.assert_close(result.weights.double(), want, rtol=_TOLERANCE[dtype] * 4, atol=0)
    # The figures, counted from the plain-Python weights: a weight that was truncated sits on a bound (truncate
    # modes) or is 0 (mask modes).
    sequence = mode.startswith("sequence")
    units = [any(m) for m in _MASK] if sequence else [bool(m) for row in _MASK for m in row]
    raw = reference_weights(old.double(), behaviour.double(), mask.double(), mode, None, None).reshape(-1).tolist()
    outside = [u and not clip_min <= r <= clip_max for r, u in zip(raw, units, strict=True)]
    sums = dict(zip(WEIGHT_SUMS, result.weight_sums.tolist(), strict=True))
    assert sums["count"] == sum(units) and sums["changed"] == sum(outside) > 0
    assert sums["zero"] == (0 if mode.endswith("truncate") else sum(outside))
    off = dict(zip(OFFPOLICY_SUM_KEYS, result.offpolicy_sums.tolist(), strict=True))
    if mode == "token_truncate":
        assert off["clipped_tokens"] == sums["changed"]  # the two clipped fractions agree
    if mode == "token_mask":
        assert off["masked_tokens"] == sums["changed"]


@pytest.mark.parametrize("rule", M2PO_RULES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_m2po_correction_in_every_dtype(dtype, rule):
    delta, mask, adv = _log_ratios("20pct", rule, dtype, seed=5)
    settings = CorrectionSettings(corrects=False, m2po_threshold=TAU, m2po_rule=rule)
    selection, sums = m2po_correction(delta, mask, adv.to(dtype), settings)
    keep = _expected_keep(rule, delta, mask, adv)
    assert flat(selection.keep) == keep
    off = dict(zip(OFFPOLICY_SUM_KEYS, sums.tolist(), strict=True))
    clipped = 0 if selection.clipped is None else int(selection.clipped.sum())
    assert off["tokens"] == sum(flat(mask.bool())) and off["kept_tokens"] == sum(keep) + clipped
