# Run under `accelerate launch --multi_gpu --num_processes 2` (CPU, gloo) or `torchrun --nproc_per_node 2`.
# Each rank records what it saw into <output_dir>/rank<k>.json for tests/test_distributed.py to check.
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.trainer_utils import WeightTracingTrainer  # noqa: E402
from trl_async import AsyncGRPOConfig
from trl_async.rewards import MathAnswerReward, math_answer_text_reward
from trl_async.toy import make_arithmetic_dataset, tiny_model_path


class RecordingTrainer(WeightTracingTrainer):
    """Staleness measured from the weights that really generated each batch (tests/support/trainer_utils.py), not from the
    engine's tags."""

    def _compute_loss(self, model, inputs):
        self.rows_per_step.append(int(inputs["completion_ids"].size(0)))
        return super()._compute_loss(model, inputs)

    def _generate(self, prompts):
        out = super()._generate(prompts)
        if self._rollout is not None:  # the process handle: its pid is known once it is launched
            self.generator_handles.add(self._rollout.process)
        return out


def parameter_checksum(model) -> float:
    return sum(p.detach().double().abs().sum().item() for p in model.parameters())


def main():
    output_dir = sys.argv[1]
    loss_type = sys.argv[2] if len(sys.argv) > 2 else "m2po"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    args = AsyncGRPOConfig(
        output_dir=output_dir,
        max_steps=4,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=24,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        use_cpu=not torch.cuda.is_available(),  # on CPU, accelerate's multi-process mode is MULTI_CPU (gloo)
        loss_type=loss_type,
        max_staleness=1,
    )
    trainer = RecordingTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_path()),
        reward_funcs=[math_answer_text_reward if loss_type == "dapo" else MathAnswerReward(tokenizer)],
        args=args,
        train_dataset=make_arithmetic_dataset(num_train=128, num_test=8)["train"],
        processing_class=tokenizer,
    )
    trainer.rows_per_step, trainer.generator_handles = [], set()
    initial_checksum = parameter_checksum(trainer.model)
    trainer.train()
    # Parameters must have moved and still agree across ranks (DDP really synchronised gradients).
    checksum = parameter_checksum(trainer.model)
    record = {
        "process_index": trainer.accelerator.process_index,
        "num_processes": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "generator_pids": sorted(h.pid for h in trainer.generator_handles),  # launched by now (`close` waits)
        "rows_per_step": trainer.rows_per_step,
        "true_staleness": trainer.true_staleness,
        "tag_is_true": trainer.tag_is_true,
        "param_checksum": checksum,
        "initial_param_checksum": initial_checksum,
        "rewards": [h["reward"] for h in trainer.state.log_history if "reward" in h],
        "trainer_pid": os.getpid(),
    }
    with open(os.path.join(output_dir, f"rank{trainer.accelerator.process_index}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
    # Exit with no live gloo group: its threads can otherwise abort the interpreter's exit (pytorch/pytorch#179291).
    torch.distributed.destroy_process_group()
