# AsyncGRPOTrainer under sharded training, one rank of `accelerate launch --num_processes 2`; tests/test_sharded.py
# launches it and checks what each rank records into <output_dir>/rank<k>.json.
#
#   python sharded_ranks.py <output_dir> <fsdp2|zero3> <full|lora> [launcher|args]
#
# The sharding settings come from the launcher (`accelerate launch --config_file recipes/accelerate_configs/...`,
# the default) or, with `args`, from the training arguments (transformers' `fsdp_config`).
#
# zero3: accelerate's DeepSpeed ZeRO-3 exactly as `accelerate launch --use_deepspeed --zero_stage 3` sets it up;
#   DeepSpeed runs on CPU with gloo (its CPU accelerator). The one CPU-specific setting is `ddp_backend="gloo"`.
# fsdp2: on a machine without GPUs, accelerate resolves two CPU processes to DistributedType.MULTI_CPU and then never
#   looks at the FSDP plugin (`AcceleratorState.__init__` switches to FSDP only from a GPU-class multi-device type),
#   so it would silently train with DDP. With FORCE_FSDP2_ON_CPU=1 this script flips that one decision after accelerate
#   has set up gloo (`ForcedFSDP2OnCPU` below); everything after it is accelerate's real FSDP2 path (its
#   `fsdp2_prepare_model` applies torch's `fully_shard`, which runs on CPU with gloo) and the HF Trainer's FSDP path.
#   On GPUs the flip is not needed and not done (benchmarks/gpu_check.sh runs it there unforced).
#
# Each rank checks, independently of trl_async's gathering code, that its generator sampled from the trainer's whole
# weights: at every optimizer step it takes the whole state dict by a different route (torch's distributed-checkpoint
# `get_model_state_dict(full_state_dict=True)` under FSDP2, one all-at-once `GatheredParameters` under ZeRO-3), loads it
# into a plain unsharded model, and recomputes the behaviour log-probs μ of every batch that enters the loss under the
# version the batch is tagged with.
import json
import os
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from tests.support.weights import control_candidates, read_copy
from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
from trl_async.rollout.gather import is_dtensor, is_zero3_parameter, model_sharding
from trl_async.toy import make_arithmetic_dataset, tiny_model_path


def even_token_reward(completion_ids, **kwargs):
    """Differs between completions of one prompt (the tiny model rarely answers the arithmetic right), so advantages
    are non-zero and every optimizer step moves the policy."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def whole_state_dict(model) -> dict[str, torch.Tensor]:
    """The policy's whole weights on every rank, by a route other than `trl_async.rollout.gather` (a collective)."""
    if any(is_dtensor(p) for p in model.parameters()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        return {k: v.detach().clone().cpu() for k, v in state.items()}
    if any(is_zero3_parameter(p) for p in model.parameters()):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            return {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}
    return {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}


class _KeepWholeWeights(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.keep_weights(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.keep_weights(state.global_step)


class ForcedFSDP2OnCPU:
    """Makes accelerate take its FSDP2 path on CPU (see the header): the only departure from a GPU run."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        state = self.accelerator.state
        assert state.distributed_type == DistributedType.MULTI_CPU, state.distributed_type
        # From the training arguments if they set FSDP, else from `accelerate launch`'s environment (FSDP_*).
        state.fsdp_plugin = FullyShardedDataParallelPlugin(**(self.args.fsdp_plugin_args or {}))
        # Where accelerate records its decision on a GPU machine (both shared states; later `AcceleratorState()`
        # calls copy the partial state's over the accelerator state's).
        state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.is_fsdp_enabled = True
        assert self.accelerator.is_fsdp2


TRACED_INPUTS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "sampling_per_token_logps")


class TracingTrainer(AsyncGRPOTrainer):
    """Records, for every batch that enters the loss, how far the generator's μ is from the log-probs of the same
    tokens under the trainer's whole weights of the batch's tagged version (and, as a control that the check can
    fail, under the weights of another version: `compute_controls`, once training has kept every version)."""

    def __init__(self, *args, plain_base=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.plain_base = plain_base
        self.whole_weights: dict[int, dict] = {}
        self.mu_gaps: list[float] = []
        self.tagged_versions: list[int] = []
        self.traced_batches: list[dict] = []  # what `_mu_gap` reads of each batch, for the controls
        self.control_gaps: list[float] = []
        self.control_versions: list[int] = []
        self.control_weight_gaps: list[float] = []  # how far each control's weights are from the tagged version's
        self.add_callback(_KeepWholeWeights(self))
        self._probe = None

    def keep_weights(self, version: int) -> None:
        self.whole_weights[version] = whole_state_dict(self.accelerator.unwrap_model(self.model))

    def _plain_model(self):
        """An unsharded copy of the policy's architecture, built as the generator builds its own (the base is built
        before the training arguments exist: once they enable ZeRO-3, transformers partitions every model it builds)."""
        if self._probe is None:
            model = self.accelerator.unwrap_model(self.model)
            is_peft = hasattr(model, "peft_config")
            probe = self.plain_base
            if is_peft:
                from peft import get_peft_model

                probe = get_peft_model(probe, model.peft_config[model.active_adapter])
            self._probe = probe.eval()
        return self._probe

    @torch.no_grad()
    def _mu_gap(self, inputs, version: int) -> float:
        probe = self._plain_model().to(inputs["prompt_ids"].device)
        probe.load_state_dict(self.whole_weights[version], strict=True)
        completion_ids = inputs["completion_ids"]
        logits = probe(
            input_ids=torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
            attention_mask=torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
        ).logits
        # log π(y_t) = log_softmax(logits_{t-1} / T)[y_t], TRL's definition, written out (the probe is a plain model).
        logits = logits[:, -completion_ids.size(1) - 1 : -1].float() / self.temperature
        logps = torch.log_softmax(logits, dim=-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
        mask = inputs["completion_mask"].bool()
        return (logps - inputs["sampling_per_token_logps"]).abs()[mask].max().item()

    def _compute_loss(self, model, inputs):
        if self.model.training and "sampling_per_token_logps" in inputs:
            version = int(inputs["rollout_versions"].min())
            assert int(inputs["rollout_versions"].max()) == version
            self.tagged_versions.append(version)
            self.mu_gaps.append(self._mu_gap(inputs, version))
            self.traced_batches.append({k: inputs[k].detach().clone() for k in TRACED_INPUTS})
        return super()._compute_loss(model, inputs)

    def compute_controls(self) -> None:
        """After training, when every version's weights are kept: each traced batch's μ against the weights of
        another version (`control_candidates`: the farthest in weights, the first, the last), the one that moves the
        batch's log-probs most. A control must be able to fail, so it never compares with the tagged weights, nor with
        a version whose weights equal them."""
        for inputs, version in zip(self.traced_batches, self.tagged_versions, strict=True):
            candidates = control_candidates(version, self.whole_weights)
            gaps = [self._mu_gap(inputs, other) for other, _ in candidates]
            best = max(range(len(candidates)), key=gaps.__getitem__)
            self.control_versions.append(candidates[best][0])
            self.control_weight_gaps.append(candidates[best][1])
            self.control_gaps.append(gaps[best])


def main():
    output_dir, sharding, variant = sys.argv[1], sys.argv[2], sys.argv[3]
    settings_from = sys.argv[4] if len(sys.argv) > 4 else "launcher"
    max_steps = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    force_fsdp2 = sharding == "fsdp2" and os.environ.get("FORCE_FSDP2_ON_CPU") == "1"
    trainer_cls = type("Trainer", (ForcedFSDP2OnCPU, TracingTrainer), {}) if force_fsdp2 else TracingTrainer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    plain_base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_path()), dtype=torch.float32)
    on_cpu = not torch.cuda.is_available()
    extra = {}
    if sharding == "fsdp2":
        if settings_from == "args":
            extra = dict(fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]})
        if os.environ.get("FSDP_ACTIVATION_CHECKPOINTING") == "true":
            # FSDP's own activation checkpointing wraps the decoder layers (parameter names then carry
            # `_checkpoint_wrapped_module.`); transformers refuses its own gradient checkpointing beside it.
            extra["gradient_checkpointing"] = False
        if on_cpu:
            extra["use_cpu"] = True  # accelerate's multi-process CPU mode (gloo); see ForcedFSDP2OnCPU
    elif sharding == "zero3" and on_cpu:
        # Without a GPU accelerate picks no process-group backend for DeepSpeed and then counts one process;
        # naming gloo (which DeepSpeed's CPU accelerator uses anyway) gives it the real world size.
        extra = dict(ddp_backend="gloo")
    args = AsyncGRPOConfig(
        output_dir=output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        learning_rate=2e-2 if variant == "lora" else 1e-2,  # large enough that every step visibly moves the policy
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        seed=0,
        loss_type="dapo",
        max_staleness=1,
        **extra,
    )
    peft_config = None
    if variant == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = trainer_cls(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32),
        reward_funcs=[even_token_reward],
        args=args,
        train_dataset=make_arithmetic_dataset(num_train=64, num_test=8)["train"],
        processing_class=tokenizer,
        peft_config=peft_config,
        plain_base=plain_base,
    )
    # Keep the stores readable after training: the test compares what they hold with the final whole weights.
    rollout_close = trainer._rollout.close
    trainer._rollout.close = lambda: trainer._rollout.process.stop() if trainer._rollout.process else None
    trainer.train()
    trainer.compute_controls()
    model = trainer.accelerator.unwrap_model(trainer.model)
    final = whole_state_dict(model)
    stores = {"trainable": trainer._rollout.trainable_store, "frozen": trainer._rollout.frozen_store}
    store_vs_final, store_names = {}, {}
    for kind, store in stores.items():
        if store is None:
            continue
        published, version = read_copy(store)
        store_names[kind] = sorted(published)
        store_vs_final[kind] = {
            "version": version,
            "missing_from_final": sorted(set(published) - set(final)),
            "max_abs_diff": max((published[k] - final[k]).abs().max().item() for k in published if k in final),
        }
    shard_numel = sum(p.to_local().numel() if is_dtensor(p) else p.numel() for p in model.parameters())
    if sharding == "zero3":
        shard_numel = sum(p.ds_tensor.numel() for p in model.parameters())
    num_trainable = sum(p.requires_grad for p in model.parameters())
    plain_names = sorted(n for n, _ in trainer._plain_model().named_parameters())
    wrapped_names = [n for n, _ in model.named_parameters() if "_checkpoint_wrapped_module." in n]
    record = {
        "process_index": trainer.accelerator.process_index,
        "num_processes": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "sharding": model_sharding(model),
        "shard_numel": shard_numel,
        "whole_numel": sum(p.numel() for p in trainer._plain_model().parameters()),
        "mu_gaps": trainer.mu_gaps,
        "control_gaps": trainer.control_gaps,
        "control_versions": trainer.control_versions,
        "control_weight_gaps": trainer.control_weight_gaps,
        "tagged_versions": trainer.tagged_versions,
        "global_step": trainer.state.global_step,
        "store_vs_final": store_vs_final,
        "store_names": store_names,
        "num_trainable": num_trainable,
        "plain_names": plain_names,
        "wrapped_names": wrapped_names,
        "store_checksum": {
            kind: sum(t.double().abs().sum().item() for t in read_copy(store)[0].values())
            for kind, store in stores.items()
            if store is not None
        },
        "initial_vs_final_max_diff": max(
            (trainer.whole_weights[0][k] - final[k]).abs().max().item() for k in store_names["trainable"]
        ),
        "trainer_generated_batches": [
            h["async/trainer_generated_batches"]
            for h in trainer.state.log_history
            if "async/trainer_generated_batches" in h
        ],
    }
    rollout_close()
    with open(os.path.join(output_dir, f"rank{trainer.accelerator.process_index}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
    # Exit with no live gloo group: its threads can otherwise abort the interpreter's exit (pytorch/pytorch#179291).
    torch.distributed.destroy_process_group()
