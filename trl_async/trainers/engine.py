"""`AsyncRolloutMixin`: what both trainers add to TRL's `GRPOTrainer` to train on rollouts of a generation process.

`AsyncGRPOTrainer(AsyncRolloutMixin, GRPOTrainer)` and `AsyncPPOTrainer(AsyncRolloutMixin, GRPOTrainer)` share it.
It owns the trainer side of the rollout engine (`rollout.pipeline.RolloutPipeline`: the generation process, the queue,
weight publishing) and the TRL hooks every asynchronous trainer needs; the trainers add their losses.

TRL hooks it replaces (each docstring says what and why; `trl_contract` lists what it assumes of TRL):

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
batch that `_generate` and `_calculate_rewards` serve, the reward matrix `_calculate_rewards` returned, and a GRPO
batch whose correction against μ waits for `_compute_loss`'s own forward (`HookSlot.correct_at_forward`,
`trainers.correction`). `tests/test_trl_contract.py` fails if TRL calls these hooks in another order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import weakref

import torch
from accelerate.utils import gather, gather_object
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.trainer.grpo_trainer import logger as trl_logger

from .. import trl_contract
from ..algorithms.offpolicy import (
    batch_ess,
    log_histogram_to_trackers,
    row_age_counts,
)
from ..config import async_field
from ..config.inputs import check_inputs_after_init, check_inputs_before_init
from ..config.refusals import (
    AGENTIC_ARGUMENTS,
    agentic_arguments,
    check_async_supported,
    check_cuda_graphs,
    check_generate_not_replaced,
)
from ..hub import ModelCardMixin
from ..rollout.generator import warm_up_generator_start
from ..rollout.pipeline import RolloutBatch, RolloutPipeline, RolloutSettings
from ..rollout.prompts import is_iterable_dataset
from ..rollout.termination import exit_on_sigterm
from ..schedule import micro_steps_per_generation, versions_until_last_use
from ..timeline import TimelineWriter, disabled, set_current, trainer_recorder
from ..timeline import names as span
from . import checkpoints, collectives, forward
from .agentic import (
    check_environment_routing,
    environments_left_to_the_rollouts,
    log_tool_metrics,
    model_token_counts,
)
from .batch import rollout_fields, rollout_view
from .checkpoints import (
    ROLLOUT_STATE_FILE,
    begin_save,
    check_resumable,
    check_resume,
    finish_save,
    last_complete_checkpoint,
    naming_failed_writes,
    rank_rollout_state,
    rotate,
    run_geometry,
)
from .correction import (
    BehaviourCorrection,
    CorrectionSettings,
    apply_to_trl_batch,
    behaviour_correction,
    m2po_correction,
)
from .loop import EndlessRolloutTicks, PublishWeights, ReduceStatistics, RolloutTicks, TimelineSteps
from .rollout_spec import generator_spec, modeling_modules, placement, uses_agentic_rollouts
from .statistics import (
    Field,
    StatisticsLayout,
    WindowStatistics,
    record_async_window,
    record_completions,
    trainer_fields,
    trainer_metrics,
    warn_of_m2po_masked_micro_batches,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class HookSlot:
    """The one hand-off between TRL's hooks, for the length of one of TRL's calls (`AsyncRolloutMixin._hand_off`).

    Inputs the hooks read: `batch`, `correct_at_forward`. Output they record: `rewards_per_func`."""

    # `_generate_and_score_completions`: the rollout batch TRL is scoring (None: TRL generates, e.g. evaluation).
    batch: RolloutBatch | None = None
    # What `_calculate_rewards` returned in that call: TRL's reward matrix, gathered (PPO's sequence scores).
    rewards_per_func: torch.Tensor | None = None
    # `_compute_loss` of a GRPO batch used within one optimizer step: the batch dict TRL's loss is about to read. π_old
    # is that call's own policy forward, which TRL runs before it reads the advantages (`trl_contract.CALL_ORDER`):
    # the forward override corrects this dict against μ in between (`_correct_at_forward`), once per call.
    correct_at_forward: dict | None = None


class AsyncRolloutMixin(ModelCardMixin):
    """The rollout engine's side of a TRL trainer; put it before `GRPOTrainer` in the bases.

    Subclasses implement `_prepare_args(bound)` (the config their loss needs, validated) and `_after_scoring(output,
    rewards_per_func)` (what the loss needs beyond TRL's batch dict)."""

    # The timeline's recorder while `train` runs (`_start_timeline`); the disabled one otherwise, also on a trainer built
    # without `__init__` (TRL's own unit tests build them so).
    _timeline = disabled()

    def __init__(self, model, reward_funcs=None, args=None, *positional, **kwargs):
        trl_contract.check_hooks(GRPOTrainer)
        collectives.install_if_requested()  # TRL_ASYNC_CHECK_COLLECTIVES=1: every rank's collectives compared
        bound = trl_contract.bind_init(model, reward_funcs, args, *positional, **kwargs)
        args = self._prepare_args(bound)
        bound.arguments["args"] = args
        given = bound.arguments
        if args.async_generation:
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
            args, model, *(given.get(name) for name in ("reward_funcs", "train_dataset", *AGENTIC_ARGUMENTS[1:]))
        )
        if args.async_generation and args.generation_backend == "hf":
            # The generation process's imports, while TRL builds the trainer (and TRL's, for its multi-turn code).
            warm_up_generator_start(agentic=bool(agentic_arguments(*(given.get(name) for name in AGENTIC_ARGUMENTS))),
                                    extra_modules=modeling_modules(model, args, given.get("peft_config")))  # fmt: skip
        # Wrappers (DDP, compiled modules) -> the bare model (`_unwrap`); weak: a re-prepared model drops its wrapper.
        self._unwrapped_models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        super().__init__(*bound.args[1:], **bound.kwargs)
        check_inputs_after_init(self)
        check_cuda_graphs(args, args.generation_device or self.accelerator.device)
        self._hook_slot: HookSlot | None = None
        self.add_callback(TimelineSteps(self))
        # The trainers' own figures of the logging window, per mode: recorded locally, reduced once per log.
        layout = StatisticsLayout(self._statistics_fields())
        self._statistics = {mode: WindowStatistics(layout, self.accelerator.device) for mode in ("train", "eval")}
        self.add_callback(ReduceStatistics(self))
        self._rollout = RolloutPipeline(
            self._rollout_settings(),
            all_reduce_max=self._all_reduce_max if self.accelerator.num_processes > 1 else None,
        )
        if self.args.async_generation:
            self.add_callback(PublishWeights(self))
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
            # Tools and environments run in the generation process only: a hung call ends only with the process that
            # runs it, which must not be the trainer's (docs/agentic.md).
            trainer_generates_while_starting=args.trainer_generates_while_starting and not uses_agentic_rollouts(self),
            startup_timeout=args.generator_startup_timeout,
            heartbeat_timeout=args.generator_heartbeat_timeout,
            fixed_staleness=args.fixed_staleness is not None,
        )

    def _check_vllm_backend(self) -> None:
        """A sampling setting vLLM cannot honour fails before any process starts (vLLM's presence:
        `config.inputs.check_vllm_installed`, before the model loads)."""
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
          would pick the newest folder, and a path to a partial one is refused (`trl_async.trainers.checkpoints`); the
          checkpoint is checked against this run (`checkpoints.check_resume`);
        * the generation process is stopped on return, exception, Ctrl-C or SIGTERM (`rollout.termination`);
        * the run's timeline is recorded and written to `OUTPUT_DIR/timeline.json` (`timeline=True`, the default)."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        elif isinstance(resume_from_checkpoint, str):
            check_resumable(resume_from_checkpoint)
        with exit_on_sigterm(f"the trainer of rank {self.accelerator.process_index}"):
            self._start_timeline()
            try:
                check_resume(self, resume_from_checkpoint)
                return super().train(resume_from_checkpoint, *args, **kwargs)
            finally:
                self.close_rollout()  # its generation process flushes its timeline as it stops
                self._finish_timeline()

    def _start_timeline(self) -> None:
        """This rank's recorder for the run (`trl_async.timeline`; the disabled one with `timeline=False`), and on the
        process that saves, the writer that merges every process's fragments into `timeline.json`."""
        args = self.args
        self._timeline = trainer_recorder(
            args.output_dir,
            self.accelerator.process_index,
            self.accelerator.num_processes,
            enabled=bool(async_field(args, "timeline")),
            cores=torch.get_num_threads(),
        )
        set_current(self._timeline)  # the rollout pipeline and the queue record into it
        self._timeline_writer = (
            TimelineWriter(args.output_dir) if args.should_save and self._timeline.enabled else None
        )

    def _finish_timeline(self) -> None:
        """On every exit of `train`: this rank's spans to its fragment, and the merged `timeline.json`. A timeline that
        cannot be written never hides the run's own outcome."""
        with contextlib.suppress(OSError):
            self._timeline.close()
            if self._timeline_writer is not None:
                self._timeline_writer.write()
        set_current(None)

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
            EndlessRolloutTicks() if is_iterable_dataset(self.train_dataset) else RolloutTicks(len(self.train_dataset))
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
            check_environment_routing(self)
            check_generate_not_replaced(self.model, self._unwrap(self.model))
            where = placement(self)
            self._rollout.start(
                generator_spec(self, where),
                self._unwrap(self.model),
                version=self.state.global_step,
                trainer_state=self.state,
                placement=where,
                final_version=self.state.max_steps,
            )
        return self._rollout.next_batch(
            self._last_use_version(), self._unwrap(self.model), current_version=self.state.global_step
        )

    # --------------------------------------------------------------------------------------------- TRL's hooks
    def _generate_and_score_completions(self, inputs):
        """Replaces `GRPOTrainer._generate_and_score_completions`: in async training, the rows TRL's dataloader handed
        over (placeholders) become the next rollout batch's, and TRL's own method runs on them, with their completions
        and rewards served by `_generate` and `_calculate_rewards` through the hook slot. Evaluation and `async_generation=False` run
        TRL's method on TRL's rows. Then `_after_scoring`, with the reward matrix TRL computed.

        Every rollout batch gets the same fields (`trainers.batch.RolloutFields`), whether the trainer made it at
        start-up or the generation process did, so that what follows never depends on where a rank's batch came from."""
        batch = self._next_rollout_batch() if self._async_training() else None
        environments = contextlib.nullcontext() if batch is None else environments_left_to_the_rollouts(self)
        with self._timeline.span(span.SCORE), self._hand_off(batch=batch) as slot, environments:
            output = super()._generate_and_score_completions(inputs if batch is None else batch.payload.rows)
        if batch is not None:
            output.update(rollout_fields(batch, output["completion_ids"]))
        return self._after_scoring(output, slot.rewards_per_func)

    def _generate(self, prompts: list):
        """Replaces `GRPOTrainer._generate` for a rollout batch: its completions were sampled (and decoded only if a
        text reward, a reward model or completion logging needs them) by the generation process, with TRL's multi-turn
        code where there are tools, environments or a rollout function (their `tool_mask` and `extra_fields` go to TRL
        as its `_generate` returns them). TRL's completion-length and `tools/*` metrics are logged the same way.
        Otherwise it is TRL's."""
        slot = self._slot()
        if slot is None or slot.batch is None:  # TRL generates (a synchronous run, evaluation): timed as generation
            begun = self._timeline.begin_cpu()
            try:
                return super()._generate(prompts)
            finally:
                self._timeline.end_cpu(span.GENERATE, begun)
        payload = slot.batch.payload
        completions = payload.completions
        if completions is None:  # not decoded: nothing reads them (no text reward, no completion logging)
            completions = [""] * len(payload.completion_ids)
        self._log_completion_lengths(payload)
        log_tool_metrics(self, payload)
        return trl_contract.generate_result(
            prompt_ids=payload.prompt_ids,
            completion_ids=payload.completion_ids,
            tool_mask=payload.tool_mask,
            completions=completions,
            logprobs=payload.logprobs,
            extra_fields=dict(payload.extra_fields),
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
            begun = self._timeline.begin_cpu()
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            self._timeline.end_cpu(span.REWARDS, begun)
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
        (`trainers.forward`: same log-probs and gradients). The first forward of a `_compute_loss` call whose batch
        awaits its correction against μ (`HookSlot.correct_at_forward`) also applies it (`_correct_at_forward`).
        Otherwise it is `super()`."""

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
        if slot is not None and slot.correct_at_forward is not None:
            batch, slot.correct_at_forward = slot.correct_at_forward, None  # once: the policy's forward comes first
            self._correct_at_forward(batch, outputs[0].detach())
        return outputs

    def _correct_at_forward(self, batch: dict, old_logps: torch.Tensor) -> None:
        """TRL's `_compute_loss` is about to read `batch` (a copy of the buffered one): π_old is its forward's output,
        so the correction against μ (`trainers.correction`) is applied to it now, in place."""
        corrected = apply_to_trl_batch(batch, self._behaviour_correction(batch, old_logps), self.loss_type)
        batch.update(corrected)

    def training_step(self, model, inputs, num_items_in_batch):
        """`GRPOTrainer.training_step`, timed: its forward + backward is the time from the end of the last span inside
        it (TRL's scoring, when this micro-step made the batch) to its end."""
        start = self._timeline.begin()
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._timeline.end(span.FORWARD_BACKWARD, max(start, self._timeline.last_end()))
        return loss

    # --------------------------------------------------------------------------------------------- the correction
    def _correction_settings(self, mode: str = "train") -> CorrectionSettings:
        """Whether TRL's truncated weight π_old/μ applies: rollout rows (an asynchronous training step) that can be
        stale (`max_staleness > 0`), with `vllm_importance_sampling_correction` on (TRL's default); M2PO's scope.
        Decided by the mode and the config, the same on every rank whatever its batch."""
        corrects = (
            self._async_training()
            and bool(self.args.vllm_importance_sampling_correction)
            and (async_field(self.args, "max_staleness") or 0) > 0
        )
        m2po_global = async_field(self.args, "m2po_scope") == "global" and mode == "train"
        return CorrectionSettings.from_args(self.args, corrects, m2po_global=m2po_global)

    def _behaviour_correction(
        self, batch: dict, old_logps: torch.Tensor, mask: torch.Tensor | None = None
    ) -> BehaviourCorrection:
        """The correction of a rollout batch against its μ given π_old (`trainers.correction`), over `mask` (default:
        the loss mask of TRL's batch), its figures recorded."""
        behaviour = rollout_view(batch)["sampling_per_token_logps"]
        mask = self._loss_mask(batch) if mask is None else mask
        correction = behaviour_correction(old_logps, behaviour, mask, self._correction_settings())
        self._record_correction("train", correction)
        return correction

    def _m2po_selection(self, delta, mask, advantages, mode: str, record_offpolicy: bool):
        """M2PO's token selection for this micro-batch, or over the whole optimizer batch of every rank
        (`m2po_scope="global"`, training only), with its `offpolicy/*` figures recorded for rollout rows."""
        selection, sums = m2po_correction(delta, mask, advantages, self._correction_settings(mode))
        if record_offpolicy:
            self._record_offpolicy(mode, sums)
        return selection

    # --------------------------------------------------------------------------------------------- figures
    def _record_m2po_stats(self, mode: str, stats) -> None:
        """Adds one micro-batch's M2PO sums to the logging window (token-weighted over the window and every rank when
        logged). A micro-batch that kept no token is counted there and warned about when the window is logged
        (`_log_statistics`): reading the flag here would be a host sync per micro-batch."""
        self._statistics[mode].add("m2po", stats["sums"].detach().to(torch.float64))

    def _record_offpolicy(self, mode: str, sums: torch.Tensor) -> None:
        """One batch's `offpolicy_sums` (see `algorithms.offpolicy`) and its effective sample size, into the window."""
        sums = sums.detach().to(torch.float64)
        ess, has = batch_ess(sums)
        statistics = self._statistics[mode]
        statistics.add("offpolicy", sums)
        statistics.add("offpolicy_ess", torch.stack([ess, has]))
        statistics.add("offpolicy_ess_min", torch.where(has > 0, ess, torch.inf))

    def _record_row_ages(self, inputs: dict) -> None:
        """The age of every row entering this loss (the trainer's version minus its oldest token's version) and of
        every valid completion token, into the window's histogram (`offpolicy/row_age_*`, `offpolicy/token_age_mean`).
        Rollout rows only: an asynchronous training step."""
        if not self._async_training():
            return
        fields = rollout_view(inputs)
        max_age = int(async_field(self.args, "max_staleness") or 0)
        statistics = self._statistics["train"]
        statistics.add("row_ages", row_age_counts(self.state.global_step - fields["rollout_versions"], max_age))
        mask = self._loss_mask(inputs).bool()
        # Summed under the mask (not indexed by it: a boolean index is a host sync).
        token_ages = torch.where(mask, self.state.global_step - fields["rollout_token_versions"], 0).double()
        statistics.add("token_ages", torch.stack([token_ages.sum(), mask.sum().double()]))

    def _record_correction(self, mode: str, correction: BehaviourCorrection) -> None:
        """A batch's correction figures into the window: `offpolicy/*`, and TRL's `sampling/importance_sampling_ratio/*`
        for the weights it applied."""
        self._record_offpolicy(mode, correction.offpolicy_sums)
        if correction.weight_sums is not None:
            statistics = self._statistics[mode]
            statistics.add("importance_weights", correction.weight_sums)
            statistics.add("importance_weights_min", correction.weight_min)
            statistics.add("importance_weights_max", correction.weight_max)

    def _record_token_mean(self, mode: str, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        """A per-token figure (`entropy`, `kl`), token-weighted over the window and every rank when logged."""
        mask = mask.to(values.dtype)
        self._statistics[mode].add(f"token_mean/{name}", torch.stack([(values.detach() * mask).sum(), mask.sum()]))

    @staticmethod
    def _loss_mask(inputs: dict) -> torch.Tensor:
        mask = inputs["completion_mask"]
        return mask if inputs.get("tool_mask") is None else mask * inputs["tool_mask"]

    def _dapo_normalizer(self, inputs: dict, mode: str) -> torch.Tensor:
        """TRL `dapo`'s normaliser: the valid tokens of the whole accumulated batch, per process, so that the summed
        micro-batch losses are token means over the optimizer batch (and DDP's gradient mean over all tokens)."""
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        return normalizer

    # --------------------------------------------------------------------------------------------- checkpoints
    def _save_checkpoint(self, model, trial):
        """`GRPOTrainer._save_checkpoint`, plus:

        * the position of every rank's prompt stream (`trl_async_rollout.json`, with the run's batch settings, checked
          on resume), so that a resumed run trains on the batch that comes next, with the same per-batch seeds;
        * a save that is either complete or known to be partial (`trl_async.trainers.checkpoints`): marked incomplete before its
          first file, complete once every rank wrote its files, and older checkpoints rotated away (Trainer's
          `save_total_limit`, held back during Trainer's save, which rotates at its end) only then;
        * a write that fails (a full disk, a read-only folder) raises `CheckpointSaveError` naming the folder."""
        with self._timeline.span(span.SAVE_CHECKPOINT):
            self._write_checkpoint(model, trial)

    def _write_checkpoint(self, model, trial) -> None:
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
                checkpoints.write_rollout_state(states, folder)  # (module attribute: the fault tests wrap it)
        self.accelerator.wait_for_everyone()  # every rank's files (its RNG state) are written
        if self.args.should_save:
            finish_save(folder)
            rotate(run_dir, limit, self.state.best_model_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint):
        """`GRPOTrainer._load_optimizer_and_scheduler` (called only when resuming), plus the prompt stream's saved
        position for this rank's generation process."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            state = rank_rollout_state(checkpoint, self.accelerator.process_index)
            if state is None and async_field(self.args, "async_generation"):
                logger.warning(
                    "trl_async: %s has no %s (written by a synchronous run?); the prompt stream restarts from its "
                    "first batch.", checkpoint, ROLLOUT_STATE_FILE
                )  # fmt: skip
            self._rollout.restore(state)

    # --------------------------------------------------------------------------------------------- metrics
    def _statistics_fields(self) -> list[Field]:
        """The layout of the trainers' figures (`trainers.statistics`), from the config alone; subclasses add theirs."""
        return trainer_fields(max_age=int(async_field(self.args, "max_staleness") or 0))

    def _reduce_statistics(self, mode: str) -> None:
        """Every rank's figures of the window, combined (one collective: call it on every rank at the same point)."""
        statistics = self._statistics[mode]
        if mode == "train" and self._rollout_started():
            record_async_window(statistics, self._rollout.window_metrics())
        statistics.reduce(gather)

    def evaluation_loop(self, *args, **kwargs):
        """`Trainer.evaluation_loop`, then the reduction of the evaluation's figures over the ranks (every rank runs
        the loop; `evaluate` logs right after it)."""
        output = super().evaluation_loop(*args, **kwargs)
        self._reduce_statistics("eval")
        return output

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """`GRPOTrainer.log`, plus the trainers' own metrics of the logging window (`async/*`, `offpolicy/*`,
        `m2po/*`, `ppo/*`, the importance-weight and completion figures), computed from window totals over every rank
        (TRL averages the values appended during the window; a mean of per-batch fractions or maxima would not mean
        what the names say). No communication: the totals were reduced where every rank passes (`_ReduceStatistics`,
        `evaluation_loop`), so a `log` on one rank alone is as safe as TRL's."""
        started = self._timeline.begin()
        mode = "train" if self.model.training else "eval"
        totals = self._statistics[mode].take()
        if totals is not None:
            self._log_statistics(mode, totals)
        super().log(logs, start_time)
        self._timeline.end(span.LOG, started)
        self._timeline.maybe_flush()
        writer = self.__dict__.get("_timeline_writer")
        if writer is not None:
            with contextlib.suppress(OSError):
                writer.maybe_write()  # now and then (`TimelineWriter`): a killed run still leaves a timeline

    def _log_statistics(self, mode: str, totals: dict[str, torch.Tensor]) -> None:
        """The window's totals over every rank -> metrics in `self._metrics[mode]`, and the row-age histogram to the
        trackers that take one. Subclasses add theirs after `super()`."""
        for key, value in trainer_metrics(totals, self.accelerator.num_processes).items():
            self._metrics[mode][key] = [value]
        if self.accelerator.is_main_process:
            warn_of_m2po_masked_micro_batches(totals, getattr(self.args, "m2po_threshold", None))
        counts = {age: count for age, count in enumerate(totals["row_ages"].tolist()) if count}
        if self.accelerator.is_main_process and counts:
            log_histogram_to_trackers(self.callback_handler.callbacks, "offpolicy/row_age", counts,
                                      self.state.global_step)  # fmt: skip

    def _log_completion_lengths(self, payload) -> None:
        """The completion metrics of TRL's `_generate`, for rows that did not go through it: this rank's sums go to the
        window (`trainers.statistics.completion_sums`). The tokens seen are counted at once, as TRL counts them (they
        are saved with checkpoints): one all-reduce per rollout batch, on every rank. Like TRL, only the tokens the
        model sampled count (not a tool's)."""
        model_tokens = model_token_counts(payload)
        tokens = sum(len(p) for p in payload.prompt_ids) + sum(model_tokens)
        tokens = self.accelerator.reduce(torch.tensor([tokens], device=self.accelerator.device), reduction="sum")
        self.state.num_input_tokens_seen += int(tokens.item())
        self._metrics["train"]["num_tokens"] = [self.state.num_input_tokens_seen]
        record_completions(
            self._statistics["train"],
            payload.completion_ids,
            {*self.eos_token_ids, self._tokenizer.pad_token_id},
            lengths=model_tokens,
        )
