"""`AsyncGRPOTrainer`: TRL's `GRPOTrainer` with generation in a background process and the M2PO loss.

What changes compared with `GRPOTrainer`, and where:

* `_generate` (training mode only): instead of generating in the training process, take the next generation batch
  from the staleness-bounded queue that this rank's generation process fills. The rows were sampled, scored and
  (only if a text reward or completion logging needs it) decoded in that process.
* `_calculate_rewards`: return the rewards the generation process computed; TRL's own advantage code then runs
  unchanged on them.
* `_generate_and_score_completions`: calls TRL's, then applies the importance correction against the behaviour
  policy (for TRL's loss types) and tags rows with their policy version.
* `_compute_loss`: adds `loss_type="m2po"`; every other loss type is TRL's.
* `train`: stops the generation process on every exit path. A callback publishes weights after optimizer steps.

Evaluation (`model.eval()`) always uses TRL's synchronous path.
"""

from __future__ import annotations

import logging
import os
import time
import weakref

import torch
from accelerate.utils import gather
from transformers import TrainerCallback
from trl import GRPOTrainer

from .config import (
    ensure_async_fields,
    micro_steps_per_generation,
)
from .hub import ModelCardMixin
from .importance import fold_into_advantages, truncated_importance_weights
from .losses import m2po_loss, reference_m2po_loss
from .rewards import is_tensor_reward
from .rollout import GenerationProcess, GeneratorSpec, ModelSpec, SharedWeightStore, StalenessBoundedQueue
from .rollout.weights import named_frozen_parameters, named_trainable_parameters

logger = logging.getLogger(__name__)


class _PublishWeights(TrainerCallback):
    """Publishes the policy to the generation process after optimizer steps (every `weight_sync_steps`)."""

    def __init__(self, trainer: AsyncGRPOTrainer):
        self._trainer = weakref.ref(trainer)

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None:
            trainer._publish_weights(state.global_step)


class _Rollout:
    """The trainer-side pieces of asynchronous generation for one rank."""

    def __init__(self, process, rollout_queue, trainable_store, trainable_params):
        self.process = process
        self.queue = rollout_queue
        self.trainable_store = trainable_store
        self.trainable_params = trainable_params
        self.last_stats = rollout_queue.stats()
        self._finalizer = weakref.finalize(self, process.stop)

    def close(self):
        self._finalizer()


class AsyncGRPOTrainer(ModelCardMixin, GRPOTrainer):
    """Drop-in replacement for `trl.GRPOTrainer` that generates asynchronously and supports `loss_type="m2po"`.

    It takes exactly `GRPOTrainer`'s arguments. `args` may be a plain `trl.GRPOConfig` (the async defaults of
    `AsyncGRPOConfig` then apply) or an `AsyncGRPOConfig`.
    """

    _tag_names = ["trl", "grpo", "trl-async"]
    model_card_kind = "grpo"  # the card: trl_async.hub.ModelCardMixin

    def __init__(self, model, reward_funcs=None, args=None, *positional, **kwargs):
        if args is not None:
            ensure_async_fields(args)
        super().__init__(model, reward_funcs, args, *positional, **kwargs)
        ensure_async_fields(self.args)
        self._rollout: _Rollout | None = None
        self._rewards_from_generator: torch.Tensor | None = None
        self._rollout_item = None
        self._check_supported()
        if self.args.async_generation:
            self.add_callback(_PublishWeights(self))

    # --------------------------------------------------------------------------------------------- validation
    def _check_supported(self) -> None:
        args = self.args
        if self.loss_type == "m2po":
            unsupported = {
                "top_entropy_quantile < 1": self.top_entropy_quantile < 1.0,
                "an entropy bonus (entropy_coef)": getattr(self, "_entropy_bonus_enabled", False),
                "off_policy_mask_threshold": self.off_policy_mask_threshold is not None,
                "importance_sampling_level='sequence'": self.importance_sampling_level != "token",
                "a MoE router aux loss": self.aux_loss_enabled,
            }
            used = [name for name, on in unsupported.items() if on]
            if used:
                raise ValueError(f"loss_type='m2po' does not support {', '.join(used)}; disable it or use 'dapo'.")
        if not args.async_generation:
            return
        reasons = []
        if self.use_vllm:
            reasons.append("use_vllm=True (TRL's colocated/server vLLM generation)")
        if self.tools:
            reasons.append("tools")
        if self.environment_factories is not None:
            reasons.append("environment_factory")
        if self.rollout_func is not None:
            reasons.append("rollout_func")
        if self._is_vlm:
            reasons.append("vision-language models")
        if isinstance(self.train_dataset, torch.utils.data.IterableDataset) or not hasattr(
            self.train_dataset, "__getitem__"
        ):
            reasons.append("an iterable train_dataset (the generator needs to index prompts)")
        for func, name in zip(self.reward_funcs, self.reward_func_names, strict=True):
            if isinstance(func, torch.nn.Module):
                reasons.append(f"reward model {name!r} (only callables run in the generation process)")
        if reasons:
            raise ValueError(
                "Asynchronous generation does not support " + "; ".join(reasons) + ". Set async_generation=False "
                "in the config to run TRL's synchronous generation with these features."
            )

    # --------------------------------------------------------------------------------------------- lifecycle
    def _async_active(self) -> bool:
        return self.args.async_generation and self.model.training

    def _generation_placement(self) -> tuple[str, int]:
        args = self.args
        device = args.generation_device or str(self.accelerator.device)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.accelerator.num_processes))
        available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        cores = max(1, available // max(1, local_world))
        threads = args.generation_num_threads
        on_cpu = torch.device(device).type == "cpu"
        omp_threads = os.environ.get("OMP_NUM_THREADS", "").strip()
        if threads is None:
            threads = max(1, cores // 2) if on_cpu else 1
            if omp_threads.isdigit():
                threads = min(threads, max(1, int(omp_threads)))
        if on_cpu and self.accelerator.device.type == "cpu" and not omp_threads:
            # Both processes compute on the same cores: split them instead of oversubscribing.
            torch.set_num_threads(max(1, cores - threads))
        return device, threads

    def _start_rollout(self) -> None:
        args = self.args
        if self.state.global_step > 0:
            raise NotImplementedError(
                "Resuming an asynchronous run from a checkpoint is not supported yet: the generator cannot yet "
                "replay the dataloader position. Resume with async_generation=False."
            )
        model = self.accelerator.unwrap_model(self.model)
        is_peft = hasattr(model, "peft_config") and hasattr(model, "get_base_model")
        base = model.get_base_model() if is_peft else model
        frozen, trainable = named_frozen_parameters(model), named_trainable_parameters(model)
        if not trainable:
            raise ValueError("The model has no trainable parameters to publish to the generator.")
        version = self.state.global_step
        frozen_store = SharedWeightStore(frozen) if frozen else None
        if frozen_store is not None:
            frozen_store.publish(frozen, version)
        trainable_store = SharedWeightStore(trainable)
        trainable_store.publish(trainable, version)
        rollout_queue = StalenessBoundedQueue(
            max_staleness=args.max_staleness,
            capacity=args.queue_capacity,  # None: the queue derives it from the staleness bound and the schedule
            micro_steps_per_item=micro_steps_per_generation(args),
            micro_steps_per_version=args.gradient_accumulation_steps,
            base_version=version,
        )
        rollout_queue.publish(version)
        device, threads = self._generation_placement()
        any_text_reward = not all(is_tensor_reward(f) for f in self.reward_funcs)
        spec = GeneratorSpec(
            process_index=self.accelerator.process_index,
            num_processes=self.accelerator.num_processes,
            device=device,
            num_threads=threads,
            backend=args.generation_backend,
            model_spec=ModelSpec(
                config=base.config,
                dtype=(frozen or trainable)[0][1].dtype,
                peft_config=model.peft_config[model.active_adapter] if is_peft else None,
                adapter_name=model.active_adapter if is_peft else "default",
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
            repeat_count=self.num_iterations * args.steps_per_generation,
            shuffle=self.shuffle_dataset,
            seed=args.seed,
            reward_funcs=list(self.reward_funcs),
            reward_func_names=list(self.reward_func_names),
            decode_completions=bool(args.log_completions),
            parent_pid=os.getpid(),
        )
        process = GenerationProcess(
            spec,
            rollout_queue,
            frozen_store,
            trainable_store,
            startup_timeout=args.generator_startup_timeout,
            heartbeat_timeout=args.generator_heartbeat_timeout,
        )
        t0 = time.perf_counter()
        process.start()
        logger.info(
            "trl_async: generator pid %s on %s (%d threads) ready in %.1fs; %s and any text reward %s",
            process.pid, device, threads, time.perf_counter() - t0,
            f"{len(trainable)} trainable tensors ({trainable_store.num_bytes / 2**20:.1f} MiB) sync",
            "decodes" if any_text_reward else "-",
        )  # fmt: skip
        self._rollout = _Rollout(process, rollout_queue, trainable_store, trainable)

    def close_rollout(self) -> None:
        """Stop this rank's generation process (idempotent). Called automatically when `train()` returns/raises."""
        if self._rollout is not None:
            self._rollout.close()
            self._rollout = None

    def train(self, *args, **kwargs):
        """`Trainer.train`, plus: the generation process is stopped on return, exception or KeyboardInterrupt."""
        try:
            return super().train(*args, **kwargs)
        finally:
            self.close_rollout()

    def _publish_weights(self, version: int) -> None:
        rollout = self._rollout
        if rollout is None or version % self.args.weight_sync_steps:
            return
        start = time.perf_counter()
        rollout.trainable_store.publish(rollout.trainable_params, version)
        rollout.queue.publish(version)
        self._metrics["train"]["async/weight_sync_s"].append(time.perf_counter() - start)

    # --------------------------------------------------------------------------------------------- overrides
    def _generate(self, prompts: list):
        """Replaces `GRPOTrainer._generate` in training mode: the completions come from the rollout queue.

        TRL's version generates in this process and always decodes; here the generation process has sampled,
        scored and (only when needed) decoded the rows. The completion-length metrics TRL logs in `_generate` are
        logged the same way. Evaluation falls through to TRL.
        """
        if not self._async_active():
            return super()._generate(prompts)
        if self._rollout is None:
            self._start_rollout()
        rollout = self._rollout
        micro_step, group = self._step, micro_steps_per_generation(self.args)
        a = self.args.gradient_accumulation_steps
        last_use = self.state.global_step + (micro_step + group - 1) // a - micro_step // a
        item = rollout.queue.get(last_use, on_wait=rollout.process.check_health)
        payload = item.payload
        if payload["prompts"] != prompts:
            raise RuntimeError(
                "The generation process produced rows for other prompts than the trainer's dataloader holds: the "
                "prompt order of TRL's sampler was not reproduced (did the dataset, the sampler or accelerate's "
                "sharding change?)."
            )
        self._rollout_item = item
        self._rewards_from_generator = payload["rewards_per_func"]
        prompt_ids, completion_ids = payload["prompt_ids"], payload["completion_ids"]
        completions = payload["completions"]
        if completions is None:  # not decoded: nothing reads them (no text reward, no completion logging)
            completions = [""] * len(completion_ids)
        self._log_completion_lengths(prompt_ids, completion_ids)
        self._log_async_metrics(item)
        return prompt_ids, completion_ids, None, completions, payload["logprobs"], {}, None, []

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """Replaces `GRPOTrainer._calculate_rewards` when the generation process already scored the rows.

        Returns the same thing: rewards per function, gathered across processes so that TRL's group normalization
        sees whole groups. Otherwise (evaluation, synchronous mode) it is TRL's.
        """
        rewards = self._rewards_from_generator
        if rewards is None:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._rewards_from_generator = None
        return gather(rewards.to(self.accelerator.device))

    def _generate_and_score_completions(self, inputs):
        """Calls `GRPOTrainer._generate_and_score_completions`, then, for queue rows:

        * adds `rollout_versions` (B,), the policy version that generated each row;
        * for TRL's loss types with `max_staleness > 0`, applies TRL's truncated importance correction
          (`vllm_importance_sampling_*` semantics) against the behaviour log-probs, folded into the advantages
          (see `trl_async.importance`). `loss_type="m2po"` instead uses the behaviour log-probs as its ratio's
          denominator, in `_compute_loss`.
        """
        output = super()._generate_and_score_completions(inputs)
        item, self._rollout_item = self._rollout_item, None
        if item is None:
            return output
        batch = output["completion_ids"].size(0)
        output["rollout_versions"] = torch.full((batch,), item.version, device=output["completion_ids"].device)
        args = self.args
        if self.loss_type != "m2po" and args.vllm_importance_sampling_correction and args.max_staleness > 0:
            self._correct_towards_behaviour(output)
        return output

    @torch.no_grad()
    def _correct_towards_behaviour(self, output: dict) -> None:
        mask = output["completion_mask"]
        current = output.get("old_per_token_logps")
        if current is None:  # TRL skips it when on-policy within the batch; we need π_old to compare with μ
            current, _, _ = self._get_per_token_logps_and_entropies(
                self.model,
                torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1),
                torch.cat([output["prompt_mask"], mask], dim=1),
                output["completion_ids"].size(1),
                batch_size=self.args.per_device_train_batch_size,
            )
        args = self.args
        weights = truncated_importance_weights(
            current,
            output["sampling_per_token_logps"],
            mask,
            mode=args.vllm_importance_sampling_mode,
            clip_min=args.vllm_importance_sampling_clip_min,
            clip_max=args.vllm_importance_sampling_clip_max,
        )
        output["advantages"] = fold_into_advantages(output["advantages"], weights)
        flat = weights.flatten() if weights.size(1) == 1 else weights[mask.bool()]
        if flat.numel():
            stats = torch.stack([flat.mean(), flat.min(), flat.max(), (flat == 0).float().mean()])
            mean, low, high, zero = gather(stats.unsqueeze(0)).view(-1, 4).T
            metrics = self._metrics["train"]
            metrics["sampling/importance_sampling_ratio/mean"].append(mean.mean().item())
            metrics["sampling/importance_sampling_ratio/min"].append(low.min().item())
            metrics["sampling/importance_sampling_ratio/max"].append(high.max().item())
            metrics["sampling/importance_sampling_ratio/masked_fraction"].append(zero.mean().item())

    def _compute_loss(self, model, inputs):
        """Adds `loss_type="m2po"` to `GRPOTrainer._compute_loss`; every other loss type is delegated to TRL."""
        if self.loss_type != "m2po":
            return super()._compute_loss(model, inputs)
        return self._compute_m2po_loss(model, inputs)

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
        if args.m2po_variant == "paper":
            loss, stats = m2po_loss(
                per_token_logps,
                behaviour,
                advantages,
                mask,
                threshold=args.m2po_threshold,
                normalizer=normalizer,
                aligned_only=args.m2po_aligned_only,
            )
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
        keys = ("masked_fraction", "m2_before", "m2_after")
        values = gather(torch.stack([stats[k].float() for k in keys] + [stats["all_masked"].float()]).unsqueeze(0))
        values = values.view(-1, len(keys) + 1).mean(dim=0).tolist()
        for key, value in zip(keys, values[: len(keys)], strict=True):
            metrics[f"m2po/{key}"].append(value)
        if values[-1] > 0:
            metrics["m2po/all_masked_batches"].append(values[-1])
            logger.warning(
                "M2PO masked every token of a micro-batch (its smallest δ² exceeds m2po_threshold=%s): it contributes "
                "no gradient. Frequent occurrences mean the rollouts are far off-policy; lower max_staleness.",
                args.m2po_threshold,
            )
        return loss

    def _global_masked_mean(self, values: torch.Tensor, mask: torch.Tensor) -> float:
        totals = self.accelerator.reduce(torch.stack([(values * mask).sum(), mask.sum().float()]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    # --------------------------------------------------------------------------------------------- metrics
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

    def _log_async_metrics(self, item) -> None:
        rollout, metrics = self._rollout, self._metrics["train"]
        stats = rollout.queue.stats()
        previous, rollout.last_stats = rollout.last_stats, stats
        local = torch.tensor(
            [
                float(item.staleness),
                float(stats["staleness_max"]),
                float(stats["evicted_rows"]),
                float(stats["produced_rows"]),
                float(rollout.queue.qsize()),
                stats["generator_wait_s"] - previous["generator_wait_s"],
                stats["trainer_wait_s"] - previous["trainer_wait_s"],
                item.payload["generate_s"],
                item.payload["reward_s"],
            ],
            device=self.accelerator.device,
        )
        rows = gather(local.unsqueeze(0)).view(-1, local.numel())
        mean, total, peak = rows.mean(dim=0).tolist(), rows.sum(dim=0).tolist(), rows.max(dim=0).values.tolist()
        metrics["async/staleness_mean"].append(mean[0])
        metrics["async/staleness_max"].append(peak[1])
        metrics["async/evicted"].append(total[2])
        metrics["async/evicted_fraction"].append(total[2] / max(total[3], 1.0))
        metrics["async/queue_size"].append(mean[4])
        metrics["async/generator_wait_s"].append(mean[5])
        metrics["async/trainer_wait_s"].append(mean[6])
        metrics["async/generate_s"].append(mean[7])
        metrics["async/reward_s"].append(mean[8])
