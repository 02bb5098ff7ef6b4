# Run under `accelerate launch --multi_gpu --num_processes 2` on CPU (gloo). Each rank trains AsyncPPOTrainer (its own
# generation process; the critic is a value model built from the policy's checkpoint, or with `peft` as the second
# argument a LoRA policy and the critic adapter on its base) and records what it saw into <output_dir>/rank<k>.json
# for tests/test_ppo_trainer.py to check.
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_async import AsyncPPOConfig, AsyncPPOTrainer
from trl_async.rewards import MathAnswerReward
from trl_async.toy import make_arithmetic_dataset, tiny_model_path

METRICS = (
    "ppo/value_loss", "ppo/explained_variance", "ppo/approx_kl", "ppo/clipfrac", "ppo/returns_mean",
    "ppo/value_mean", "ppo/value_clipfrac", "ppo/policy_loss", "objective/kl", "objective/scores", "reward",
)  # fmt: skip


def digit_share(completions, **kwargs):
    """A text reward (decoded completions): the share of digits, dense enough to move the policy in three steps."""
    texts = [c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


class RecordingTrainer(AsyncPPOTrainer):
    def _compute_loss(self, model, inputs):
        self.rows_per_step.append(int(inputs["completion_ids"].size(0)))
        if self._rollout.process is not None:  # the process handle: its pid is known once it is launched
            self.generator = self._rollout.process
        return super()._compute_loss(model, inputs)


def checksum(parameters) -> float:
    return sum(p.detach().double().abs().sum().item() for p in parameters)


def main():
    output_dir = sys.argv[1]
    peft_config = None
    if len(sys.argv) > 2 and sys.argv[2] == "peft":
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    args = AsyncPPOConfig(
        output_dir=output_dir,
        max_steps=3,
        per_device_train_batch_size=8,
        max_completion_length=24,
        learning_rate=3e-4 if peft_config is None else 5e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        use_cpu=not torch.cuda.is_available(),  # on CPU, accelerate's multi-process mode is MULTI_CPU (gloo)
        max_staleness=1,
    )
    trainer = RecordingTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_path()),
        reward_funcs=[MathAnswerReward(tokenizer), digit_share],  # tensor-native and text
        args=args,
        train_dataset=make_arithmetic_dataset(num_train=128, num_test=8)["train"],
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    trainer.rows_per_step, trainer.generator = [], None
    initial_policy, initial_critic = checksum(trainer.model.parameters()), checksum(trainer.critic.parameters())
    trainer.train()
    history = trainer.state.log_history
    record = {
        "process_index": trainer.accelerator.process_index,
        "num_processes": trainer.accelerator.num_processes,
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "generator_pid": trainer.generator.pid if trainer.generator is not None else None,  # launched by now
        "rows_per_step": trainer.rows_per_step,
        "policy_checksum": checksum(trainer.model.parameters()),
        "initial_policy_checksum": initial_policy,
        "critic_checksum": checksum(trainer.critic.parameters()),
        "initial_critic_checksum": initial_critic,
        "metrics": {key: [h[key] for h in history if key in h] for key in METRICS},
    }
    with open(os.path.join(output_dir, f"rank{trainer.accelerator.process_index}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
    # Exit with no live gloo group: its threads can otherwise abort the interpreter's exit (pytorch/pytorch#179291).
    torch.distributed.destroy_process_group()
