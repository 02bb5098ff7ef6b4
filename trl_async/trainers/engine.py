"""`AsyncRolloutMixin`: what both trainers add to TRL's `GRPOTrainer` to train on rollouts of a generation process.

`AsyncGRPOTrainer(AsyncRolloutMixin, GRPOTrainer)` and `AsyncPPOTrainer(AsyncRolloutMixin, GRPOTrainer)` share it.
It owns the trainer side of the rollout engine (`rollout.client.RolloutClient`: the generation process, the queue,
weight publishing) and the TRL hooks every asynchronous trainer needs; the trainers add their losses.

TRL hooks it replaces (each docstring says what and why; `trainers.trl_contract` lists what it assumes of TRL):

* `get_train_dataloader`: the dataloader only paces TRL's loop (epochs, lengths, resume skipping stay TRL's); the
  rows come from the generation process, which owns the prompt stream.
* `_generate_and_score_completions`: takes the next rollout batch and runs TRL's own method on its rows, then the
  trainer's `_after_scoring`. TRL passes `_generate` and `_calculate_rewards` only prompts, so the batch reaches them
  through `HookSlot`, the one hand-off between hooks (below).
* `_generate` / `_calculate_rewards`: return what the generation process sampled and scored.
* `_get_per_token_logps_and_entropies`: each prompt computed once per group (`trainers.forward`).
* `_save_checkpoint` / `_load_optimizer_and_scheduler`: the prompt stream's position; `log`: `async/*`, `offpolicy/*`
  and `m2po/*` over the logging window; `train`: the generation process stops on every exit path.

**The hand-off.** Where TRL's call order forces state from one hook to the next within one of TRL's calls, it goes
through `HookSlot`, created when the call starts and removed when it ends (`_hand_off`), and nowhere else: the rollout
batch that `_generate` and `_calculate_rewards` serve, the reward matrix `_calculate_rewards` returned, and the policy
log-probs of `_compute_loss`'s forward. `tests/test_trl_contract.py` fails if TRL calls these hooks in another order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import weakref
from collections.abc import Callable

import torch
from accelerate.utils import gather, gather_object
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.trainer.grpo_trainer import logger as trl_logger

from ..algorithms.m2po import m2po_metrics, m2po_select, m2po_select_global
from ..algorithms.offpolicy import OffPolicyWindow, log_histogram_to_trackers, m2po_offpolicy_sums, row_age_counts
from ..checkpoints import (
    begin_save,
    check_resumable,
    finish_save,
    last_complete_checkpoint,
    naming_failed_writes,
    rotate,
)
from ..config import async_field
from ..hub import ModelCardMixin
from ..rollout.client import CHECKPOINT_FILE, RolloutBatch, RolloutClient, RolloutSettings
from ..rollout.generator import warm_up_generator_start
from ..rollout.prompts import is_iterable_dataset
from ..rollout.termination import exit_on_sigterm
from ..schedule import micro_steps_per_generation, versions_until_last_use
from ..unsupported import check_async_supported
from ..validation import check_inputs_after_init, check_inputs_before_init, check_resume, run_geometry
from . import collectives, forward, trl_contract
from .rollout_spec import generator_spec, placement

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class HookSlot:
    """The one hand-off between TRL's hooks, for the length of one of TRL's calls (`AsyncRolloutMixin._hand_off`).

    Inputs the hooks read: `batch`, `on_policy_logps`. Outputs they record: `rewards_per_func`, `policy_logps`."""

    # `_generate_and_score_completions`: the rollout batch TRL is scoring (None: TRL generates, e.g. evaluation).
    batch: RolloutBatch | None = None
    # What `_calculate_rewards` returned in that call: TRL's reward matrix, gathered (PPO's sequence scores).
    rewards_per_func: torch.Tensor | None = None
    # `_compute_loss`: called once with the log-probs of its policy forward (detached), before TRL reads the
    # advantages (`trl_contract.CALL_ORDER`); the importance weight needs π_old, which is that forward's output.
    on_policy_logps: Callable[[torch.Tensor], None] | None = None
    policy_logps: torch.Tensor | None = None


class _PublishWeights(TrainerCallback):
    """Publishes the policy to the generation process after each optimizer step (every `weight_sync_steps`)."""

    def __init__(self, trainer: AsyncRolloutMixin):
        self._trainer = weakref.ref(trainer)

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None and trainer._rollout_started():
            seconds = trainer._rollout.publish(trainer._unwrap(trainer.model), state.global_step, state)
            if seconds:
                trainer._metrics["train"]["async/weight_sync_s"].append(seconds)


class _RolloutTicks(torch.utils.data.Dataset):
    """What the training dataloader iterates in async mode: one placeholder per dataset row, so that TRL's sampler,
    lengths, epochs and resume skipping work unchanged while the rows themselves come from the rollout component."""

    def __init__(self, length: int):
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        return {"prompt": index}


class _EndlessRolloutTicks(torch.utils.data.IterableDataset):
    """The same for an iterable train dataset: ticks without end (TRL then needs `max_steps`, as for any iterable)."""

    def __iter__(self):
        index = 0
        while True:
            yield {"prompt": index}
            index += 1


class AsyncRolloutMixin(ModelCardMixin):
    """The rollout engine's side of a TRL trainer; put it before `GRPOTrainer` in the bases.

    Subclasses implement `_prepare_args(bound)` (the config their loss needs, validated) and `_after_scoring(output,
    rewards_per_func)` (what the loss needs beyond TRL's batch dict)."""

    def __init__(self, model, reward_funcs=None, args=None, *positional, **kwargs):
        trl_contract.check_hooks(GRPOTrainer)
        collectives.install_if_requested()  # TRL_ASYNC_CHECK_COLLECTIVES=1: every rank's collectives compared
        bound = trl_contract.bind_init(model, reward_funcs, args, *positional, **kwargs)
        args = self._prepare_args(bound)
        bound.arguments["args"] = args
        if args.async_generation:
            given = bound.arguments
            check_async_supported(
                args,
                model,
                processing_class=given.get("processing_class"),
                quantization_config=given.get("quantization_config"),
                tools=given.get("tools"),
                rollout_func=given.get("rollout_func"),
                environment_factory=given.get("environment_factory"),
            )
        check_inputs_before_init(
            args, model, bound.arguments.get("reward_funcs"), bound.arguments.get("train_dataset")
        )
        if args.async_generation and args.generation_backend == "hf":
            warm_up_generator_start()  # the generation process's imports, while TRL builds the trainer
        # Wrappers (DDP, compiled modules) -> the bare model (`_unwrap`); weak: a re-prepared model drops its wrapper.
        self._unwrapped_models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        super().__init__(*bound.args[1:], **bound.kwargs)
        check_inputs_after_init(self)
        self._hook_slot: HookSlot | None = None
        self._m2po_window: dict[str, torch.Tensor] = {}  # M2PO token sums of the logging window, per mode
        self._offpolicy_window: dict[str, OffPolicyWindow] = {}  # `offpolicy/*` of the logging window, per mode
        self._rollout = RolloutClient(
            self._rollout_settings(),
            all_reduce_max=self._all_reduce_max if self.accelerator.num_processes > 1 else None,
        )
        if self.args.async_generation:
            self.add_callback(_PublishWeights(self))
            if self.args.generation_backend == "vllm":
                self._check_vllm_backend()

    # --------------------------------------------------------------------------------------------- for subclasses
    def _prepare_args(self, bound):
        """The trainer's config, from `GRPOTrainer.__init__`'s bound arguments (`bound.arguments["args"]`)."""
        raise NotImplementedError

    def _after_scoring(self, output: dict, rewards_per_func: torch.Tensor | None) -> dict:
        """The batch dict TRL built (plus `rollout_versions` for rollout rows) -> the one the loss reads."""
        return output

    # --------------------------------------------------------------------------------------------- lifecycle
    def _rollout_settings(self) -> RolloutSettings:
        args = self.args
        return RolloutSettings(
            max_staleness=args.max_staleness,
            micro_steps_per_item=micro_steps_per_generation(args),
            micro_steps_per_version=args.gradient_accumulation_steps,
            queue_capacity=args.queue_capacity,
            weight_sync_steps=args.weight_sync_steps,
            trainer_generates_while_starting=args.trainer_generates_while_starting,
            startup_timeout=args.generator_startup_timeout,
            heartbeat_timeout=args.generator_heartbeat_timeout,
            fixed_staleness=args.fixed_staleness is not None,
        )

    def _check_vllm_backend(self) -> None:
        """A sampling setting vLLM cannot honour fails before any process starts (vLLM's presence:
        `validation.check_vllm_installed`, before the model loads)."""
        from ..rollout.backends.vllm import sampling_kwargs

        if self.args.inflight_weight_updates:
            raise ValueError(
                "inflight_weight_updates=True is implemented for the hf backend only (use_vllm / "
                "generation_backend='vllm' selects vLLM); set inflight_weight_updates=False."
            )
        sampling_kwargs(
            self.generation_config, self.temperature, list(self.eos_token_ids), self.args.generation_kwargs
        )

    def _unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """`accelerator.unwrap_model(model)`, computed once per wrapper: it checks every submodule for compiled regions
        (~1 ms on the tiny model), and the rollout path needs the bare model several times a step."""
        unwrapped = self._unwrapped_models.get(model)
        if unwrapped is None:
            unwrapped = self._unwrapped_models[model] = self.accelerator.unwrap_model(model)
        return unwrapped

    def _async_training(self) -> bool:
        return bool(async_field(self.args, "async_generation")) and self.model.training

    def _rollout_started(self) -> bool:
        rollout = self.__dict__.get("_rollout")  # None on a trainer built without __init__ (TRL's unit tests)
        return rollout is not None and rollout.started

    def _all_reduce_max(self, value: int) -> int:
        return int(gather(torch.tensor([value], device=self.accelerator.device)).max().item())

    def close_rollout(self) -> None:
        """Stop this rank's generation process (idempotent). Called automatically when `train()` returns/raises."""
        self._rollout.close()

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """`Trainer.train`, plus:

        * `resume_from_checkpoint=True` picks the newest *complete* checkpoint, where transformers' `get_last_checkpoint`
          would pick the newest folder, and a path to a partial one is refused (`trl_async.checkpoints`); the
          checkpoint is checked against this run (`validation.check_resume`);
        * the generation process is stopped on return, exception, Ctrl-C or SIGTERM (`rollout.termination`)."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        elif isinstance(resume_from_checkpoint, str):
            check_resumable(resume_from_checkpoint)
        with exit_on_sigterm(f"the trainer of rank {self.accelerator.process_index}"):
            try:
                check_resume(self, resume_from_checkpoint)
                return super().train(resume_from_checkpoint, *args, **kwargs)
            finally:
                self.close_rollout()

    @contextlib.contextmanager
    def _hand_off(self, **inputs):
        """The `HookSlot` for the length of one of TRL's calls: the one place it is created and removed."""
        slot = HookSlot(**inputs)
        self._hook_slot = slot
        try:
            yield slot
        finally:
            self._hook_slot = None

    def _slot(self) -> HookSlot | None:
        return self.__dict__.get("_hook_slot")

    # --------------------------------------------------------------------------------------------- data
    def get_train_dataloader(self):
        """Replaces `GRPOTrainer.get_train_dataloader` in async mode: the same batch geometry and sampler over
        placeholders (`_RolloutTicks`), so TRL's epochs, lengths and resume skipping hold while the generation process,
        not the trainer, reads the dataset."""
        if not async_field(self.args, "async_generation"):
            return super().get_train_dataloader()
        ticks = (
            _EndlessRolloutTicks()
            if is_iterable_dataset(self.train_dataset)
            else _RolloutTicks(len(self.train_dataset))
        )
        return self._get_dataloader(
            dataset=ticks,
            description="Training",
            batch_size=self._train_batch_size * self.args.steps_per_generation,
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )

    def _last_use_version(self) -> int:
        """Policy version at which the generation batch about to be built is last used (`schedule`)."""
        g, a = micro_steps_per_generation(self.args), self.args.gradient_accumulation_steps
        return self.state.global_step + versions_until_last_use(self._step, g, a)

    def _next_rollout_batch(self) -> RolloutBatch:
        """The next generation batch fresh enough on every rank (the generation process starts at the first one)."""
        if not self._rollout.started:
            where = placement(self)
            self._rollout.start(
                generator_spec(self, where),
                self._unwrap(self.model),
                version=self.state.global_step,
                trainer_state=self.state,
                placement=where,
            )
        return self._rollout.next_batch(
            self._last_use_version(), self._unwrap(self.model), current_version=self.state.global_step
        )

    # --------------------------------------------------------------------------------------------- TRL's hooks
    def _generate_and_score_completions(self, inputs):
        """Replaces `GRPOTrainer._generate_and_score_completions`: in async training, the rows TRL's dataloader handed
        over (placeholders) become the next rollout batch's, and TRL's own method runs on them, with their completions
        and rewards served by `_generate` and `_calculate_rewards` through the hook slot. Rollout rows get
        `rollout_versions` (B,), the policy version that generated each. Evaluation and `async_generation=False` run
        TRL's method on TRL's rows. Then `_after_scoring`, with the reward matrix TRL computed."""
        batch = self._next_rollout_batch() if self._async_training() else None
        with self._hand_off(batch=batch) as slot:
            output = super()._generate_and_score_completions(inputs if batch is None else batch.payload.rows)
        if batch is not None:
            completion_ids = output["completion_ids"]
            output["rollout_versions"] = torch.full(
                (completion_ids.size(0),), batch.version, device=completion_ids.device
            )
            if batch.payload.token_versions is not None:  # in-flight weight updates: a version per token
                output["rollout_token_versions"] = _padded(batch.payload.token_versions, completion_ids)
        return self._after_scoring(output, slot.rewards_per_func)

    def _generate(self, prompts: list):
        """Replaces `GRPOTrainer._generate` for a rollout batch: its completions were sampled (and decoded only if a
        text reward, a reward model or completion logging needs them) by the generation process. TRL's
        completion-length metrics are logged the same way. Otherwise it is TRL's."""
        slot = self._slot()
        if slot is None or slot.batch is None:
            return super()._generate(prompts)
        payload = slot.batch.payload
        completions = payload.completions
        if completions is None:  # not decoded: nothing reads them (no text reward, no completion logging)
            completions = [""] * len(payload.completion_ids)
        self._log_completion_lengths(payload.prompt_ids, payload.completion_ids)
        return trl_contract.generate_result(
            prompt_ids=payload.prompt_ids,
            completion_ids=payload.completion_ids,
            tool_mask=None,
            completions=completions,
            logprobs=payload.logprobs,
            extra_fields={},
            images=None,
            tool_images=[],
        )

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """Replaces `GRPOTrainer._calculate_rewards` for a rollout batch: the reward callables already ran in the
        generation process (with `trainer_state`, `log_extra` and `log_metric`; their log calls are replayed here, so
        they reach TRL's logs exactly as in TRL); reward models (`nn.Module`s) are scored here by TRL's own code on the
        decoded completions. Returns what TRL's returns, rewards per function gathered across processes, and records
        it in the hook slot (PPO's scores)."""
        slot = self._slot()
        if slot is None or slot.batch is None:
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        else:
            rewards = self._rollout_rewards(slot.batch, inputs, prompts, completions, completion_ids_list)
        if slot is not None:
            slot.rewards_per_func = rewards
        return rewards

    def _rollout_rewards(self, batch: RolloutBatch, inputs, prompts, completions, completion_ids_list):
        payload = batch.payload
        for column, values in payload.extra_logs.items():
            self._log_completion_extra(column, values)
        for name, values in payload.logged_metrics.items():
            for value in values:
                self._log_metric(name, value)
        local = payload.rewards_per_func.to(self.accelerator.device)
        model_columns = [i for i, f in enumerate(self.reward_funcs) if isinstance(f, torch.nn.Module)]
        if not model_columns and torch.isnan(local).all(dim=1).any():
            # TRL's warning, on TRL's logger, for rows no reward function scored (TRL's own code, which warns, only
            # runs here for reward models).
            row = int(torch.isnan(local).all(dim=1).nonzero()[0])
            trl_logger.warning(
                f"All reward functions returned None for the following kwargs:\n{inputs[row]}\n"
                "Please ensure that at least one reward function returns a valid reward."
            )
        rewards = gather(local)
        if model_columns:
            with self._only_reward_functions(model_columns):
                scored = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            rewards[:, model_columns] = scored
        return rewards

    @contextlib.contextmanager
    def _only_reward_functions(self, columns: list[int]):
        """TRL's `_calculate_rewards` scores every reward function; for a rollout batch only the reward models are
        left to score, so TRL's code runs on that subset for the length of the call (and nothing of it is copied)."""
        saved = self.reward_funcs, self.reward_processing_classes, self.reward_func_names
        self.reward_funcs = [saved[0][i] for i in columns]
        self.reward_processing_classes = [saved[1][i] for i in columns]
        self.reward_func_names = [saved[2][i] for i in columns]
        try:
            yield
        finally:
            self.reward_funcs, self.reward_processing_classes, self.reward_func_names = saved

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal_inputs,
    ):
        """Replaces TRL's forward by one that computes each prompt once per group where that applies
        (`trainers.forward`: same log-probs and gradients), and records the first one of a `_compute_loss` call in
        the hook slot (`HookSlot.on_policy_logps`). Otherwise it is `super()`."""

        def trl_forward(ids, mask):  # TRL's forward for one chunk
            return super(AsyncRolloutMixin, self)._get_per_token_logps_and_entropies(
                model, ids, mask, logits_to_keep, compute_entropy=compute_entropy
            )

        outputs = forward.shared_prompt_logps(
            self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
            compute_aux_loss, multimodal_inputs, trl_forward,
        )  # fmt: skip
        if outputs is None:
            outputs = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal_inputs,
            )  # fmt: skip
        slot = self._slot()
        if slot is not None and slot.on_policy_logps is not None and slot.policy_logps is None:
            slot.policy_logps = outputs[0].detach()
            slot.on_policy_logps(slot.policy_logps)
        return outputs

    # --------------------------------------------------------------------------------------------- M2PO, shared
    def _m2po_selection(self, delta, mask, advantages, mode: str, record_offpolicy: bool):
        """M2PO's token selection (`algorithms.m2po`) for this micro-batch, or over the whole optimizer batch of
        every rank (`m2po_scope="global"`, training only), with its `offpolicy/*` figures recorded."""
        args = self.args
        floors = dict(clip_floor_low=args.m2po_clip_floor_low, clip_floor_high=args.m2po_clip_floor_high)
        adv = advantages.detach().unsqueeze(1) if advantages.dim() == 1 else advantages.detach()
        if args.m2po_scope == "global" and mode == "train":
            # The whole optimizer batch (gradient_accumulation_steps=1: this micro-batch on every rank).
            selection = m2po_select_global(delta, mask, args.m2po_threshold, adv, args.m2po_rule, **floors)
        else:
            selection = m2po_select(delta, mask, args.m2po_threshold, adv, args.m2po_rule, **floors)
        if record_offpolicy:
            self._record_offpolicy(mode, m2po_offpolicy_sums(delta, mask, selection))
        return selection

    def _record_m2po_stats(self, mode: str, stats) -> None:
        """Adds one micro-batch's M2PO sums to the logging window (token-weighted over the window and every rank; see
        `log`: sums here, ratios when logged), and warns when M2PO masked every token of it."""
        sums = self.accelerator.reduce(stats["sums"].detach().to(torch.float64), reduction="sum")
        window = self.__dict__.setdefault("_m2po_window", {})
        window[mode] = sums if window.get(mode) is None else window[mode] + sums
        if sums[-1] > 0:
            logger.warning(
                "M2PO masked every token of a micro-batch (its smallest δ² exceeds m2po_threshold=%s): it contributes "
                "no gradient. Frequent occurrences mean the rollouts are far off-policy; lower max_staleness.",
                self.args.m2po_threshold,
            )

    # --------------------------------------------------------------------------------------------- off-policy
    @staticmethod
    def _has_behaviour(inputs: dict) -> bool:
        """Rows sampled by the rollout engine, with their behaviour log-probs μ."""
        return "rollout_versions" in inputs and "sampling_per_token_logps" in inputs

    def _corrects_behaviour(self, inputs: dict) -> bool:
        """Rows that get TRL's truncated importance weight π_old/μ: from the rollout engine, when they can be stale
        (`max_staleness > 0`) and `vllm_importance_sampling_correction` is on (TRL's default)."""
        return (
            self._has_behaviour(inputs)
            and bool(self.args.vllm_importance_sampling_correction)
            and (async_field(self.args, "max_staleness") or 0) > 0
        )

    def _record_offpolicy(self, mode: str, sums: torch.Tensor) -> None:
        """One batch's `offpolicy_sums`, summed over ranks, into the logging window (see `algorithms.offpolicy`)."""
        sums = self.accelerator.reduce(sums.to(torch.float64), reduction="sum")
        self.__dict__.setdefault("_offpolicy_window", {}).setdefault(mode, OffPolicyWindow()).add_batch(sums)

    def _record_row_ages(self, inputs: dict) -> None:
        """The age of every row entering this loss (the trainer's version minus the generating version), summed over
        ranks into the logging window's histogram (`offpolicy/row_age_*`)."""
        if not (self.model.training and "rollout_versions" in inputs):
            return
        ages = self.state.global_step - inputs["rollout_versions"]
        max_age = int(async_field(self.args, "max_staleness") or 0)
        counts = row_age_counts(ages, max_age).to(ages.device)
        if "rollout_token_versions" in inputs:  # per token too: the oldest token is the row's age, the rest younger
            mask = self._loss_mask(inputs).bool()
            token_ages = (self.state.global_step - inputs["rollout_token_versions"])[mask].double()
            counts = torch.cat([counts, torch.stack([token_ages.sum(), token_ages.new_tensor(token_ages.numel())])])
        counts = self.accelerator.reduce(counts, reduction="sum")
        window = self.__dict__.setdefault("_offpolicy_window", {}).setdefault("train", OffPolicyWindow())
        window.add_ages(counts[: max_age + 2])
        if counts.numel() > max_age + 2:
            window.add_token_ages(float(counts[-2]), float(counts[-1]))

    @staticmethod
    def _loss_mask(inputs: dict) -> torch.Tensor:
        mask = inputs["completion_mask"]
        return mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]

    def _dapo_normalizer(self, inputs: dict, mode: str) -> torch.Tensor:
        """TRL `dapo`'s normaliser: the valid tokens of the whole accumulated batch, per process, so that the summed
        micro-batch losses are token means over the optimizer batch (and DDP's gradient mean over all tokens)."""
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        return normalizer

    def _global_masked_mean(self, values: torch.Tensor, mask: torch.Tensor) -> float:
        totals = self.accelerator.reduce(torch.stack([(values * mask).sum(), mask.sum().float()]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    # --------------------------------------------------------------------------------------------- checkpoints
    def _save_checkpoint(self, model, trial):
        """`GRPOTrainer._save_checkpoint`, plus:

        * the position of every rank's prompt stream (`trl_async_rollout.json`, with the run's batch settings, checked
          on resume), so that a resumed run trains on the batch that comes next, with the same per-batch seeds;
        * a save that is either complete or known to be partial (`trl_async.checkpoints`): marked incomplete before its
          first file, complete once every rank wrote its files, and older checkpoints rotated away (Trainer's
          `save_total_limit`, held back during Trainer's save, which rotates at its end) only then;
        * a write that fails (a full disk, a read-only folder) raises `CheckpointSaveError` naming the folder."""
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        limit = self.args.save_total_limit
        with naming_failed_writes(folder, run_dir):
            if self.args.should_save:
                begin_save(folder)
            self.args.save_total_limit = None  # Trainer's rotation, held back until this checkpoint is complete
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self.args.save_total_limit = limit
        states = None
        if self._rollout_started():
            state = self._rollout.checkpoint_state(self.state.global_step)
            state["run"] = run_geometry(self.args, self.accelerator.num_processes, self.train_dataset)
            states = gather_object([state])
        with naming_failed_writes(folder, run_dir):
            if self.args.should_save and states is not None and os.path.isdir(folder):
                RolloutClient.save_checkpoint_state(states, folder)
        self.accelerator.wait_for_everyone()  # every rank's files (its RNG state) are written
        if self.args.should_save:
            finish_save(folder)
            rotate(run_dir, limit, self.state.best_model_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint):
        """`GRPOTrainer._load_optimizer_and_scheduler` (called only when resuming), plus the prompt stream's saved
        position for this rank's generation process."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            state = RolloutClient.load_checkpoint_state(checkpoint, self.accelerator.process_index)
            if state is None and async_field(self.args, "async_generation"):
                logger.warning(
                    "trl_async: %s has no %s (written by a synchronous run?); the prompt stream restarts from its "
                    "first batch.", checkpoint, CHECKPOINT_FILE
                )  # fmt: skip
            self._rollout.restore(state)

    # --------------------------------------------------------------------------------------------- metrics
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """`GRPOTrainer.log`, plus the `async/*`, `offpolicy/*` and `m2po/*` metrics of the logging window, computed
        from window totals (TRL averages the values appended during the window; a mean of per-batch fractions or
        maxima would not mean what the names say); `m2po/all_masked_batches` is a count."""
        mode = "train" if self.model.training else "eval"
        if self.model.training and self._rollout_started():
            self._log_async_window()
        window = self.__dict__.get("_m2po_window", {}).pop(mode, None)
        if window is not None:
            for key, value in m2po_metrics(window).items():
                self._metrics[mode][f"m2po/{key}"] = [value]
        offpolicy = self.__dict__.get("_offpolicy_window", {}).pop(mode, None)
        if offpolicy is not None:
            for key, value in offpolicy.metrics().items():
                self._metrics[mode][key] = [value]
            if self.accelerator.is_main_process:
                log_histogram_to_trackers(
                    self.callback_handler.callbacks, "offpolicy/row_age", offpolicy.age_counts, self.state.global_step
                )
        super().log(logs, start_time)

    def _log_async_window(self) -> None:
        window = self._rollout.window_metrics()
        keys = list(window)
        local = torch.tensor([float(window[k]) for k in keys], dtype=torch.float64, device=self.accelerator.device)
        ranks = gather(local.unsqueeze(0)).view(-1, len(keys))
        total = dict(zip(keys, ranks.sum(dim=0).tolist(), strict=True))
        peak = dict(zip(keys, ranks.max(dim=0).values.tolist(), strict=True))
        num_ranks = ranks.size(0)
        if not total["batches"] and not total["evicted_rows"]:
            return  # nothing was trained on since the last log (e.g. the summary logged when training ends)
        metrics = self._metrics["train"]
        rows, batches = total["rows"], max(total["batches"], 1.0)
        if total["batches"]:
            metrics["async/staleness_mean"] = [total["staleness_row_sum"] / max(rows, 1.0)]
            metrics["async/staleness_max"] = [peak["staleness_max"]]
            metrics["async/generate_s"] = [total["generate_s"] / batches]
            metrics["async/reward_s"] = [total["reward_s"] / batches]
        metrics["async/evicted"] = [total["evicted_rows"]]
        metrics["async/evicted_fraction"] = [total["evicted_rows"] / max(total["evicted_rows"] + rows, 1.0)]
        metrics["async/queue_size"] = [total["queue_size"] / num_ranks]
        metrics["async/generator_wait_s"] = [total["generator_wait_s"] / num_ranks]
        metrics["async/trainer_wait_s"] = [total["trainer_wait_s"] / num_ranks]
        metrics["async/trainer_generated_batches"] = [total["trainer_batches"] / num_ranks]
        if total["lending_calls"]:  # CPU core lending (rollout/cores.py): share of layer passes on every core
            metrics["async/trainer_lent_cores_fraction"] = [total["lent_calls"] / total["lending_calls"]]

    def _log_completion_lengths(self, prompt_ids: list, completion_ids: list) -> None:
        # The completion metrics of TRL's `_generate`, for rows that did not go through it.
        device, metrics = self.accelerator.device, self._metrics["train"]
        prompt_lengths = gather(torch.tensor([len(p) for p in prompt_ids], device=device))
        lengths = gather(torch.tensor([len(c) for c in completion_ids], device=device))
        self.state.num_input_tokens_seen += (prompt_lengths.sum() + lengths.sum()).item()
        metrics["num_tokens"] = [self.state.num_input_tokens_seen]
        eos_and_pad = {*self.eos_token_ids, self._tokenizer.pad_token_id}
        truncated = gather(torch.tensor([not c or c[-1] not in eos_and_pad for c in completion_ids], device=device))
        terminated = lengths[~truncated].float() if (~truncated).any() else torch.zeros(1, device=device)
        lengths = lengths.float()
        metrics["completions/mean_length"].append(lengths.mean().item())
        metrics["completions/min_length"].append(lengths.min().item())
        metrics["completions/max_length"].append(lengths.max().item())
        metrics["completions/clipped_ratio"].append(truncated.float().mean().item())
        metrics["completions/mean_terminated_length"].append(terminated.mean().item())
        metrics["completions/min_terminated_length"].append(terminated.min().item())
        metrics["completions/max_terminated_length"].append(terminated.max().item())


def _padded(rows: list[list[int]], like: torch.Tensor) -> torch.Tensor:
    """Per-row lists (ragged) as a (B, T) tensor shaped like `like`, each row padded with its last value."""
    out = torch.zeros(like.shape, dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.tensor(row[: like.size(1)], dtype=torch.long)
            out[i, len(row) :] = row[-1]
    return out.to(like.device)
