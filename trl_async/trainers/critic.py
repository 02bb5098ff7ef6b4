"""The critic of `AsyncPPOTrainer`: V(s_t) at every completion token, and how it is built, trained and saved.

* `PerTokenValueModel`: a sequence-classification model with `num_labels=1` read at every position (TRL's former
  PPOTrainer's `value_model`); its own weights. Default: built from the policy's checkpoint (a value head on a copy
  of the policy's base).
* `AdapterValueModel`: under PEFT, a second LoRA adapter on the policy's own base plus a linear value head (no second
  copy of the base weights).

Neither is ever published to the generator: only the policy is (a PEFT critic adapter is not the active adapter,
which `rollout.pipeline.publishable_parameters` skips).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from accelerate.utils import is_peft_model
from torch import Tensor, nn
from transformers import AutoModelForSequenceClassification, PreTrainedModel, TrainerCallback
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import get_config_model_id

CRITIC_ADAPTER = "critic"  # name of the critic's LoRA adapter under PEFT (never the active, published adapter)
CRITIC_FILE = "trl_async_critic.safetensors"  # the critic's weights, beside the policy in every checkpoint


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


class CriticGradients(TrainerCallback):
    """What Trainer does for the policy model's gradients, for the critic's own parameters (Trainer only knows the
    policy model): clip them to `max_grad_norm` before each optimizer step, and zero them after it (Trainer calls
    `model.zero_grad()` on the policy only). A PEFT critic adapter lives in the policy model and gets both from Trainer.
    """

    def __init__(self, trainer):
        self.trainer = trainer  # AsyncPPOTrainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if args.max_grad_norm is None or args.max_grad_norm <= 0:
            return
        parameters = [p for p in self.trainer.critic.parameters() if p.grad is not None]
        if parameters:
            norm = torch.nn.utils.clip_grad_norm_(parameters, args.max_grad_norm)
            self.trainer._metrics["train"]["ppo/critic_grad_norm"].append(norm.item())

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer.critic.zero_grad(set_to_none=True)


def build_critic(policy: nn.Module, value_model, args, pad_token_id: int) -> PerTokenValueModel | AdapterValueModel:
    """The critic for `policy` (unwrapped): `value_model` (a model, or a path to build one from), or by default a value
    head on the policy's own checkpoint, or under PEFT a second adapter on the policy's base."""
    if value_model is None and is_peft_model(policy):
        return AdapterValueModel(policy, checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    if value_model is None:
        value_model = get_config_model_id(policy.config)
    if isinstance(value_model, str):
        init_kwargs = dict(args.model_init_kwargs or {})
        init_kwargs.setdefault("dtype", policy.dtype)
        init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
        value_model, loading = AutoModelForSequenceClassification.from_pretrained(
            value_model, num_labels=1, output_loading_info=True, **init_kwargs
        )
        if any(key.startswith("score.") for key in loading["missing_keys"]):
            # A new value head (a causal-LM checkpoint): V = 0 until the critic learns, so the first advantages are
            # the discounted scores themselves, not a random head's noise.
            nn.init.zeros_(value_model.score.weight)
    if not isinstance(value_model, nn.Module):
        raise TypeError(f"value_model must be a model, a path or None, got {type(value_model).__name__}.")
    value_model.config.pad_token_id = pad_token_id
    critic = PerTokenValueModel(value_model)
    if args.gradient_checkpointing:
        value_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    return critic
