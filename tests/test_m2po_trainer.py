"""loss_type="m2po" inside AsyncGRPOTrainer, on the bundled tiny model."""

import copy
import math
import os
import socket
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.authors_m2po import authors_clip_bounds, authors_m2po_loss
from tests.support.trainer_utils import (
    WeightTracingTrainer,
    length_reward,
    load_model,
    load_tokenizer,
    make_args,
    make_batch,
)
from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
from trl_async.rewards import MathAnswerReward
from trl_async.toy import make_arithmetic_dataset, tiny_model_path


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_model_path())


@pytest.fixture(scope="module")
def dataset():
    return make_arithmetic_dataset(num_train=128, num_test=8, seed=2)["train"]


def train(tmp_path, tokenizer, dataset, **overrides):
    kwargs = dict(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=16, num_generations=8,
                  max_completion_length=24, learning_rate=1e-3, logging_steps=1, report_to="none",
                  save_strategy="no", bf16=False, loss_type="m2po", max_staleness=1)  # fmt: skip
    kwargs.update(overrides)
    trainer = AsyncGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_path()),
        reward_funcs=MathAnswerReward(tokenizer),
        args=AsyncGRPOConfig(**kwargs),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h and "reward" in h]


class _M2PORecordingTrainer(WeightTracingTrainer):
    """Also records, for every training loss, the version, the batch dict and the loss the trainer returned."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.m2po_calls: list[tuple[int, dict, float]] = []

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        if self.model.training:
            given = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
            self.m2po_calls.append((self.state.global_step, given, loss.item()))
        return loss


def digit_reward(completions, **kwargs):
    """A dense text reward: the share of digits among the characters, different in most groups."""
    texts = [c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


def _plain_log_ratio(model, weights, inputs) -> torch.Tensor:
    """δ = log π_θ - log μ, with log π_θ from the ordinary forward (full logits) of the weights of that version."""
    probe = copy.deepcopy(model)
    probe.load_state_dict(weights)
    prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
    with torch.no_grad():
        logits = probe(
            input_ids=torch.cat([prompt_ids, completion_ids], 1),
            attention_mask=torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
        ).logits[:, prompt_ids.size(1) - 1 : -1]
    logps = torch.log_softmax(logits.double(), -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    return logps - inputs["sampling_per_token_logps"].double()


@pytest.mark.parametrize("rule", ["paper", "authors_code"])
def test_m2po_training_loss_and_metrics_equal_the_rule_recomputed_from_the_weights(tmp_path, dataset, rule):
    """Four steps of real training with M2PO. For every step, from the weights of that version (plain forward) and the
    generator's μ: the logged loss is the rule's (Algorithm 1 written out token by token; the transcription of the
    authors' code for "authors_code"), and the logged m2po/* figures are its masked fraction and mean δ² before and
    after masking. Weights are published every second step, so steps 1 and 3 train on rows of the previous version."""
    args = make_args(tmp_path, loss_type="m2po", m2po_rule=rule, max_staleness=1, weight_sync_steps=2,
                     trainer_generates_while_starting=False, max_steps=4, learning_rate=1e-3,
                     per_device_train_batch_size=16, num_generations=4)  # fmt: skip
    trainer = _M2PORecordingTrainer(
        model=load_model(), reward_funcs=digit_reward, args=args, train_dataset=dataset,
        processing_class=load_tokenizer(),
    )  # fmt: skip
    probe = load_model()
    trainer.train()
    assert trainer.true_staleness == [0, 1, 0, 1]  # measured from μ, not from the engine's tags
    logged = {h["step"]: h for h in trainer.state.log_history if "m2po/masked_fraction" in h}
    assert [version for version, _, _ in trainer.m2po_calls] == [0, 1, 2, 3] and sorted(logged) == [1, 2, 3, 4]
    acted = 0
    for version, inputs, loss in trainer.m2po_calls:
        delta = _plain_log_ratio(probe, trainer.weights_by_version[version], inputs)
        mask = inputs["completion_mask"].bool()
        advantages = inputs["advantages"].double()
        valid = int(mask.sum())
        if rule == "paper":
            expected_loss = _algorithm_1_loss(delta, torch.zeros_like(delta), advantages, mask, 0.04, valid).item()
            per_token_advantages = advantages.repeat_interleave(mask.size(1)).tolist()
            keep = _algorithm_1_keep(delta.reshape(-1).tolist(), per_token_advantages, mask.reshape(-1).tolist(), 0.04)
            keep = torch.tensor(keep).view_as(mask)
        else:
            rows = [[float(x) for x in row] for row in delta]
            zeros = [[0.0] * mask.size(1) for _ in rows]
            masks, adv_rows = mask.tolist(), advantages.tolist()
            expected_loss = authors_m2po_loss(zeros, rows, adv_rows, masks, 0.04)[0]
            low, high = authors_clip_bounds(zeros, rows, adv_rows, masks, 0.04)
            ratio = delta.exp()
            a = advantages.unsqueeze(1)
            keep = mask & ~(((a > 0) & (ratio > high)) | ((a < 0) & (ratio < low)))
        entry = logged[version + 1]
        assert loss == pytest.approx(expected_loss, rel=1e-4, abs=1e-6), version
        assert entry["loss"] == pytest.approx(loss, rel=1e-6), version  # one micro-batch per step and log
        d2 = delta.square()
        assert entry["m2po/masked_fraction"] == pytest.approx(1 - int(keep.sum()) / valid, abs=1e-9), version
        assert entry["m2po/m2_before"] == pytest.approx(d2[mask].mean().item(), rel=1e-3, abs=1e-9), version
        assert entry["m2po/m2_after"] == pytest.approx(d2[keep].mean().item(), rel=1e-3, abs=1e-9), version
        assert entry["m2po/all_masked_batches"] == 0
        acted += 0 < int(keep.sum()) < valid
    assert acted >= 1, "the rule masked nothing in any step: the test would not see it act"


def test_m2po_on_synchronous_path_without_behaviour_logps_keeps_everything(tmp_path, tokenizer, dataset):
    """TRL's own generation (async off) returns no sampling log-probs and, aligned, no old_per_token_logps: the
    batch is on-policy, the ratio is 1 and nothing is masked."""
    logged = train(tmp_path, tokenizer, dataset, async_generation=False, max_steps=2)
    assert all(entry["m2po/masked_fraction"] == 0.0 for entry in logged)
    assert all(entry["m2po/m2_before"] == 0.0 for entry in logged)


def _algorithm_1_loss(logps, behaviour, advantages, mask, tau, normalizer):
    """Independent re-derivation of the paper's rule and objective, token by token in plain Python.

    Candidates: valid tokens whose ratio moves with the advantage. While the mean δ² over the remaining candidates
    exceeds τ, drop the largest δ² (lower flat index first on ties). J = (1/N) Σ_t M_t r_t A_t, loss = −J."""
    delta = (logps - behaviour).detach()
    rows, width = delta.shape
    candidates = [
        (float(delta[b, t]) ** 2, b * width + t)
        for b in range(rows)
        for t in range(width)
        if mask[b, t] and ((advantages[b] > 0 and delta[b, t] > 0) or (advantages[b] < 0 and delta[b, t] < 0))
    ]
    remaining = sorted(candidates, key=lambda c: (-c[0], c[1]))
    dropped = set()
    while remaining and sum(c[0] for c in remaining) / len(remaining) > tau:
        dropped.add(remaining.pop(0)[1])
    total = 0.0
    for b in range(rows):
        for t in range(width):
            if mask[b, t] and b * width + t not in dropped:
                total = total + torch.exp(logps[b, t] - behaviour[b, t]) * advantages[b]
    return -total / normalizer


@pytest.mark.parametrize(("accumulation", "steps_per_generation"), [(1, 1), (2, 2), (1, 2)])
def test_trainer_m2po_loss_equals_an_independent_computation(
    tmp_path, tokenizer, dataset, accumulation, steps_per_generation
):
    """The trainer's M2PO loss (and its gradients) on one micro-batch, against Algorithm 1 written out by hand with
    TRL dapo's normalizer: the valid tokens of the accumulation window, per process."""
    args = make_args(tmp_path, loss_type="m2po", max_staleness=1, gradient_accumulation_steps=accumulation,
                     steps_per_generation=steps_per_generation)  # fmt: skip
    trainer = AsyncGRPOTrainer(
        model=load_model(), reward_funcs=length_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = accumulation
    inputs, _ = make_batch(tokenizer, trainer.model, seed=3)
    # TRL's num_items_in_batch counts the whole generation batch: `steps_per_generation` micro-batches (of this size).
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum() * steps_per_generation
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    ours = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}

    reference_model = load_model().train()
    mask = inputs["completion_mask"]
    logits = reference_model(
        input_ids=torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
        attention_mask=torch.cat([inputs["prompt_mask"], mask], 1),
    ).logits[:, inputs["prompt_ids"].size(1) - 1 : -1]
    logps = torch.log_softmax(logits.float(), -1).gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
    # TRL dapo's normalizer: each micro-batch's token sum over the token count of the whole accumulation window
    # (here `accumulation` micro-batches of this size), so that the accumulated gradient is the window's mean.
    normalizer = float(mask.sum()) * accumulation
    expected = _algorithm_1_loss(
        logps, inputs["sampling_per_token_logps"], inputs["advantages"], mask, 0.04, normalizer
    )
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    expected.backward()
    for name, p in reference_model.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)
    window = trainer._statistics["train"].local("m2po")
    assert 0 < window[1] < window[0]  # some tokens were masked: the rule really acted on this batch


def test_m2po_rejects_features_it_does_not_implement(tmp_path, tokenizer, dataset):
    with pytest.raises(ValueError, match="off_policy_mask_threshold"):
        AsyncGRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(tiny_model_path()),
            reward_funcs=MathAnswerReward(tokenizer),
            args=AsyncGRPOConfig(
                output_dir=str(tmp_path),
                loss_type="m2po",
                off_policy_mask_threshold=0.5,
                per_device_train_batch_size=8,
                num_generations=4,
                bf16=False,
                report_to="none",
            ),  # fmt: skip
            train_dataset=dataset,
            processing_class=tokenizer,
        )


@pytest.mark.parametrize(
    ("overrides", "field"),
    [({"m2po_threshold": 0.0}, "m2po_threshold"), ({"m2po_threshold": -1.0}, "m2po_threshold"),
     ({"m2po_rule": "aligned"}, "m2po_rule"), ({"m2po_scope": "rank"}, "m2po_scope"),
     ({"m2po_clip_floor_low": 0.3}, "m2po_clip_floor_low"),
     ({"m2po_rule": "authors_code", "m2po_clip_floor_low": 1.5}, "m2po_clip_floor_low"),
     ({"m2po_scope": "global", "gradient_accumulation_steps": 2}, "gradient_accumulation_steps")],
)  # fmt: skip
def test_m2po_config_validation_names_the_field(tmp_path, overrides, field):
    with pytest.raises(ValueError, match=field):
        AsyncGRPOConfig(output_dir=str(tmp_path), loss_type="m2po", bf16=False, report_to="none", **overrides)


# ------------------------------------------------------------------------------------------- global scope, 2 ranks
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


GLOBAL_SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "m2po_global_trainer.py")


def _algorithm_1_keep(deltas: list[float], advantages: list[float], valid: list[bool], tau: float) -> list[bool]:
    """Algorithm 1 of the paper, one token at a time, on a flat list of tokens: among the trust-region tokens (valid,
    the ratio moving with the advantage) drop the one with the largest δ² (the lower index first on ties) while the
    mean δ² over the trust-region tokens left exceeds τ. Every other valid token is kept."""
    candidates = [
        (d * d, i) for i, (d, a, v) in enumerate(zip(deltas, advantages, valid, strict=True))
        if v and ((a > 0 and d > 0) or (a < 0 and d < 0))
    ]  # fmt: skip
    remaining = sorted(candidates, key=lambda c: (-c[0], c[1]))
    dropped = set()
    while remaining and sum(c[0] for c in remaining) / len(remaining) > tau:
        dropped.add(remaining.pop(0)[1])
    return [v and i not in dropped for i, v in enumerate(valid)]


def _flat(step: dict, key: str) -> list:
    return step[key].reshape(-1).tolist()


@pytest.mark.slow
def test_global_scope_in_a_two_process_training_step_masks_as_algorithm_1_over_both_ranks(tmp_path):
    """m2po_scope="global" in real training steps on two ranks (`accelerate launch`, gloo): at every step, the mask the
    trainer applied on each rank is Algorithm 1 over the tokens of BOTH ranks (rank 0's first, each row-major), and
    the loss each rank computed is M2PO's objective under that mask. δ is the trainer's, checked against a plain
    forward. The settings make it matter: stale steps mask some tokens but not all, and selecting per rank would have
    given another mask."""
    launcher = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(_free_port()),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "1"}
    steps, threshold = 6, 0.02
    proc = subprocess.run(
        [*launcher, GLOBAL_SCRIPT, str(tmp_path), str(steps), "2e-3", str(threshold)],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [torch.load(tmp_path / f"rank{k}.pt", weights_only=False) for k in range(2)]
    assert [r["process_index"] for r in ranks] == [0, 1] and all(r["backend"] == "gloo" for r in ranks)
    assert [s["version"] for s in ranks[0]["steps"]] == [s["version"] for s in ranks[1]["steps"]] == list(range(steps))
    masked_steps = differs_from_per_rank = 0
    for parts in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True):
        for part in parts:
            assert part["rule"] == "paper" and part["threshold"] == threshold
            valid = part["completion_mask"]
            assert torch.equal(part["mask"], valid)
            # The δ the selection was given is log π_θ - log μ of the loss's forward.
            torch.testing.assert_close(part["log_ratio"][valid], part["plain_log_ratio"][valid], atol=1e-4, rtol=0)
            advantages = part["advantages_given"].unsqueeze(1).expand_as(valid)
            assert torch.equal(part["advantages"], advantages)
        deltas = [d for part in parts for d in _flat(part, "log_ratio")]
        advantages = [a for part in parts for a in _flat(part, "advantages")]
        valid = [v for part in parts for v in _flat(part, "completion_mask")]
        expected = _algorithm_1_keep(deltas, advantages, valid, threshold)
        sizes = [part["mask"].numel() for part in parts]
        expected_parts = [expected[: sizes[0]], expected[sizes[0] :]]
        normalizer = sum(valid) / 2  # TRL dapo's: the valid tokens of both ranks, per process
        for part, keep in zip(parts, expected_parts, strict=True):
            assert _flat(part, "keep") == keep, part["version"]
            # The loss applied that mask: -(1/N) Σ_kept exp(δ) A.
            objective = sum(
                math.exp(d) * a
                for d, a, k in zip(_flat(part, "log_ratio"), _flat(part, "advantages"), keep, strict=True)
                if k
            )
            assert part["loss"] == pytest.approx(-objective / normalizer, rel=1e-4, abs=1e-6), part["version"]
            per_rank = _algorithm_1_keep(
                _flat(part, "log_ratio"), _flat(part, "advantages"), _flat(part, "completion_mask"), threshold
            )
            differs_from_per_rank += per_rank != keep
        kept, total = sum(expected), sum(valid)
        masked_steps += 0 < kept < total
    # The stale steps (1, 3 and 5: generated by the previous version) masked some tokens but not all.
    assert masked_steps == 3, "the selection was not exercised on every stale step"
    assert differs_from_per_rank >= 1, "per-rank selection would have given the same masks: the scope was not tested"
