"""The importance correction against the behaviour policy μ, inside the trainer, for every TRL loss type.

Reference: TRL's own `_compute_loss` on its vLLM path (`use_vllm` with `vllm_importance_sampling_correction`), fed an
`importance_sampling_ratio` computed here, independently, from π_old (a separate no-grad forward) and μ. Ours computes
the weight from TRL's own forward inside `_compute_loss` (no extra forward) or from TRL's `old_per_token_logps` when
the batch spans several optimizer steps, and folds it into the advantages (VESPO: into φ, as TRL does).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from trl import GRPOTrainer

from tests.support.references import reference_weights
from tests.support.trainer_utils import (
    WeightTracingTrainer,
    length_reward,
    load_model,
    load_tokenizer,
    make_args,
    make_batch,
)
from trl_async import AsyncGRPOTrainer
from trl_async.config import TRL_LOSS_TYPES
from trl_async.toy import make_arithmetic_dataset


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def dataset():
    return make_arithmetic_dataset(num_train=64, num_test=8, seed=1)["train"]


def _trainers(tmp_path, dataset, tokenizer, **overrides):
    model = load_model()
    args = make_args(tmp_path, max_staleness=1, **overrides)
    ours = AsyncGRPOTrainer(
        model=model, reward_funcs=length_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    theirs = GRPOTrainer(
        model=copy.deepcopy(model), reward_funcs=length_reward, args=make_args(tmp_path, **overrides),
        train_dataset=dataset, processing_class=tokenizer,
    )  # fmt: skip
    for trainer in (ours, theirs):
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
    return ours, theirs


def _loss_and_grads(trainer, compute, inputs):
    trainer.model.zero_grad()
    loss = compute(trainer.model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def _trl_with_ratio(theirs, inputs, old_logps, mode, clip_min, clip_max):
    """TRL's loss on its vLLM path: per-token loss times the truncated ratio π_old/μ (VESPO: inside φ)."""
    reference = {k: v for k, v in inputs.items() if k not in ("rollout_versions", "rollout_token_versions")}
    reference["importance_sampling_ratio"] = reference_weights(
        old_logps.double(), inputs["sampling_per_token_logps"].double(), inputs["completion_mask"], mode, clip_min,
        clip_max,
    ).float()  # fmt: skip
    theirs.use_vllm = True  # only `_compute_loss` reads it here; nothing is generated
    try:
        return _loss_and_grads(theirs, lambda m, x: GRPOTrainer._compute_loss(theirs, m, x), reference)
    finally:
        theirs.use_vllm = False


@pytest.mark.parametrize("loss_type", TRL_LOSS_TYPES)
@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask", "token_mask"])
def test_correction_from_trls_own_forward_equals_trls_formula(tmp_path, dataset, tokenizer, loss_type, mode):
    clip = dict(vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0)
    ours, theirs = _trainers(
        tmp_path, dataset, tokenizer, loss_type=loss_type, vllm_importance_sampling_mode=mode, **clip
    )
    inputs, policy = make_batch(tokenizer, ours.model)
    loss_ours, grads_ours = _loss_and_grads(ours, ours._compute_loss, inputs)
    loss_ref, grads_ref = _trl_with_ratio(theirs, inputs, policy, mode, 0.5, 2.0)
    assert math.isfinite(loss_ours.item())
    torch.testing.assert_close(loss_ours, loss_ref, rtol=1e-5, atol=1e-6)
    assert grads_ours.keys() == grads_ref.keys()
    for name in grads_ref:
        torch.testing.assert_close(grads_ours[name], grads_ref[name], rtol=1e-4, atol=1e-5, msg=name)
    # The correction really acts: without it the loss differs (μ is 0.3 nats off per token here).
    uncorrected = {k: v for k, v in inputs.items() if k not in ("rollout_versions", "rollout_token_versions")}
    plain, _ = _loss_and_grads(theirs, lambda m, x: GRPOTrainer._compute_loss(theirs, m, x), uncorrected)
    assert not torch.allclose(plain, loss_ref, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("loss_type", ["dapo", "vespo", "cispo"])
def test_correction_from_old_logps_when_a_batch_spans_steps(tmp_path, dataset, tokenizer, loss_type):
    """With TRL's `old_per_token_logps` in the batch (computed by TRL when a batch is trained on across several
    optimizer steps), the weight π_old/μ uses them, not the current forward."""
    # Two optimizer steps per generation batch: TRL computes π_old at batch time (`trl_contract.computes_old_logps`).
    ours, theirs = _trainers(tmp_path, dataset, tokenizer, loss_type=loss_type, steps_per_generation=2)
    inputs, policy = make_batch(tokenizer, ours.model, seed=1)
    old = policy + 0.05 * torch.randn(policy.shape, generator=torch.Generator().manual_seed(5))
    inputs["old_per_token_logps"] = old
    corrected = ours._after_scoring(dict(inputs), None)  # what `_generate_and_score_completions` does
    loss_ours, grads_ours = _loss_and_grads(ours, ours._compute_loss, corrected)
    loss_ref, grads_ref = _trl_with_ratio(theirs, inputs, old, "sequence_mask", None, 3.0)
    torch.testing.assert_close(loss_ours, loss_ref, rtol=1e-5, atol=1e-6)
    for name in grads_ref:
        torch.testing.assert_close(grads_ours[name], grads_ref[name], rtol=1e-4, atol=1e-5, msg=name)


def test_a_default_async_dapo_step_runs_as_many_forwards_as_trls_step(tmp_path, dataset, tokenizer):
    """TRL's synchronous dapo step runs one training forward per micro-step (no old-log-prob forward when the batch is
    used within one step). The async step, correcting towards μ, must not add one."""
    counts = {}
    for name, cls, overrides in [
        ("trl", GRPOTrainer, {}),
        ("async", AsyncGRPOTrainer, dict(max_staleness=1, trainer_generates_while_starting=False)),
    ]:
        model = load_model()
        config_cls = type(make_args(tmp_path))
        if cls is GRPOTrainer:
            from trl import GRPOConfig

            config_cls = GRPOConfig
        trainer = cls(
            model=model, reward_funcs=length_reward, args=make_args(tmp_path / name, config_cls, max_steps=3,
            **overrides), train_dataset=dataset, processing_class=tokenizer,
        )  # fmt: skip
        calls = {"forward": 0, "generating": False}
        if name == "trl":  # TRL generates in this process: its generate's forwards are not training forwards. The
            # async trainer generates in its generation process only (`trainer_generates_while_starting=False`), and
            # refuses a generate replaced on the instance.
            original_generate = model.generate

            def generate(*args, _original=original_generate, _calls=calls, **kwargs):
                _calls["generating"] = True
                try:
                    return _original(*args, **kwargs)
                finally:
                    _calls["generating"] = False

            model.generate = generate
        model.register_forward_hook(
            lambda *a, _calls=calls: _calls.__setitem__("forward", _calls["forward"] + (not _calls["generating"]))
        )
        trainer.train()
        counts[name] = calls["forward"]
        if name == "async":
            ratios = [h for h in trainer.state.log_history if "sampling/importance_sampling_ratio/mean" in h]
            assert ratios, "the importance correction did not run"
    assert counts["trl"] == 3
    assert counts["async"] == counts["trl"]


def test_sampling_warpers_leave_the_weight_at_one_at_staleness_zero(tmp_path, dataset, tokenizer):
    """TRL's `test_train_with_additional_generation_kwargs`, swapped: with top-k/top-p/min-p/repetition penalty,
    π_θ over the processed μ was ~1e-33 per sequence even at staleness 0, and nothing trained. The weight compares the
    trainer's parametrization of both policies, so a batch used by the weights that made it weighs exactly 1."""
    model = load_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = make_args(
        tmp_path, max_steps=4, max_staleness=1, top_k=10, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
        vllm_importance_sampling_mode="sequence_mask", learning_rate=1e-2,
    )  # fmt: skip
    trainer = WeightTracingTrainer(
        model=model, reward_funcs=length_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.train()
    # Steps whose batch was generated by the weights that trained on it, found from μ (not from the engine's tags).
    fresh_steps = {v + 1 for v, s in zip(trainer.loss_versions, trainer.true_staleness, strict=True) if s == 0}
    fresh = [h for h in trainer.state.log_history if h.get("step") in fresh_steps and "loss" in h]
    assert fresh, "no batch was used at staleness 0"
    for entry in fresh:
        for stat in ("min", "max"):
            assert entry[f"sampling/importance_sampling_ratio/{stat}"] == pytest.approx(1.0, abs=1e-3), entry
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
