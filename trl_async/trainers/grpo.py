"""`AsyncGRPOTrainer`: TRL's `GRPOTrainer` with generation in a background process and the M2PO loss.

The engine's side (generation process, queue, weights, the hooks that serve rollout rows to TRL's scoring code) is
`trainers.engine.AsyncRolloutMixin`. What GRPO adds, and where:

* `_prepare_args`: a plain `trl.GRPOConfig` gets the async defaults (`config.ensure_async_fields`);
  `use_vllm=True` runs vLLM in the generation process.
* `_compute_loss`: adds `loss_type="m2po"` (`algorithms.m2po`); every other loss type is TRL's, with the correction
  against μ (`trainers.correction`: TRL's truncated importance weight π_old/μ for rows that can be stale). Within one
  optimizer step π_old is the loss's own forward, and the correction is applied between that forward and TRL's
  reading of the advantages (the hook slot); a batch used across several steps has TRL's `old_per_token_logps`, and
  `_after_scoring` corrects it at batch time.

Evaluation (`model.eval()`) and `async_generation=False` run TRL's synchronous path.
"""

from __future__ import annotations

import logging

import torch
from trl import GRPOConfig, GRPOTrainer

from .. import trl_contract
from ..algorithms.m2po import m2po_loss
from ..config import LOSS_TYPES, ensure_async_fields
from ..config.refusals import check_m2po_supported
from .batch import rollout_view
from .correction import apply_to_trl_batch
from .engine import AsyncRolloutMixin

logger = logging.getLogger(__name__)


class AsyncGRPOTrainer(AsyncRolloutMixin, GRPOTrainer):
    """Drop-in replacement for `trl.GRPOTrainer` that generates asynchronously and supports `loss_type="m2po"`.

    It takes exactly `GRPOTrainer`'s arguments. `args` may be a plain `trl.GRPOConfig` (the async defaults of
    `AsyncGRPOConfig` then apply) or an `AsyncGRPOConfig`.
    """

    _tag_names = ["trl", "grpo", "trl-async"]
    model_card_kind = "grpo"  # the card: trl_async.hub.ModelCardMixin

    def _prepare_args(self, bound):
        """TRL's default `GRPOConfig` when none is given; the async fields filled in and validated."""
        args, model = bound.arguments.get("args"), bound.arguments["model"]
        if args is None:  # TRL's default, created here so that the async checks see it
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = GRPOConfig(f"{str(name).split('/')[-1]}-GRPO")
        ensure_async_fields(args, loss_types=LOSS_TYPES)
        check_m2po_supported(args, model)
        if args.async_generation and args.use_vllm:
            # TRL's vLLM generation runs in the training process; ours runs in the generation process. Same knobs.
            logger.info("trl_async: use_vllm=True runs vLLM in the generation process (generation_backend='vllm').")
            args.generation_backend, args.use_vllm = "vllm", False
        return args

    def _after_scoring(self, output: dict, rewards_per_func) -> dict:
        """A rollout batch used across optimizer steps: TRL computed π_old at batch time (`old_per_token_logps`), so the
        correction against μ (`trainers.correction`) is applied now, once for every use of the batch."""
        if self._async_training() and trl_contract.computes_old_logps(self.args):
            old_logps = output["old_per_token_logps"]
            output = apply_to_trl_batch(output, self._behaviour_correction(output, old_logps), self.loss_type)
        return output

    def _compute_loss(self, model, inputs):
        """Replaces `GRPOTrainer._compute_loss`: adds `loss_type="m2po"`. Every other loss type is TRL's. A rollout
        batch used within one optimizer step has π_old = this call's own policy forward, so its correction against μ
        is applied between that forward and TRL's reading of the advantages (`HookSlot.correct_at_forward`,
        `trl_contract.CALL_ORDER`), on a copy: TRL's buffer keeps the batch uncorrected."""
        self._record_row_ages(inputs)
        if self.loss_type == "m2po":
            return self._compute_m2po_loss(model, inputs)
        if not self._async_training() or trl_contract.computes_old_logps(self.args):
            return super()._compute_loss(model, inputs)
        with self._hand_off(correct_at_forward=dict(inputs)) as slot:
            return super()._compute_loss(model, slot.correct_at_forward)

    # --------------------------------------------------------------------------------------------- M2PO
    def _compute_m2po_loss(self, model, inputs):
        """M2PO (Zheng et al. 2025, arXiv 2510.01161), the math in `algorithms.m2po`.

        δ_t = log π_θ − log μ against the behaviour policy μ: the sampling log-probs of rollout rows (an asynchronous
        training step), else TRL's `old_per_token_logps` where TRL computes them, else π_θ itself (an on-policy batch:
        δ = 0, nothing masked). The
        normalizer is TRL `dapo`'s: valid tokens of the whole accumulated batch, per process.
        """
        mode = "train" if self.model.training else "eval"
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = self._loss_mask(inputs)
        per_token_logps, entropies, _ = self._get_per_token_logps_and_entropies(
            model,
            torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([prompt_mask, completion_mask], dim=1),
            completion_ids.size(1),
            compute_entropy=True,
        )
        rollout = self._async_training()
        if rollout:
            behaviour = rollout_view(inputs)["sampling_per_token_logps"]
        elif trl_contract.computes_old_logps(self.args):  # TRL's π_old, when a batch spans optimizer steps
            behaviour = inputs["old_per_token_logps"]
        else:
            behaviour = per_token_logps.detach()
        advantages = inputs["advantages"]
        normalizer = self._dapo_normalizer(inputs, mode)
        delta = per_token_logps.detach() - behaviour
        selection = self._m2po_selection(delta, mask, advantages, mode, record_offpolicy=rollout)
        loss, stats = m2po_loss(
            per_token_logps, behaviour, advantages, mask, normalizer=normalizer, selection=selection
        )
        if self.beta != 0.0:
            ref = inputs["ref_per_token_logps"]
            per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
            loss = loss + self.beta * (per_token_kl * mask).sum() / normalizer
            self._record_token_mean(mode, "kl", per_token_kl, mask)
        self._record_token_mean(mode, "entropy", entropies, mask)
        self._record_m2po_stats(mode, stats)
        return loss
