"""`AsyncGRPOTrainer`: TRL's `GRPOTrainer` with generation in a background process and the M2PO loss.

What changes compared with `GRPOTrainer`, and where (each override calls TRL's method wherever it can):

* `get_train_dataloader` (training, async): the dataloader only paces the training loop (lengths, epochs, resume
  bookkeeping stay TRL's); the rows come from the rollout component, whose generation process owns the prompt stream.
* `_generate_and_score_completions` (training, async): takes the next batch from the rollout component (fresh enough
  on every rank, stale ones skipped and counted), runs TRL's own method on its rows, then tags the rows with their
  policy version and, for TRL's loss types, applies TRL's importance correction against the behaviour log-probs.
* `_generate` / `_calculate_rewards`: return what the generation process sampled and scored (reward *models* are
  scored here, by TRL's own code, on the decoded completions).
* `_compute_loss`: adds `loss_type="m2po"`; for TRL's loss types it is TRL's, with the importance weight computed from
  TRL's own forward when the batch is used within one optimizer step.
* `log`: adds the `async/*` metrics of the logging window; `_save_checkpoint` / `_load_optimizer_and_scheduler`:
  save and restore the prompt stream's position, and mark a checkpoint incomplete until every file of it is written
  (`trl_async.checkpoints`); `train`: stops the generation process on every exit path (SIGTERM included) and resumes
  only from complete checkpoints.

Evaluation (`model.eval()`) and `async_generation=False` use TRL's synchronous path unchanged.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import shutil
import weakref

import torch
from accelerate.utils import DistributedType, gather, gather_object
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.grpo_trainer import logger as trl_logger

from .checkpoints import (
    CheckpointSaveError,
    begin_save,
    check_resumable,
    finish_save,
    last_complete_checkpoint,
    rotate,
)
from .config import async_field, ensure_async_fields, micro_steps_per_generation
from .hub import ModelCardMixin
from .importance import fold_into_advantages, truncated_importance_weights
from .losses import m2po_loss, m2po_metrics, m2po_select_global, reference_m2po_loss
from .rewards import is_tensor_reward
from .rollout import GeneratorSpec, ModelSpec
from .rollout.client import RolloutClient, RolloutSettings
from .rollout.generator import warm_up_generator_start
from .rollout.placement import Placement, choose_placement, rank_cores
from .rollout.prompts import is_iterable_dataset
from .rollout.termination import exit_on_sigterm
from .shared_prompt import pack_prompt_groups, prefix_forward, prefix_survives_checkpointing, split_prompt_prefix
from .unsupported import check_async_supported, check_m2po_supported

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _naming_failed_writes(folder: str, run_dir: str):
    """Re-raise an error from writing checkpoint `folder` as `CheckpointSaveError`, naming the folder (torch's and
    safetensors' write errors name no file) and what is left."""
    try:
        yield
    except Exception as error:
        previous = last_complete_checkpoint(run_dir)
        try:
            free = f" ({shutil.disk_usage(run_dir).free / 2**20:.1f} MiB free on its disk)"
        except OSError:
            free = ""
        raise CheckpointSaveError(
            f"Saving the checkpoint {folder} failed: {type(error).__name__}: {error}. If the disk is full{free} or the "
            f"folder is not writable, free space or choose another output_dir. {folder} stays marked incomplete and is "
            "never resumed from; "
            + (
                f"the previous complete checkpoint, {previous}, is intact."
                if previous
                else "there is no earlier checkpoint."
            )
        ) from error


class _PublishWeights(TrainerCallback):
    """Publishes the policy to the generation process after each optimizer step (every `weight_sync_steps`)."""

    def __init__(self, trainer: AsyncGRPOTrainer):
        self._trainer = weakref.ref(trainer)

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None and trainer._rollout_started():
            model = trainer._unwrap(trainer.model)
            seconds = trainer._rollout.publish(model, state.global_step, state)
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


class AsyncGRPOTrainer(ModelCardMixin, GRPOTrainer):
    """Drop-in replacement for `trl.GRPOTrainer` that generates asynchronously and supports `loss_type="m2po"`.

    It takes exactly `GRPOTrainer`'s arguments. `args` may be a plain `trl.GRPOConfig` (the async defaults of
    `AsyncGRPOConfig` then apply) or an `AsyncGRPOConfig`.
    """

    _tag_names = ["trl", "grpo", "trl-async"]
    model_card_kind = "grpo"  # the card: trl_async.hub.ModelCardMixin

    def __init__(self, model, reward_funcs=None, args=None, *positional, **kwargs):
        bound = inspect.signature(GRPOTrainer.__init__).bind(None, model, reward_funcs, args, *positional, **kwargs)
        if args is None:  # TRL's default, created here so that the async checks below see it
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = GRPOConfig(f"{str(name).split('/')[-1]}-GRPO")
            bound.arguments["args"] = args
        ensure_async_fields(args)
        check_m2po_supported(args, model)
        if args.async_generation and args.use_vllm:
            # TRL's vLLM generation runs in the training process; ours runs in the generation process. Same knobs.
            logger.info("trl_async: use_vllm=True runs vLLM in the generation process (generation_backend='vllm').")
            args.generation_backend, args.use_vllm = "vllm", False
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
            if args.generation_backend == "hf":  # the generation process's imports, while TRL builds the trainer
                warm_up_generator_start()
        # Wrappers (DDP, compiled modules) -> the bare model, see `_unwrap`; weak: a re-prepared model drops its old wrapper.
        self._unwrapped_models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        super().__init__(*bound.args[1:], **bound.kwargs)
        self._m2po_window: dict[str, torch.Tensor] = {}  # M2PO token sums of the logging window, per mode
        self._rollout = RolloutClient(
            RolloutSettings(
                max_staleness=self.args.max_staleness,
                micro_steps_per_item=micro_steps_per_generation(self.args),
                micro_steps_per_version=self.args.gradient_accumulation_steps,
                queue_capacity=self.args.queue_capacity,
                weight_sync_steps=self.args.weight_sync_steps,
                trainer_generates_while_starting=self.args.trainer_generates_while_starting,
                startup_timeout=self.args.generator_startup_timeout,
                heartbeat_timeout=self.args.generator_heartbeat_timeout,
            ),
            all_reduce_max=self._all_reduce_max if self.accelerator.num_processes > 1 else None,
        )
        if self.args.async_generation:
            self.add_callback(_PublishWeights(self))
            if self.args.generation_backend == "vllm":
                import importlib.util

                from .rollout.vllm_backend import sampling_kwargs

                if self.args.vllm_mode != "server" and importlib.util.find_spec("vllm") is None:
                    raise ImportError(
                        "generation_backend='vllm' (or use_vllm=True) needs vLLM in this environment: `pip install "
                        "trl-async[vllm]` on GPUs; on CPUs follow docs/vllm.md (`bash .ci/vllm_env.sh`). Or set "
                        "generation_backend='hf'."
                    )
                # A sampling setting vLLM cannot honour fails here, before any process starts.
                sampling_kwargs(
                    self.generation_config, self.temperature, list(self.eos_token_ids), self.args.generation_kwargs
                )

    # --------------------------------------------------------------------------------------------- lifecycle
    def _unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """`accelerator.unwrap_model(model)`, computed once per wrapper: it checks every submodule for compiled regions
        (~1 ms on the tiny model), and the rollout path needs the bare model several times a step."""
        unwrapped = self._unwrapped_models.get(model)
        if unwrapped is None:
            unwrapped = self._unwrapped_models[model] = self.accelerator.unwrap_model(model)
        return unwrapped

    def _async_training(self) -> bool:
        return bool(async_field(self.args, "async_generation")) and self.model.training

    def _serving_batch(self):
        """The rollout batch TRL's scoring code is working on, if any (None for TRL's own generation, and for a
        trainer object built without `__init__`, as TRL's unit tests build them)."""
        rollout = self.__dict__.get("_rollout")
        return None if rollout is None else rollout.current

    def _rollout_started(self) -> bool:
        rollout = self.__dict__.get("_rollout")
        return rollout is not None and rollout.started

    def _all_reduce_max(self, value: int) -> int:
        return int(gather(torch.tensor([value], device=self.accelerator.device)).max().item())

    def _placement(self) -> Placement:
        """Where this rank's generation process runs, and the split of the rank's thread budget (`OMP_NUM_THREADS`,
        an earlier `torch.set_num_threads`, or its cores) between it and the trainer (`rollout.placement`)."""
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.accelerator.num_processes))
        placement = choose_placement(
            self.args.generation_device,
            self.accelerator.device,
            self.args.generation_num_threads,
            rank_cores(local_world),
            os.environ.get("OMP_NUM_THREADS"),
            lend_idle_cores=self.args.lend_idle_cores,
            torch_threads=torch.get_num_threads(),
        )
        if placement.note is not None:
            logger.warning(placement.note)
        elif placement.budget is not None:
            logger.info(
                "trl_async: thread budget %d (%s): %d for the trainer, %d for its generation process",
                placement.budget, placement.budget_source, placement.trainer_threads, placement.generator_threads,
            )  # fmt: skip
        return placement

    def _generator_spec(self, placement: Placement) -> GeneratorSpec:
        """What this rank's generation process needs: TRL's sampling settings, prompt order and reward callables."""
        args = self.args
        model = self.accelerator.unwrap_model(self.model)
        is_peft = hasattr(model, "peft_config") and hasattr(model, "get_base_model")
        base = model.get_base_model() if is_peft else model
        reward_models = [isinstance(f, torch.nn.Module) and not is_tensor_reward(f) for f in self.reward_funcs]
        any_text_reward = any(
            not is_tensor_reward(f) and not m for f, m in zip(self.reward_funcs, reward_models, strict=True)
        )
        columns = None
        if args.remove_unused_columns and not is_iterable_dataset(self.train_dataset):
            import datasets

            if isinstance(self.train_dataset, datasets.Dataset):  # what `Trainer` would have removed
                self._set_signature_columns_if_needed()
                columns = list(self._signature_columns)
        return GeneratorSpec(
            process_index=self.accelerator.process_index,
            num_processes=self.accelerator.num_processes,
            device=placement.device,
            num_threads=placement.generator_threads,
            backend=self._backend_name(),
            backend_options=self._backend_options(placement),
            model_spec=ModelSpec(
                config=base.config,
                dtype=next(base.parameters()).dtype,
                peft_config=model.peft_config[model.active_adapter] if is_peft else None,
                adapter_name=model.active_adapter if is_peft else "default",
                generation_defaults=getattr(base, "generation_config", None),
            ),
            generation_config=self.generation_config,
            temperature=self.temperature,
            eos_token_ids=list(self.eos_token_ids),
            pad_token_id=self._tokenizer.pad_token_id,
            processing_class=self.processing_class,
            chat_template=self.chat_template,
            chat_template_kwargs=dict(self.chat_template_kwargs or {}),
            dataset=self.train_dataset,
            num_generations=self.num_generations,
            generation_batch_size=args.generation_batch_size,
            shuffle=self.shuffle_dataset,
            seed=args.seed,
            reward_funcs=[
                None if is_model else f for f, is_model in zip(self.reward_funcs, reward_models, strict=True)
            ],
            reward_func_names=list(self.reward_func_names),
            decode=bool(args.log_completions) or any(reward_models) or any_text_reward,
            parent_pid=os.getpid(),
            columns=columns,
        )

    def _backend_name(self) -> str:
        if self.args.generation_backend == "vllm":
            return "vllm-server" if self.args.vllm_mode == "server" else "vllm"
        return self.args.generation_backend

    def _backend_options(self, placement: Placement) -> dict:
        """TRL's vLLM knobs, honoured by the vLLM backends (docs/vllm.md has the table)."""
        args = self.args
        if args.generation_backend != "vllm":
            return {}
        if args.vllm_mode == "server":
            return dict(
                base_url=args.vllm_server_base_url,
                host=args.vllm_server_host,
                port=args.vllm_server_port,
                group_port=args.vllm_group_port,
                connection_timeout=args.vllm_server_timeout,
                sampling_overrides=args.generation_kwargs,
            )
        engine_kwargs = {"model_impl": args.vllm_model_impl} if args.vllm_model_impl != "vllm" else {}
        if args.vllm_enable_sleep_mode:
            engine_kwargs["enable_sleep_mode"] = True
        options = dict(
            max_model_len=args.vllm_max_model_length,
            tensor_parallel_size=args.vllm_tensor_parallel_size,
            engine_seed=args.seed,
            sampling_overrides=args.generation_kwargs,
            engine_kwargs=engine_kwargs or None,
        )
        if torch.device(placement.device).type == "cuda":  # on CPU vLLM sizes its KV cache in bytes instead
            options["gpu_memory_utilization"] = args.vllm_gpu_memory_utilization
        return options

    def close_rollout(self) -> None:
        """Stop this rank's generation process (idempotent). Called automatically when `train()` returns/raises."""
        self._rollout.close()

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """`Trainer.train`, plus: the generation process is stopped on return, exception, Ctrl-C or SIGTERM
        (`rollout.termination`); `resume_from_checkpoint=True` picks the newest *complete* checkpoint, where
        transformers' `get_last_checkpoint` would pick the newest folder, and a path to a partial one is refused
        (`trl_async.checkpoints`)."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        elif isinstance(resume_from_checkpoint, str):
            check_resumable(resume_from_checkpoint)
        with exit_on_sigterm(f"the trainer of rank {self.accelerator.process_index}"):
            try:
                return super().train(resume_from_checkpoint, *args, **kwargs)
            finally:
                self.close_rollout()

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
        """Policy version at which the generation batch about to be built is last used (see `config.usage_span`)."""
        micro_step, group = self._step, micro_steps_per_generation(self.args)
        a = self.args.gradient_accumulation_steps
        return self.state.global_step + (micro_step + group - 1) // a - micro_step // a

    # --------------------------------------------------------------------------------------------- overrides
    def _generate_and_score_completions(self, inputs):
        """In async training, replaces the rows TRL's dataloader handed over (placeholders) with the next rollout batch
        and runs `GRPOTrainer._generate_and_score_completions` on it. Then, for queue rows:

        * adds `rollout_versions` (B,), the policy version that generated each row;
        * for TRL's loss types with `max_staleness > 0`, where TRL computed `old_per_token_logps` (a batch trained on
          across several optimizer steps), applies TRL's truncated importance weight π_old/μ now; otherwise
          `_compute_loss` computes it from its own forward (π_old is then π_θ, detached).
        """
        if not self._async_training():
            return super()._generate_and_score_completions(inputs)
        if not self._rollout.started:
            placement = self._placement()
            self._rollout.start(
                self._generator_spec(placement),
                self._unwrap(self.model),
                version=self.state.global_step,
                trainer_state=self.state,
                placement=placement,
            )
        batch = self._rollout.next_batch(
            self._last_use_version(), self._unwrap(self.model), current_version=self.state.global_step
        )
        with self._rollout.serving(batch):
            output = super()._generate_and_score_completions(batch.payload["rows"])
        output["rollout_versions"] = torch.full(
            (output["completion_ids"].size(0),), batch.version, device=output["completion_ids"].device
        )
        if self._corrects_behaviour(output) and "old_per_token_logps" in output:
            self._apply_behaviour_correction(output, output["old_per_token_logps"])
        return output

    def _generate(self, prompts: list):
        """Replaces `GRPOTrainer._generate` for a rollout batch: its completions were sampled (and decoded only if a
        text reward, a reward model or completion logging needs them) by the producer. TRL's completion-length metrics
        are logged the same way. Otherwise (evaluation, synchronous mode) it is TRL's."""
        batch = self._serving_batch()
        if batch is None:
            return super()._generate(prompts)
        payload = batch.payload
        prompt_ids, completion_ids = payload["prompt_ids"], payload["completion_ids"]
        completions = payload["completions"]
        if completions is None:  # not decoded: nothing reads them (no text reward, no completion logging)
            completions = [""] * len(completion_ids)
        self._log_completion_lengths(prompt_ids, completion_ids)
        return prompt_ids, completion_ids, None, completions, payload["logprobs"], {}, None, []

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """Replaces `GRPOTrainer._calculate_rewards` for a rollout batch: the reward callables already ran in the
        producer (with `trainer_state`, `log_extra` and `log_metric`; their log calls are replayed here, so they reach
        TRL's logs exactly as in TRL); reward models (`nn.Module`s) are scored here by TRL's own code on the decoded
        completions. Returns the same thing as TRL: rewards per function, gathered across processes."""
        batch = self._serving_batch()
        if batch is None:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        payload = batch.payload
        for column, values in payload["extra_logs"].items():
            self._log_completion_extra(column, values)
        for name, values in payload["logged_metrics"].items():
            for value in values:
                self._log_metric(name, value)
        local = payload["rewards_per_func"].to(self.accelerator.device)
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
        left to score, so TRL's code runs on that subset (and nothing of it is copied here)."""
        saved = self.reward_funcs, self.reward_processing_classes, self.reward_func_names
        self.reward_funcs = [saved[0][i] for i in columns]
        self.reward_processing_classes = [saved[1][i] for i in columns]
        self.reward_func_names = [saved[2][i] for i in columns]
        try:
            yield
        finally:
            self.reward_funcs, self.reward_processing_classes, self.reward_func_names = saved

    # --------------------------------------------------------------------------------------------- importance
    def _corrects_behaviour(self, inputs: dict) -> bool:
        """TRL's loss types get TRL's importance correction against μ when rows can be stale (`max_staleness > 0`)."""
        return (
            "rollout_versions" in inputs
            and "sampling_per_token_logps" in inputs
            and self.loss_type != "m2po"
            and bool(self.args.vllm_importance_sampling_correction)
            and (async_field(self.args, "max_staleness") or 0) > 0
        )

    @torch.no_grad()
    def _apply_behaviour_correction(self, inputs: dict, old_logps: torch.Tensor) -> None:
        """TRL's truncated importance weight w = π_old/μ (`vllm_importance_sampling_*` semantics), applied as TRL
        applies it to its vLLM rows. VESPO takes the ratio inside φ (`importance_sampling_ratio`, as TRL feeds it);
        every other TRL loss multiplies its per-token policy loss by w, which equals scaling the advantages by w
        (each policy term is positively homogeneous in A, and w ≥ 0; `importance.py` gives the case-by-case proof)."""
        mask = (
            inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
        )
        args = self.args
        weights = truncated_importance_weights(
            old_logps,
            inputs["sampling_per_token_logps"],
            mask,
            mode=args.vllm_importance_sampling_mode,
            clip_min=args.vllm_importance_sampling_clip_min,
            clip_max=args.vllm_importance_sampling_clip_max,
        )
        if self.loss_type == "vespo":
            inputs["importance_sampling_ratio"] = weights
        else:
            inputs["advantages"] = fold_into_advantages(inputs["advantages"], weights)
        flat = weights.flatten() if weights.size(1) == 1 else weights[mask.bool()]
        if flat.numel():
            # Weights the truncation changed: set to 0 (mask modes) or clamped to a bound (truncate modes; a ratio
            # exactly on a bound has probability zero).
            bounds = [b for b in (args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max) if b]
            clipped = (
                (flat == 0)
                if args.vllm_importance_sampling_mode.endswith("mask")
                else torch.isin(flat, torch.tensor(bounds, dtype=flat.dtype, device=flat.device))
            )
            stats = torch.stack(
                [flat.mean(), flat.min(), flat.max(), (flat == 0).float().mean(), clipped.float().mean()]
            )
            mean, low, high, zero, changed = gather(stats.unsqueeze(0)).view(-1, 5).T
            metrics = self._metrics["train"]
            metrics["sampling/importance_sampling_ratio/mean"].append(mean.mean().item())
            metrics["sampling/importance_sampling_ratio/min"].append(low.min().item())
            metrics["sampling/importance_sampling_ratio/max"].append(high.max().item())
            metrics["sampling/importance_sampling_ratio/masked_fraction"].append(zero.mean().item())
            metrics["sampling/importance_sampling_ratio/clipped_fraction"].append(changed.mean().item())

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
        """Replaces TRL's forward, for a text batch whose rows share prompts (GRPO's groups), by one that computes each
        prompt once, not `num_generations` times (`shared_prompt.py`; same log-probs and gradients). Short
        completions: one packed sequence per prompt group. Long ones, where packing saves under 20% of the tokens:
        the prompts as a key/value prefix that the completions attend to (only for a model not wrapped for
        distributed training, which must see one forward per backward). It calls the model as TRL does (fused LM
        head, labels, autocast). Otherwise (`shared_prompt_forward`, multimodal inputs, an MoE load-balancing loss,
        an attention kernel that takes no dense mask, or too small a saving) it is `super()`."""
        packing = self._shared_prompt_forward(model)
        if packing is None or compute_aux_loss or any(v is not None for v in multimodal_inputs.values()):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal_inputs,
            )  # fmt: skip
        attn_implementation, dtype = packing
        batch_size = batch_size or input_ids.size(0)
        all_logps, all_entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):  # TRL's chunks, each packed on its own
            ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
            packed = pack_prompt_groups(ids, mask, logits_to_keep)
            if packed is not None:
                with self.accelerator.autocast():
                    outputs = model(
                        input_ids=packed.input_ids,
                        attention_mask=packed.attention_mask(attn_implementation, dtype),
                        position_ids=packed.position_ids,
                        labels=packed.labels,
                        fused_lm_head=True,
                    )
                logps = packed.unpack(outputs.log_probs)
                entropies = packed.unpack(outputs.entropy) if compute_entropy else None
            elif (
                outputs := self._prefix_forward(model, ids, mask, logits_to_keep, attn_implementation, dtype)
            ) is not None:
                logps, entropies = outputs.log_probs, outputs.entropy if compute_entropy else None
            else:
                logps, entropies, _ = super()._get_per_token_logps_and_entropies(
                    model, ids, mask, logits_to_keep, compute_entropy=compute_entropy
                )
            all_logps.append(logps)
            all_entropies.append(entropies)
        return torch.cat(all_logps), torch.cat(all_entropies) if compute_entropy else None, None

    def _prefix_forward(self, model, input_ids, attention_mask, logits_to_keep, attn_implementation, dtype):
        """TRL's fused-head outputs for the rows with each prompt run once as a key/value prefix
        (`shared_prompt.prefix_forward`), or None where that does not apply: too small a saving, a model wrapped for
        distributed training (DDP, FSDP, DeepSpeed reduce gradients per forward call, and this is two calls), a model
        with other than full-attention layers, or gradient checkpointing that would drop or detach the prefix
        (`prefix_survives_checkpointing`)."""
        unwrapped = self._unwrap(model)
        if self.accelerator.distributed_type != DistributedType.NO or unwrapped is not model:
            return None
        if set(getattr(unwrapped.config, "layer_types", None) or ["unknown"]) != {"full_attention"}:
            return None
        if torch.is_grad_enabled() and not prefix_survives_checkpointing(unwrapped):
            return None
        prefix = split_prompt_prefix(input_ids, attention_mask, logits_to_keep)
        if prefix is None:
            return None
        # PEFT's `PeftModel` API, duck-typed as in `_generator_spec`: `unwrapped` is already bare, and accelerate's
        # `is_peft_model` unwraps again and re-reads package metadata (~2 ms at every training step).
        backbone = (unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped).base_model
        with self.accelerator.autocast():
            return prefix_forward(model, backbone, prefix, attn_implementation, dtype)

    def _shared_prompt_forward(self, model) -> tuple[str, torch.dtype] | None:
        """(attention implementation, dtype) when the packed forward applies to `model`, else None."""
        mode = async_field(self.args, "shared_prompt_forward")
        if mode == "off" or (mode == "auto" and self.accelerator.device.type != "cpu"):
            return None
        config = getattr(self._unwrap(model), "config", None)
        attn_implementation = getattr(config, "_attn_implementation", None)
        if attn_implementation not in ("sdpa", "eager") or config.get_text_config() is not config:
            return None  # flash / flex kernels take no dense mask; a vision-language model's inputs are not all text
        return attn_implementation, next(model.parameters()).dtype

    @contextlib.contextmanager
    def _observe_policy_logps(self, observe):
        """Calls `observe(per_token_logps)` on the log-probs of the next `_get_per_token_logps_and_entropies` call,
        before TRL's `_compute_loss` reads the advantages: the importance weight needs π_old, which within one
        optimizer step is exactly TRL's own π_θ (detached), so no extra forward is needed."""
        compute = self._get_per_token_logps_and_entropies

        def observed(*args, **kwargs):
            out = compute(*args, **kwargs)
            del self._get_per_token_logps_and_entropies  # one call only: back to the class's method
            observe(out[0].detach())
            return out

        self._get_per_token_logps_and_entropies = observed
        try:
            yield
        finally:
            self.__dict__.pop("_get_per_token_logps_and_entropies", None)

    def _compute_loss(self, model, inputs):
        """Adds `loss_type="m2po"` to `GRPOTrainer._compute_loss`. Every other loss type is TRL's; for rollout rows
        that still need TRL's importance correction (see `_generate_and_score_completions`), the weight is taken from
        TRL's own forward in this call."""
        if self.loss_type == "m2po":
            return self._compute_m2po_loss(model, inputs)
        if self.model.training and self._corrects_behaviour(inputs) and "old_per_token_logps" not in inputs:
            inputs = dict(inputs)  # the buffered batch stays unweighted
            with self._observe_policy_logps(lambda logps: self._apply_behaviour_correction(inputs, logps)):
                return super()._compute_loss(model, inputs)
        return super()._compute_loss(model, inputs)

    # --------------------------------------------------------------------------------------------- M2PO
    def _compute_m2po_loss(self, model, inputs):
        """M2PO (Zheng et al. 2025, arXiv 2510.01161), the math in `trl_async.losses`.

        δ_t = log π_θ − log μ against the behaviour policy μ: the sampling log-probs of the generator when present,
        else TRL's `old_per_token_logps`, else π_θ itself (an on-policy batch: δ = 0, nothing masked). The
        normalizer is TRL `dapo`'s: valid tokens of the whole accumulated batch, per process.
        """
        args, mode = self.args, "train" if self.model.training else "eval"
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        per_token_logps, entropies, _ = self._get_per_token_logps_and_entropies(
            model,
            torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([prompt_mask, completion_mask], dim=1),
            completion_ids.size(1),
            compute_entropy=True,
        )
        behaviour = inputs.get("sampling_per_token_logps")
        if behaviour is None:
            behaviour = inputs.get("old_per_token_logps")
        if behaviour is None:
            behaviour = per_token_logps.detach()
        advantages = inputs["advantages"]
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * self.current_gradient_accumulation_steps / args.steps_per_generation
        if args.m2po_variant == "m2po":
            floors = dict(clip_floor_low=args.m2po_clip_floor_low, clip_floor_high=args.m2po_clip_floor_high)
            selection = None
            if args.m2po_scope == "global" and mode == "train":
                # The whole optimizer batch (gradient_accumulation_steps=1: this micro-batch on every rank).
                adv = advantages.detach().unsqueeze(1) if advantages.dim() == 1 else advantages.detach()
                selection = m2po_select_global(
                    per_token_logps.detach() - behaviour, mask, args.m2po_threshold, adv, args.m2po_rule, **floors
                )
            loss, stats = m2po_loss(
                per_token_logps, behaviour, advantages, mask, threshold=args.m2po_threshold, normalizer=normalizer,
                rule=args.m2po_rule, selection=selection, **floors,
            )  # fmt: skip
        else:
            loss, stats = reference_m2po_loss(
                per_token_logps,
                behaviour,
                advantages,
                mask,
                gamma=args.m2po_gamma,
                epsilon_low=self.epsilon_low,
                epsilon_high=self.epsilon_high,
            )
            if mode == "train":
                loss = loss / self.current_gradient_accumulation_steps
        metrics = self._metrics[mode]
        if self.beta != 0.0:
            ref = inputs["ref_per_token_logps"]
            per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
            loss = loss + self.beta * (per_token_kl * mask).sum() / normalizer
            metrics["kl"].append(self._global_masked_mean(per_token_kl, mask))
        metrics["entropy"].append(self._global_masked_mean(entropies, mask))
        self._record_m2po_stats(mode, stats)
        return loss

    def _record_m2po_stats(self, mode: str, stats: dict) -> None:
        """Adds one micro-batch's M2PO sums to the logging window (token-weighted over the window and every rank; see
        `log`: sums here, ratios when logged), and warns when M2PO masked every token of it."""
        sums = self.accelerator.reduce(stats["sums"].detach().to(torch.float64), reduction="sum")
        self._m2po_window[mode] = sums if self._m2po_window.get(mode) is None else self._m2po_window[mode] + sums
        if sums[-1] > 0:
            logger.warning(
                "M2PO masked every token of a micro-batch (its smallest δ² exceeds m2po_threshold=%s): it contributes "
                "no gradient. Frequent occurrences mean the rollouts are far off-policy; lower max_staleness.",
                self.args.m2po_threshold,
            )

    def _global_masked_mean(self, values: torch.Tensor, mask: torch.Tensor) -> float:
        totals = self.accelerator.reduce(torch.stack([(values * mask).sum(), mask.sum().float()]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    # --------------------------------------------------------------------------------------------- checkpoints
    def _save_checkpoint(self, model, trial):
        """`GRPOTrainer._save_checkpoint`, plus:

        * the position of every rank's prompt stream (`trl_async_rollout.json`), so that a resumed run trains on the
          batch that comes next, with the same per-batch seeds;
        * a save that is either complete or known to be partial (`trl_async.checkpoints`): marked incomplete before its
          first file, complete once every rank wrote its files, and older checkpoints rotated away (Trainer's
          `save_total_limit`) only then, so an interruption at any point leaves the previous complete checkpoint;
        * a write that fails (a full disk, a read-only folder) raises `CheckpointSaveError` naming the folder."""
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        limit = self.args.save_total_limit
        with _naming_failed_writes(folder, run_dir):
            if self.args.should_save:
                begin_save(folder)
            self.args.save_total_limit = None  # Trainer's rotation, held back until this checkpoint is complete
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self.args.save_total_limit = limit
        states = (
            gather_object([self._rollout.checkpoint_state(self.state.global_step)])
            if self._rollout_started()
            else None
        )
        with _naming_failed_writes(folder, run_dir):
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
                    "first batch.", checkpoint, "trl_async_rollout.json"
                )  # fmt: skip
            self._rollout.restore(state)

    # --------------------------------------------------------------------------------------------- metrics
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """`GRPOTrainer.log`, plus the `async/*` and `m2po/*` metrics of the logging window, computed from window
        totals (TRL averages the values appended during the window; a mean of per-batch fractions or maxima would not
        mean what the names say): `m2po/*` are token-weighted over the window and every rank, and
        `m2po/all_masked_batches` is a count."""
        mode = "train" if self.model.training else "eval"
        if self.model.training and self._rollout_started():
            self._log_async_window()
        window = self.__dict__.get("_m2po_window", {}).pop(mode, None)
        if window is not None:
            for key, value in m2po_metrics(window).items():
                self._metrics[mode][f"m2po/{key}"] = [value]
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
