"""`AsyncPPOTrainer`: PPO with a learned critic and GAE, on the asynchronous engine of `AsyncGRPOTrainer`.

PPO differs from GRPO in where the advantages come from and in the loss; everything else is the engine's. So
`AsyncPPOTrainer` subclasses `AsyncGRPOTrainer` and keeps its generation process, queue, weight publishing, prompt
stream, `async/*` metrics and rollout checkpoint state (the trainer-side `RolloutClient`), and TRL's own scoring,
reference log-probs and batch splitting. What it changes, and where (math: docs/ppo.md, `trl_async.ppo_math`):

* `_generate_and_score_completions`: on the rows the engine (or TRL's synchronous generation) produced, replaces
  GRPO's group advantages by PPO's per-token ones. The sequence score is the weighted sum of TRL's reward matrix (minus
  `missing_eos_penalty`); the per-token reward is -kl_coef·KL(π_old ‖ π_ref) plus the score on the last token; the
  critic's values at batch time give GAE advantages and returns. π_old is the policy when the batch enters training
  (TRL's `old_per_token_logps`), the reference is TRL's (`beta = kl_coef`: a reference model, or the disabled adapter).
* `_compute_loss`: PPO-clip (or M2PO) on the per-token advantages, with the truncated importance weight π_old/μ for
  stale rows exactly where `AsyncGRPOTrainer` applies it, plus `vf_coef` times the clipped value loss.
* The critic (`value_model`): a sequence-classification model with `num_labels=1` read at every token (default: one
  built from the policy's checkpoint, i.e. a value head on a copy of the policy's base), or, under PEFT, a second
  LoRA adapter on the policy's own base plus a linear value head (no second copy of the base weights). The optimizer
  covers it (`create_optimizer`), checkpoints save and restore it (`save_model`, `_load_from_checkpoint`), and it is
  never published to the generator: only the policy is (a PEFT critic adapter is not the active adapter, which
  `publishable_parameters` skips).

`num_iterations` is PPO's number of epochs over a rollout batch and `steps_per_generation` its number of mini-batches:
advantages, returns, π_old and the old values are computed once per generation batch, as in PPO.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import textwrap
from typing import NamedTuple

import torch
from accelerate.utils import is_peft_model
from torch import Tensor, nn
from transformers import AutoModelForSequenceClassification, PreTrainedModel, TrainerCallback
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import disable_dropout_in_model, get_config_model_id

from .config import AsyncPPOConfig, grpo_view_of_ppo_args
from .grpo import AsyncGRPOTrainer
from .importance import truncated_importance_weights
from .losses import m2po_loss, m2po_select
from .offpolicy import importance_weight_sums, m2po_offpolicy_sums, offpolicy_sums
from .ppo_math import gae, kl_shaped_rewards, masked_whiten, per_token_kl, ppo_policy_loss, value_loss

CRITIC_ADAPTER = "critic"  # name of the critic's LoRA adapter under PEFT (never the active, published adapter)
CRITIC_FILE = "trl_async_critic.safetensors"  # the critic's weights, beside the policy in every checkpoint


# ------------------------------------------------------------------------------------------------- pure functions
class PPOTargets(NamedTuple):
    advantages: Tensor  # (B, T) GAE advantages, whitened over the valid tokens if asked; 0 on padding
    returns: Tensor  # (B, T) value targets R_t = A_t + V_t (before whitening A); 0 on padding
    rewards: Tensor  # (B, T) KL-shaped per-token rewards (before whitening); 0 on padding
    kl: Tensor  # (B, T) per-token KL estimate of π_old against π_ref (before kl_coef); 0 on padding


def ppo_targets(
    scores: Tensor,
    old_logps: Tensor,
    ref_logps: Tensor,
    old_values: Tensor,
    mask: Tensor,
    *,
    kl_coef: float,
    kl_estimator: str,
    gamma: float,
    lam: float,
    whiten_rewards: bool,
    whiten_advantages: bool,
) -> PPOTargets:
    """PPO's targets for one rollout batch (the stages of `ppo_math`, in TRL's former PPOTrainer's order):

    r_t = -kl_coef · KL_t(π_old ‖ π_ref) + 1[t = last] · score                 (kl_shaped_rewards)
    r   ← whiten(r), mean kept                                                 (if whiten_rewards)
    A_t = Σ_l (γλ)^l δ_{t+l},  δ_t = r_t + γ V_{t+1} - V_t,  R_t = A_t + V_t     (gae)
    A   ← whiten(A)                                                            (if whiten_advantages)
    """
    shaped = kl_shaped_rewards(scores, old_logps, ref_logps, mask, kl_coef, kl_estimator)
    rewards = masked_whiten(shaped.rewards, mask, shift_mean=False) if whiten_rewards else shaped.rewards
    advantages, returns = gae(rewards, old_values, mask, gamma, lam)
    if whiten_advantages:
        advantages = masked_whiten(advantages, mask, shift_mean=True)
    return PPOTargets(advantages=advantages, returns=returns, rewards=shaped.rewards, kl=shaped.kl)


class PerTokenValueModel(nn.Module):
    """A sequence-classification model with `num_labels=1`, read at every position: V(s) = score(h_s), where h_s is
    its backbone's last hidden state (as TRL's former PPOTrainer read its `value_model`). Its own weights."""

    def __init__(self, model: PreTrainedModel):
        super().__init__()
        head = getattr(model, "score", None)
        if not isinstance(head, nn.Linear) or head.out_features != 1:
            raise ValueError(
                f"value_model must be a sequence-classification model with num_labels=1 and a linear `score` head "
                f"(AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)), got "
                f"{type(model).__name__}. Pass a path to build one."
            )
        self.model = model

    @property
    def backbone(self) -> nn.Module:
        return getattr(self.model, self.model.base_model_prefix)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """(B, L) values, one per position."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.model.score(hidden).squeeze(-1)

    def restore_trainable(self) -> None:
        """Nothing toggles this model's `requires_grad` (see `AdapterValueModel.restore_trainable`)."""

    def checkpoint_tensors(self) -> dict[str, Tensor]:
        return dict(self.named_parameters())

    def load_checkpoint_tensors(self, tensors: dict[str, Tensor]) -> None:
        _copy_into(dict(self.named_parameters()), tensors)


class AdapterValueModel(nn.Module):
    """Under PEFT: a second LoRA adapter (`critic`) on the policy's own base and a linear value head. The base
    weights are shared with the policy, so the critic costs an adapter and a head, not a second model.

    The adapter lives in the policy's module tree (so the policy's DDP wrapper synchronises its gradients and PEFT's
    `save_pretrained` writes it too); only the head is this module's own parameter. The policy model is referenced, not
    registered, so that its parameters are not this module's too.
    """

    def __init__(self, peft_model: nn.Module, adapter_name: str = CRITIC_ADAPTER, checkpointing_kwargs=None):
        super().__init__()
        policy_adapter = peft_model.active_adapter
        config = copy.deepcopy(peft_model.peft_config[policy_adapter])
        config.inference_mode = False
        peft_model.add_adapter(adapter_name, config)  # LoRA B = 0: the critic's features start as the base's
        base = peft_model.get_base_model()
        text_config = base.config.get_text_config()
        reference = next(base.parameters())
        self.head = nn.Linear(text_config.hidden_size, 1, dtype=reference.dtype, device=reference.device)
        nn.init.zeros_(self.head.weight)  # V = 0 until the critic learns (see `AsyncPPOTrainer._build_critic`)
        nn.init.zeros_(self.head.bias)
        self.__dict__["peft_model"] = peft_model  # a reference, not a submodule
        self.adapter_name = adapter_name
        self.checkpointing_kwargs = checkpointing_kwargs  # to re-enable the policy's gradient checkpointing as it was
        self.restore_trainable()

    def adapter_parameters(self) -> list[tuple[str, nn.Parameter]]:
        tag = f".{self.adapter_name}."
        return [(name, p) for name, p in self.peft_model.named_parameters() if tag in name]

    def restore_trainable(self) -> None:
        """PEFT freezes every adapter but the active one whenever adapters are switched, disabled and re-enabled, or
        loaded (TRL's reference pass, a checkpoint load): the critic adapter is made trainable again."""
        for _, parameter in self.adapter_parameters():
            parameter.requires_grad_(True)

    @contextlib.contextmanager
    def _critic_adapter(self):
        """The critic adapter active instead of the policy's, with every `requires_grad` flag left as it was (PEFT's
        `set_adapter` freezes the adapters it deactivates)."""
        model = self.peft_model
        flags = [(p, p.requires_grad) for p in model.parameters()]
        previous = model.active_adapter
        model.set_adapter(self.adapter_name)
        for parameter, flag in flags:
            parameter.requires_grad_(flag)
        try:
            yield
        finally:
            model.set_adapter(previous)
            for parameter, flag in flags:
                parameter.requires_grad_(flag)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """(B, L) values, one per position. Gradient checkpointing is off for this forward: a checkpointed segment
        is recomputed during backward, when the policy's adapter is active again."""
        base = self.peft_model.get_base_model()
        backbone = getattr(base, base.base_model_prefix)
        with self._critic_adapter(), disable_gradient_checkpointing(base, self.checkpointing_kwargs):
            hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.head(hidden).squeeze(-1)

    def checkpoint_tensors(self) -> dict[str, Tensor]:
        tensors = {f"head.{name}": p for name, p in self.head.named_parameters()}
        tensors.update({f"adapter.{name}": p for name, p in self.adapter_parameters()})
        return tensors

    def load_checkpoint_tensors(self, tensors: dict[str, Tensor]) -> None:
        _copy_into(self.checkpoint_tensors(), tensors)
        self.restore_trainable()


@torch.no_grad()
def _copy_into(destination: dict[str, Tensor], source: dict[str, Tensor]) -> None:
    """Copy `source` into the existing tensors (the optimizer holds them), requiring the same names and shapes."""
    missing, unexpected = set(destination) - set(source), set(source) - set(destination)
    if missing or unexpected:
        raise ValueError(
            f"The saved critic does not match this trainer's critic: missing {sorted(missing)[:3]}, unexpected "
            f"{sorted(unexpected)[:3]}. Resume with the same value_model / PEFT settings as the run that saved it."
        )
    for name, tensor in destination.items():
        tensor.copy_(source[name].to(device=tensor.device, dtype=tensor.dtype))


class _CriticGradients(TrainerCallback):
    """What Trainer does for the policy model's gradients, for the critic's own parameters (Trainer only knows the
    policy model): clip them to `max_grad_norm` before each optimizer step, and zero them after it (Trainer calls
    `model.zero_grad()` on the policy only). A PEFT critic adapter lives in the policy model and gets both from Trainer.
    """

    def __init__(self, trainer: AsyncPPOTrainer):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if args.max_grad_norm is None or args.max_grad_norm <= 0:
            return
        parameters = [p for p in self.trainer.critic.parameters() if p.grad is not None]
        if parameters:
            norm = torch.nn.utils.clip_grad_norm_(parameters, args.max_grad_norm)
            self.trainer._metrics["train"]["ppo/critic_grad_norm"].append(norm.item())

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer.critic.zero_grad(set_to_none=True)


# ------------------------------------------------------------------------------------------------------- trainer
class AsyncPPOTrainer(AsyncGRPOTrainer):
    """PPO with a learned critic and GAE on the asynchronous engine (or synchronously, `async_generation=False`).

    Takes `AsyncGRPOTrainer`'s (that is TRL `GRPOTrainer`'s) arguments with an `AsyncPPOConfig`, plus `value_model`:
    a sequence-classification model with `num_labels=1` or a path to build one from (a causal-LM checkpoint gets a new
    value head on its base). Default: built from the policy's own checkpoint; under PEFT (`peft_config`, or a
    `PeftModel`), a second adapter on the policy's base plus a value head instead.
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
        given = inspect.signature(GRPOTrainer.__init__).bind(None, model, reward_funcs, args, *positional, **kwargs)
        given = given.arguments
        refused = [name for name in ("tools", "environment_factory", "rollout_func") if given.get(name)]
        if refused:
            raise ValueError(
                f"AsyncPPOTrainer does not support {', '.join(refused)}= yet: tool and environment turns make the loss "
                "mask of a completion non-contiguous, which GAE here does not handle."
            )
        peft = given.get("peft_config") is not None or (not isinstance(model, str) and is_peft_model(model))
        adapter_critic = value_model is None and peft
        if adapter_critic:
            # The critic adapter sits in the policy's DDP module but is used outside its forward: DDP must not look
            # for unused parameters (it would mark the adapter ready before its gradients arrive).
            if args.ddp_find_unused_parameters:
                raise ValueError(
                    "ddp_find_unused_parameters=True cannot be used with the PEFT critic adapter (it is used outside "
                    "the policy's forward). Leave it unset, or pass a separate value_model."
                )
            args.ddp_find_unused_parameters = False
        with grpo_view_of_ppo_args(args):
            super().__init__(model, reward_funcs, args, *positional, **kwargs)
        self.loss_type = args.loss_type
        critic = self._build_critic(value_model)
        if args.disable_dropout:
            disable_dropout_in_model(critic)
        # Several processes: a DDP wrapper, whose gradients are all-reduced once per optimizer step (`training_step`).
        self.critic = self.accelerator.prepare_model(critic)
        self.add_callback(_CriticGradients(self))
        if self.optimizer is not None:  # optimizers=(optimizer, scheduler) given: it must train the critic too
            held = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
            if any(id(p) not in held for p in self._critic_parameters()):
                raise ValueError(
                    "The optimizer passed in `optimizers` does not hold the critic's parameters, and its scheduler "
                    "could not follow parameter groups added later. Leave `optimizers` unset and choose the optimizer "
                    "in the config (optim, optim_args, learning_rate, critic_learning_rate), or pass a value_model and "
                    "an optimizer over both models."
                )

    # --------------------------------------------------------------------------------------------- critic
    def _build_critic(self, value_model) -> nn.Module:
        policy = self.accelerator.unwrap_model(self.model)
        if value_model is None and is_peft_model(policy):
            return AdapterValueModel(policy, checkpointing_kwargs=self.args.gradient_checkpointing_kwargs)
        if value_model is None:
            value_model = get_config_model_id(policy.config)
        if isinstance(value_model, str):
            init_kwargs = dict(self.args.model_init_kwargs or {})
            init_kwargs.setdefault("dtype", policy.dtype)
            init_kwargs.setdefault("trust_remote_code", self.args.trust_remote_code)
            value_model, loading = AutoModelForSequenceClassification.from_pretrained(
                value_model, num_labels=1, output_loading_info=True, **init_kwargs
            )
            if any(key.startswith("score.") for key in loading["missing_keys"]):
                # A new value head (a causal-LM checkpoint): V = 0 until the critic learns, so the first advantages
                # are the discounted scores themselves, not a random head's noise.
                nn.init.zeros_(value_model.score.weight)
        if not isinstance(value_model, nn.Module):
            raise TypeError(f"value_model must be a model, a path or None, got {type(value_model).__name__}.")
        value_model.config.pad_token_id = self._tokenizer.pad_token_id
        critic = PerTokenValueModel(value_model)
        if self.args.gradient_checkpointing:
            value_model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs
            )
        return critic

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
    @contextlib.contextmanager
    def _recording_rewards(self):
        """Records what `_calculate_rewards` returns during the block (TRL's reward matrix, gathered across
        processes), without changing it: TRL turns it into group advantages and does not return it."""
        calls: list[Tensor] = []
        calculate = self._calculate_rewards

        def recorded(*args, **kwargs):
            rewards = calculate(*args, **kwargs)
            calls.append(rewards)
            return rewards

        self._calculate_rewards = recorded
        try:
            yield calls
        finally:
            self.__dict__.pop("_calculate_rewards", None)  # back to the class's method

    def _generate_and_score_completions(self, inputs):
        """Runs `AsyncGRPOTrainer._generate_and_score_completions` (the next queue batch, or TRL's synchronous
        generation, then TRL's scoring and reference log-probs), then replaces GRPO's group advantages by PPO's on the
        same rows. Adds to the batch dict: `advantages` (B, T), `returns`, `old_values` (the critic now),
        `old_per_token_logps` (π_old: the policy now) and `loss_mask` (valid tokens of scorable rows)."""
        with self._recording_rewards() as calls:
            output = super()._generate_and_score_completions(inputs)
        critic = self.critic_model
        critic.restore_trainable()  # TRL's reference pass disables and re-enables the adapters (PEFT)
        mode = "train" if self.model.training else "eval"
        completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
        rows = completion_ids.size(0)
        local = slice(self.accelerator.process_index * rows, (self.accelerator.process_index + 1) * rows)
        scores, scorable = self._sequence_scores(calls[-1][local], completion_ids, completion_mask)
        mask = completion_mask.bool() & scorable.unsqueeze(1)
        input_ids = torch.cat([output["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            old_logps = output.get("old_per_token_logps")
            if old_logps is None:  # TRL computes it only when the batch spans optimizer steps; PPO's reward needs it
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
            kl_coef=args.kl_coef,
            kl_estimator=args.kl_estimator,
            gamma=args.gamma,
            lam=args.lam,
            whiten_rewards=args.whiten_rewards,
            whiten_advantages=args.whiten_advantages,
        )
        output.update(
            advantages=targets.advantages,
            returns=targets.returns,
            old_values=old_values,
            old_per_token_logps=old_logps,
            loss_mask=mask,
        )
        self._log_rollout_metrics(mode, scores, scorable, targets, old_values, mask)
        behaviour = self._behaviour_logps(output)
        if behaviour is not None:
            self._log_importance_weights(old_logps, behaviour, mask)
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

    def _log_rollout_metrics(self, mode, scores, scorable, targets: PPOTargets, old_values, mask) -> None:
        """Batch-level metrics over all processes (sums all-reduced): explained variance of the returns by the
        critic's values at batch time, EV = 1 - Var[R - V] / Var[R] (biased variances, `ppo_math.explained_variance`),
        the means of returns and values, TRL's former `objective/kl` (Σ_t KL per row) and `objective/scores`."""
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
        n, r1, r2, d1, d2, v1, kl, rows, score_sum = self.accelerator.reduce(local, reduction="sum").tolist()
        metrics = self._metrics[mode]
        tokens, rows = max(n, 1.0), max(rows, 1.0)
        var_returns = r2 / tokens - (r1 / tokens) ** 2
        var_residual = d2 / tokens - (d1 / tokens) ** 2
        metrics["ppo/explained_variance"].append(1.0 - var_residual / var_returns if var_returns > 0 else float("nan"))
        metrics["ppo/returns_mean"].append(r1 / tokens)
        metrics["ppo/value_mean"].append(v1 / tokens)
        metrics["objective/kl"].append(kl / rows)
        metrics["objective/scores"].append(score_sum / rows)

    def _log_importance_weights(self, old_logps: Tensor, behaviour: Tensor, mask: Tensor) -> None:
        """The engine's `sampling/importance_sampling_ratio/*` metrics for the weight π_old/μ the PPO loss applies."""
        args = self.args
        weights = truncated_importance_weights(
            old_logps,
            behaviour,
            mask.float(),
            mode=args.vllm_importance_sampling_mode,
            clip_min=args.vllm_importance_sampling_clip_min,
            clip_max=args.vllm_importance_sampling_clip_max,
        )
        flat = weights.flatten() if weights.size(1) == 1 else weights[mask]
        stats = torch.stack([flat.sum(), flat.new_tensor(flat.numel()), (flat == 0).float().sum()])
        total, count, zero = self.accelerator.reduce(stats, reduction="sum").tolist()
        if count:
            metrics = self._metrics["train"]
            metrics["sampling/importance_sampling_ratio/mean"].append(total / count)
            metrics["sampling/importance_sampling_ratio/masked_fraction"].append(zero / count)

    # --------------------------------------------------------------------------------------------- loss
    def _corrects_behaviour(self, inputs: dict) -> bool:
        """Replaces `AsyncGRPOTrainer._corrects_behaviour` with False: the engine would fold π_old/μ into GRPO's
        advantages, which PPO replaces. PPO's loss applies the same weight itself, under the same rule
        (`_behaviour_logps`)."""
        return False

    def _treat_behaviour_mismatch(self, inputs: dict, old_logps: Tensor) -> None:
        """Replaces `AsyncGRPOTrainer._treat_behaviour_mismatch` with nothing: PPO's loss applies the weight π_old/μ
        and records the `offpolicy/*` diagnostics itself (`_compute_loss`)."""

    def _behaviour_logps(self, inputs: dict) -> Tensor | None:
        """μ where PPO-clip gets the truncated importance weight π_old/μ: `AsyncGRPOTrainer`'s rule (rows from the
        queue, `max_staleness > 0`, `vllm_importance_sampling_correction`). None otherwise: μ is π_old (on-policy)."""
        return inputs["sampling_per_token_logps"] if super()._corrects_behaviour(inputs) else None

    def _loss_normalizer(self, inputs: dict, mode: str) -> Tensor:
        """TRL `dapo`'s normaliser: the valid tokens of the whole accumulated batch, per process, so that the summed
        micro-batch losses are token means over the optimizer batch (and DDP's gradient mean over all tokens)."""
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        return normalizer

    def _compute_loss(self, model, inputs):
        """Replaces `GRPOTrainer._compute_loss` (and `AsyncGRPOTrainer`'s): PPO's loss on the per-token advantages,

            loss = L_π + vf_coef · L_V,

        L_π PPO-clip on ρ = π_θ/π_old (weighted by π_old/μ for stale rows) or M2PO against μ, L_V the clipped value
        loss against the returns, both normalised as TRL's `dapo` (`_loss_normalizer`)."""
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
        normalizer = self._loss_normalizer(inputs, mode)
        old_logps, advantages = inputs["old_per_token_logps"], inputs["advantages"]
        extra = {}
        if self.loss_type == "m2po":
            behaviour = inputs.get("sampling_per_token_logps", old_logps)
            delta = per_token_logps.detach() - behaviour
            selection = m2po_select(
                delta,
                mask,
                args.m2po_threshold,
                advantages.detach(),
                args.m2po_rule,
                clip_floor_low=args.m2po_clip_floor_low,
                clip_floor_high=args.m2po_clip_floor_high,
            )
            if "sampling_per_token_logps" in inputs and mode == "train":
                self._record_offpolicy(mode, m2po_offpolicy_sums(delta, mask, selection))
            policy_loss, stats = m2po_loss(
                per_token_logps, behaviour, advantages, mask, normalizer=normalizer, selection=selection
            )
            self._record_m2po_stats(mode, stats)  # `m2po/*`, token-weighted over the logging window, as in GRPO
            ratio = torch.exp(per_token_logps.detach() - old_logps)
            clipfrac = (((ratio < 1 - args.cliprange) | (ratio > 1 + args.cliprange)) & mask).float().sum()
            clipfrac = clipfrac / mask.sum().clamp(min=1)
            approx_kl = (per_token_kl(old_logps, per_token_logps.detach(), mask, "k3")).sum() / mask.sum().clamp(min=1)
        else:
            self._record_ppo_offpolicy(inputs, old_logps, mask, mode)
            policy = ppo_policy_loss(
                per_token_logps,
                old_logps,
                advantages,
                mask,
                args.cliprange,
                behaviour_logps=self._behaviour_logps(inputs),
                importance_sampling_mode=args.vllm_importance_sampling_mode,
                importance_sampling_clip_min=args.vllm_importance_sampling_clip_min,
                importance_sampling_clip_max=args.vllm_importance_sampling_clip_max,
                normalizer=normalizer,
            )
            policy_loss, clipfrac, approx_kl = policy.loss, policy.clipfrac, policy.approx_kl
        critic = value_loss(values, inputs["old_values"], inputs["returns"], mask, args.cliprange_value, normalizer)
        loss = policy_loss + args.vf_coef * critic.loss
        self._log_loss_metrics(
            mode,
            mask,
            {
                "ppo/policy_loss": policy_loss.detach() * normalizer / mask.sum().clamp(min=1),
                "ppo/value_loss": critic.loss.detach() * normalizer / mask.sum().clamp(min=1),
                "ppo/clipfrac": clipfrac,
                "ppo/approx_kl": approx_kl,
                "ppo/value_clipfrac": critic.clipfrac,
                "entropy": (entropies.detach() * mask).sum() / mask.sum().clamp(min=1),
                **extra,
            },
        )
        return loss

    def _record_ppo_offpolicy(self, inputs: dict, old_logps: Tensor, mask: Tensor, mode: str) -> None:
        """`offpolicy/*` of π_old against μ for the PPO-clip loss: the truncated weight where `ppo_policy_loss` applies
        it (`_behaviour_logps`), nothing masked or clipped otherwise."""
        if mode != "train" or "sampling_per_token_logps" not in inputs:
            return
        delta = old_logps - inputs["sampling_per_token_logps"]
        behaviour = self._behaviour_logps(inputs)
        if behaviour is None:
            self._record_offpolicy(mode, offpolicy_sums(delta, mask))
            return
        args = self.args
        weights = truncated_importance_weights(
            old_logps,
            behaviour,
            mask.float(),
            mode=args.vllm_importance_sampling_mode,
            clip_min=args.vllm_importance_sampling_clip_min,
            clip_max=args.vllm_importance_sampling_clip_max,
        )
        self._record_offpolicy(
            mode,
            importance_weight_sums(
                delta,
                mask,
                weights,
                mode=args.vllm_importance_sampling_mode,
                clip_min=args.vllm_importance_sampling_clip_min,
                clip_max=args.vllm_importance_sampling_clip_max,
            ),
        )

    def _log_loss_metrics(self, mode: str, mask: Tensor, means: dict[str, Tensor]) -> None:
        """Per micro-batch, token-weighted over processes: each value is a mean over this micro-batch's valid tokens."""
        count = mask.sum().double()
        local = torch.stack([count, *(value.double() * count for value in means.values())])
        total = self.accelerator.reduce(local, reduction="sum").tolist()
        tokens = max(total[0], 1.0)
        for key, value in zip(means, total[1:], strict=True):
            self._metrics[mode][key].append(value / tokens)

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
        if isinstance(critic, AdapterValueModel):
            named += critic.adapter_parameters()
        decay = set(self.get_decay_parameter_names(critic))
        if isinstance(critic, AdapterValueModel):
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
