"""`AsyncPPOTrainer`: PPO with a learned critic and GAE, on the rollout engine (`trainers.engine.AsyncRolloutMixin`).

PPO differs from GRPO in where the advantages come from and in the loss; the rollout engine (generation process,
queue, weights, prompt stream, `async/*` and `offpolicy/*` metrics, checkpoint state) and TRL's own scoring, reference
log-probs and batch splitting are shared. What PPO adds (math: docs/ppo.md, `algorithms.ppo`):

* `_after_scoring`: on the rows TRL scored, replaces GRPO's group advantages by PPO's per-token ones. The sequence
  score is the weighted sum of TRL's reward matrix (minus `missing_eos_penalty`); the per-token reward is
  -kl_coef·KL(π_old ‖ π_ref) plus the score on the last token; the critic's values at batch time give GAE advantages
  and returns. π_old is the policy when the batch enters training, the reference is TRL's (`beta = kl_coef`).
* `_compute_loss`: PPO-clip (or M2PO) on the per-token advantages, with the truncated importance weight π_old/μ for
  stale rows (computed once per batch by `trainers.correction`, in `_after_scoring`), plus `vf_coef` times the
  clipped value loss.
* The critic (`trainers.critic`): the optimizer covers it (`create_optimizer`), checkpoints save and restore it
  (`save_model`, `_load_from_checkpoint`), its gradients are all-reduced once per optimizer step (`training_step`).

`num_iterations` is PPO's number of epochs over a rollout batch and `steps_per_generation` its number of mini-batches:
advantages, returns, π_old and the old values are computed once per generation batch, as in PPO.
"""

from __future__ import annotations

import contextlib
import os
import textwrap

import torch
from accelerate.utils import is_peft_model
from torch import Tensor, nn
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import disable_dropout_in_model

from .. import trl_contract
from ..algorithms.m2po import m2po_loss
from ..algorithms.ppo import PPO_TARGET_KNOBS, PPOTargets, per_token_kl, ppo_policy_loss, ppo_targets, value_loss
from ..config import PPO_LOSS_TYPES, AsyncPPOConfig, ensure_async_fields
from ..config.refusals import check_agentic_trainer
from .batch import rollout_view
from .critic import CRITIC_FILE, AdapterValueModel, CriticGradients, PerTokenValueModel, build_critic
from .engine import AsyncRolloutMixin
from .statistics import Field


class AsyncPPOTrainer(AsyncRolloutMixin, GRPOTrainer):
    """PPO with a learned critic and GAE on the asynchronous engine (or synchronously, `async_generation=False`).

    Takes TRL `GRPOTrainer`'s arguments with an `AsyncPPOConfig`, plus `value_model`: a sequence-classification model
    with `num_labels=1` or a path to build one from (a causal-LM checkpoint gets a new value head on its base).
    Default: built from the policy's own checkpoint; under PEFT (`peft_config`, or a `PeftModel`), a second adapter on
    the policy's base plus a value head instead.
    """

    _tag_names = ["trl", "ppo", "trl-async"]
    model_card_kind = "ppo"  # the card: trl_async.hub.ModelCardMixin
    _name = "PPO"
    _paper = {
        "title": "Proximal Policy Optimization Algorithms",
        "id": "1707.06347",
        # docstyle-ignore
        "citation": textwrap.dedent("""\
            @article{schulman2017proximal,
                title        = {{Proximal Policy Optimization Algorithms}},
                author       = {John Schulman and Filip Wolski and Prafulla Dhariwal and Alec Radford and Oleg Klimov},
                year         = 2017,
                eprint       = {arXiv:1707.06347},
            }"""),
    }

    def __init__(self, model, reward_funcs=None, args=None, *positional, value_model=None, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = AsyncPPOConfig(f"{str(name).split('/')[-1]}-PPO")
        if not isinstance(args, AsyncPPOConfig):
            raise TypeError(
                f"AsyncPPOTrainer needs an AsyncPPOConfig (its PPO knobs: vf_coef, cliprange, gamma, lam, kl_coef, ...),"
                f" got {type(args).__name__}."
            )
        given = trl_contract.bind_init(model, reward_funcs, args, *positional, **kwargs).arguments
        check_agentic_trainer(
            type(self).__name__, given.get("tools"), given.get("environment_factory"), given.get("rollout_func")
        )
        peft = given.get("peft_config") is not None or (not isinstance(model, str) and is_peft_model(model))
        if value_model is None and peft:
            # The critic adapter sits in the policy's DDP module but is used outside its forward: DDP must not look
            # for unused parameters (it would mark the adapter ready before its gradients arrive). Set before
            # Trainer builds its accelerator, which reads it.
            if args.ddp_find_unused_parameters:
                raise ValueError(
                    "ddp_find_unused_parameters=True cannot be used with the PEFT critic adapter (it is used outside "
                    "the policy's forward). Leave it unset, or pass a separate value_model."
                )
            args.ddp_find_unused_parameters = False
        super().__init__(model, reward_funcs, args, *positional, **kwargs)
        critic = build_critic(self._unwrap(self.model), value_model, self.args, self._tokenizer.pad_token_id)
        if self.args.disable_dropout:
            disable_dropout_in_model(critic)
        # Several processes: a DDP wrapper, whose gradients are all-reduced once per optimizer step (`training_step`).
        self.critic = self.accelerator.prepare_model(critic)
        self.add_callback(CriticGradients(self))
        if self.optimizer is not None:  # optimizers=(optimizer, scheduler) given: it must train the critic too
            held = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
            if any(id(p) not in held for p in self._critic_parameters()):
                raise ValueError(
                    "The optimizer passed in `optimizers` does not hold the critic's parameters, and its scheduler "
                    "could not follow parameter groups added later. Leave `optimizers` unset and choose the optimizer "
                    "in the config (optim, optim_args, learning_rate, critic_learning_rate), or pass a value_model and "
                    "an optimizer over both models."
                )

    def _prepare_args(self, bound):
        """The `AsyncPPOConfig` (`__init__` checked its type), its async fields checked against PPO's loss types."""
        return ensure_async_fields(bound.arguments["args"], PPO_LOSS_TYPES)

    # --------------------------------------------------------------------------------------------- critic
    @property
    def critic_model(self) -> PerTokenValueModel | AdapterValueModel:
        """The critic without its DDP wrapper."""
        return self._unwrap(self.critic)

    def _critic_parameters(self) -> list[nn.Parameter]:
        """Every trainable parameter of the critic: its own, and a PEFT critic adapter's (which lives in the policy)."""
        critic = self.critic_model
        own = [p for p in critic.parameters() if p.requires_grad]
        if isinstance(critic, AdapterValueModel):
            own += [p for _, p in critic.adapter_parameters()]
        return own

    def _critic_values(self, critic: nn.Module, input_ids, attention_mask, logits_to_keep: int, batch_size=None):
        """V(s_t) for the `logits_to_keep` completion tokens, (B, T) float32: the critic at positions P-1 … P+T-2,
        the states before each token, read where the policy's logits give its log-prob (docs/ppo.md)."""
        batch_size = batch_size or input_ids.size(0)
        chunks = []
        for start in range(0, input_ids.size(0), batch_size):
            end = start + batch_size
            with self.accelerator.autocast():
                values = critic(input_ids[start:end], attention_mask[start:end])
            chunks.append(values[:, values.size(1) - logits_to_keep - 1 : values.size(1) - 1].float())
        return torch.cat(chunks, dim=0)

    # --------------------------------------------------------------------------------------------- rollout batch
    def _after_scoring(self, output: dict, rewards_per_func: Tensor) -> dict:
        """Replaces GRPO's group advantages in TRL's batch dict by PPO's, computed from the reward matrix TRL gathered
        (`rewards_per_func`) on the same rows. Adds `advantages` (B, T), `returns`, `old_values` (the critic now),
        `old_per_token_logps` (π_old: the policy now), `loss_mask` (valid tokens of scorable rows) and
        `importance_weights` (the truncated weight π_old/μ PPO-clip multiplies by, (B, T) or (B, 1); 1 where no
        correction applies)."""
        critic = self.critic_model
        critic.restore_trainable()  # TRL's reference pass disables and re-enables the adapters (PEFT)
        mode = "train" if self.model.training else "eval"
        completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
        rows = completion_ids.size(0)
        local = slice(self.accelerator.process_index * rows, (self.accelerator.process_index + 1) * rows)
        scores, scorable = self._sequence_scores(rewards_per_func[local], completion_ids, completion_mask)
        mask = completion_mask.bool() & scorable.unsqueeze(1)
        input_ids = torch.cat([output["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            if trl_contract.computes_old_logps(self.args):  # TRL computed π_old (the batch spans optimizer steps)
                old_logps = output["old_per_token_logps"]
            else:  # PPO's reward and its ratio need it anyway
                old_logps, _, _ = self._get_per_token_logps_and_entropies(
                    self.model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
                )
            old_values = self._critic_values(critic, input_ids, attention_mask, logits_to_keep, batch_size)
        ref_logps = output.pop("ref_per_token_logps", None)  # present iff beta = kl_coef != 0
        args = self.args
        targets = ppo_targets(
            scores,
            old_logps,
            old_logps if ref_logps is None else ref_logps,
            old_values,
            mask,
            **{knob: getattr(args, knob) for knob in PPO_TARGET_KNOBS},
        )
        output.update(
            advantages=targets.advantages,
            returns=targets.returns,
            old_values=old_values,
            old_per_token_logps=old_logps,
            loss_mask=mask,
        )
        self._record_rollout_metrics(mode, scores, scorable, targets, old_values, mask)
        # The correction against μ, once per batch: π_old is fixed for all its uses (`trainers.correction`). M2PO
        # treats δ against π_θ in the loss instead.
        weights = None
        if self._async_training() and self.loss_type != "m2po":
            weights = self._behaviour_correction(output, old_logps, mask=mask).weights
        output["importance_weights"] = torch.ones(rows, 1, device=mask.device) if weights is None else weights
        return output

    def _sequence_scores(self, rewards_per_func: Tensor, completion_ids: Tensor, completion_mask: Tensor):
        """(scores (B,), scorable (B,) bool): the reward functions' weighted sum, as TRL sums them for GRPO, minus
        `missing_eos_penalty` for completions without an EOS. A row every function returned None for is unscorable
        (TRL gives it no advantage; here it leaves the loss)."""
        scorable = ~torch.isnan(rewards_per_func).all(dim=1)
        scores = (rewards_per_func * self.reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
        if self.args.missing_eos_penalty is not None:
            eos = torch.tensor(self.eos_token_ids, device=completion_ids.device)
            has_eos = (torch.isin(completion_ids, eos) & completion_mask.bool()).any(dim=1)
            scores = scores - self.args.missing_eos_penalty * (~has_eos).to(scores.dtype)
        return torch.where(scorable, scores, torch.zeros_like(scores)), scorable

    def _record_rollout_metrics(self, mode, scores, scorable, targets: PPOTargets, old_values, mask) -> None:
        """The sums behind the rollout metrics of the logging window, over every rank (`_log_statistics`): explained
        variance of the returns by the critic's values at batch time, EV = 1 - Var[R - V] / Var[R] (biased variances
        over the window's valid tokens, `algorithms.ppo`), the means of returns and values, TRL's former
        `objective/kl` (Σ_t KL per row) and `objective/scores`."""
        m = mask.double()
        returns, values = targets.returns.double(), old_values.double()
        residual = returns - values
        local = torch.stack(
            [
                m.sum(),
                (returns * m).sum(),
                (returns.square() * m).sum(),
                (residual * m).sum(),
                (residual.square() * m).sum(),
                (values * m).sum(),
                (targets.kl.double() * m).sum(),
                scorable.double().sum(),
                scores.double().sum(),
            ]
        )
        self._statistics[mode].add("ppo_rollout", local)

    def _log_statistics(self, mode: str, totals: dict[str, Tensor]) -> None:
        """The engine's metrics, plus PPO's over the logging window (`_record_rollout_metrics`, `_record_loss_metrics`)."""
        super()._log_statistics(mode, totals)
        metrics = self._metrics[mode]
        n, r1, r2, d1, d2, v1, kl, rows, score_sum = totals["ppo_rollout"].tolist()
        if n or rows:
            tokens, rows = max(n, 1.0), max(rows, 1.0)
            var_returns = r2 / tokens - (r1 / tokens) ** 2
            var_residual = d2 / tokens - (d1 / tokens) ** 2
            ev = 1.0 - var_residual / var_returns if var_returns > 0 else float("nan")
            metrics["ppo/explained_variance"] = [ev]
            metrics["ppo/returns_mean"] = [r1 / tokens]
            metrics["ppo/value_mean"] = [v1 / tokens]
            metrics["objective/kl"] = [kl / rows]
            metrics["objective/scores"] = [score_sum / rows]
        loss_totals = totals["ppo_loss"].tolist()
        if loss_totals[0]:
            for key, value in zip(_PPO_LOSS_METRICS, loss_totals[1:], strict=True):
                metrics[key] = [value / loss_totals[0]]

    def _statistics_fields(self) -> list[Field]:
        return [*super()._statistics_fields(), Field("ppo_rollout", 9), Field("ppo_loss", 1 + len(_PPO_LOSS_METRICS))]

    # --------------------------------------------------------------------------------------------- loss
    def _compute_loss(self, model, inputs):
        """Replaces `GRPOTrainer._compute_loss`: PPO's loss on the per-token advantages,

            loss = L_π + vf_coef · L_V,

        L_π PPO-clip on ρ = π_θ/π_old (weighted by π_old/μ for stale rows) or M2PO against μ, L_V the clipped value
        loss against the returns, both normalised as TRL's `dapo` (`_dapo_normalizer`)."""
        args, mode = self.args, "train" if self.model.training else "eval"
        completion_ids = inputs["completion_ids"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logits_to_keep = completion_ids.size(1)
        mask = inputs["loss_mask"]
        self._record_row_ages(inputs)
        per_token_logps, entropies, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, compute_entropy=True
        )
        values = self._critic_values(self.critic, input_ids, attention_mask, logits_to_keep)
        normalizer = self._dapo_normalizer(inputs, mode)
        if self.loss_type == "m2po":
            policy_loss, clipfrac, approx_kl = self._m2po_policy_loss(inputs, per_token_logps, mask, normalizer, mode)
        else:
            policy = ppo_policy_loss(
                per_token_logps,
                inputs["old_per_token_logps"],
                inputs["advantages"],
                mask,
                args.cliprange,
                importance_weights=inputs["importance_weights"],
                normalizer=normalizer,
            )
            policy_loss, clipfrac, approx_kl = policy.loss, policy.clipfrac, policy.approx_kl
        critic = value_loss(values, inputs["old_values"], inputs["returns"], mask, args.cliprange_value, normalizer)
        tokens = mask.sum().clamp(min=1)
        self._record_loss_metrics(
            mode,
            mask,
            {
                "ppo/policy_loss": policy_loss.detach() * normalizer / tokens,
                "ppo/value_loss": critic.loss.detach() * normalizer / tokens,
                "ppo/clipfrac": clipfrac,
                "ppo/approx_kl": approx_kl,
                "ppo/value_clipfrac": critic.clipfrac,
                "entropy": (entropies.detach() * mask).sum() / tokens,
            },
        )
        return policy_loss + args.vf_coef * critic.loss

    def _m2po_policy_loss(self, inputs: dict, per_token_logps: Tensor, mask: Tensor, normalizer, mode: str):
        """M2PO against μ (π_old where the rows carry no μ), with PPO's clip fraction and approximate KL against π_old
        logged for comparison: (loss, clipfrac, approx_kl)."""
        args, old_logps = self.args, inputs["old_per_token_logps"]
        rollout = self._async_training()
        behaviour = rollout_view(inputs)["sampling_per_token_logps"] if rollout else old_logps
        delta = per_token_logps.detach() - behaviour
        record = rollout
        selection = self._m2po_selection(delta, mask, inputs["advantages"], mode, record_offpolicy=record)
        loss, stats = m2po_loss(
            per_token_logps, behaviour, inputs["advantages"], mask, normalizer=normalizer, selection=selection
        )
        self._record_m2po_stats(mode, stats)  # `m2po/*`, token-weighted over the logging window, as in GRPO
        ratio = torch.exp(per_token_logps.detach() - old_logps)
        tokens = mask.sum().clamp(min=1)
        clipfrac = (((ratio < 1 - args.cliprange) | (ratio > 1 + args.cliprange)) & mask).float().sum() / tokens
        approx_kl = per_token_kl(old_logps, per_token_logps.detach(), mask, "k3").sum() / tokens
        return loss, clipfrac, approx_kl

    def _record_loss_metrics(self, mode: str, mask: Tensor, means: dict[str, Tensor]) -> None:
        """Per micro-batch means over its valid tokens (`_PPO_LOSS_METRICS`, in order), token-weighted over the
        window and every rank when logged."""
        count = mask.sum().double()
        values = [means[key].double() * count for key in _PPO_LOSS_METRICS]
        self._statistics[mode].add("ppo_loss", torch.stack([count, *values]))

    # --------------------------------------------------------------------------------------------- optimizer
    def create_optimizer(self, model=None):
        """`Trainer.create_optimizer` for the policy, plus the critic's parameters as two more groups (with and without
        weight decay, as Trainer splits them), at `critic_learning_rate` when set. A PEFT critic adapter lives in the
        policy model: it is kept out of the policy's groups and put in the critic's."""
        critic_parameters = self._critic_parameters()
        flags = [(p, p.requires_grad) for p in critic_parameters]
        for parameter in critic_parameters:
            parameter.requires_grad_(False)
        try:
            optimizer = super().create_optimizer(model)
        finally:
            for parameter, flag in flags:
                parameter.requires_grad_(flag)
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        critic = self.critic_model
        named = [(n, p) for n, p in critic.named_parameters() if p.requires_grad]
        decay = set(self.get_decay_parameter_names(critic))
        if isinstance(critic, AdapterValueModel):
            named += critic.adapter_parameters()
            decay |= {n for n, _ in critic.adapter_parameters()}  # LoRA weights decay, as Trainer treats them
        extra = {} if self.args.critic_learning_rate is None else {"lr": self.args.critic_learning_rate}
        for with_decay, weight_decay in ((True, self.args.weight_decay), (False, 0.0)):
            params = [p for n, p in named if (n in decay) == with_decay and id(p) not in held]
            if params:
                optimizer.add_param_group({"params": params, "weight_decay": weight_decay, **extra})
        return optimizer

    def training_step(self, model, inputs, num_items_in_batch):
        """`GRPOTrainer.training_step`, inside the critic's `no_sync` on micro-steps that do not end an optimizer step:
        Trainer does the same for the policy, so the critic's gradients are all-reduced once per optimizer step."""
        sync = self.accelerator.sync_gradients
        with contextlib.nullcontext() if sync else self.accelerator.no_sync(self.critic):
            return super().training_step(model, inputs, num_items_in_batch)

    # --------------------------------------------------------------------------------------------- checkpoints
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`Trainer.save_model` (the policy), plus the critic in `trl_async_critic.safetensors` beside it. Checkpoints
        save through here, so every checkpoint holds the critic; the optimizer's state for it is in Trainer's
        `optimizer.pt` with the policy's."""
        super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            from safetensors.torch import save_file

            folder = output_dir or self.args.output_dir
            os.makedirs(folder, exist_ok=True)
            tensors = {k: v.detach().cpu().contiguous() for k, v in self.critic_model.checkpoint_tensors().items()}
            save_file(tensors, os.path.join(folder, CRITIC_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """`Trainer._load_from_checkpoint` (the policy), plus the critic, copied into its existing parameters."""
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        path = os.path.join(resume_from_checkpoint, CRITIC_FILE)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"{resume_from_checkpoint} has no {CRITIC_FILE}: it was not written by AsyncPPOTrainer, so the critic "
                "cannot be restored. Resume from a checkpoint of a PPO run."
            )
        from safetensors.torch import load_file

        self.critic_model.load_checkpoint_tensors(load_file(path))


# The per-micro-batch figures of the PPO loss (`_record_loss_metrics`), each a mean over valid tokens.
_PPO_LOSS_METRICS = (
    "ppo/policy_loss",
    "ppo/value_loss",
    "ppo/clipfrac",
    "ppo/approx_kl",
    "ppo/value_clipfrac",
    "entropy",
)
