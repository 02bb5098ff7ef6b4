# Two ranks made to differ on purpose, run under `accelerate launch` (CPU, gloo) with TRL_ASYNC_CHECK_COLLECTIVES=1:
# every collective is fingerprinted on every rank, so a rank that skips, adds or reshapes one fails the run with
# both ranks' calls named (trl_async.trainers.collectives). tests/test_diverging_ranks.py runs one case per launch.
#
#   python diverging_ranks.py OUTPUT_DIR CASE MAX_STEPS
#
# Each rank writes OUTPUT_DIR/rank<k>.json: per trained generation batch, where it came from (the trainer at start-up
# or the generation process), its stream position, its version and the step it entered; every staleness agreement
# (this rank's candidate, the agreed value, the step); the collectives checked; the generator's pid and the queue's spool.
import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer, AsyncPPOConfig, AsyncPPOTrainer
from trl_async.toy import make_arithmetic_dataset, tiny_model_path
from trl_async.trainers import collectives


class SlowInChildReward:
    """A length reward that, in the generation process only (not in the trainer that built it), sleeps
    `startup_delay` seconds when it arrives there (the generation process unpickles its rewards before it reports
    ready, so this delays its start) and `call_delay` seconds per batch (a slower generator). With `wait_for`, it
    first waits there until that file exists: rank 0's trainer writes it when its own generator's first batch reaches
    it, so rank 1's generator gets ready after rank 0 switched, whatever the machine's speed."""

    __name__ = "slow_in_child_reward"

    def __init__(self, startup_delay: float = 0.0, call_delay: float = 0.0, wait_for: str | None = None):
        self.startup_delay, self.call_delay, self.owner = startup_delay, call_delay, os.getpid()
        self.wait_for = wait_for

    def __setstate__(self, state):
        self.__dict__.update(state)
        if os.getpid() == self.owner:
            return
        deadline = time.monotonic() + 600
        while self.wait_for and not os.path.exists(self.wait_for) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.startup_delay:
            time.sleep(self.startup_delay)

    def __call__(self, completions, **kwargs):
        if os.getpid() != self.owner and self.call_delay:
            time.sleep(self.call_delay)
        return [min(len(c[0]["content"]), 24) / 24.0 for c in completions]


# Rank 1's generator, in the cases where it starts late: ready once rank 0 has trained on its own generator's first
# batch, and 2 s later (`AFTER_RANK0`). A fixed delay from spawn raced the run's length: on a fast machine 100 steps
# ended before rank 1's generator was ready, and the case never saw rank 1 switch.
AFTER_RANK0 = "after_rank0"
RANK0_SWITCHED = "rank0_switched"

# case -> (settings of both ranks, rank 1's generator: (startup delay s, delay per batch s) or AFTER_RANK0, rank 0's)
CASES = {
    # Rank 0's generator is fast; rank 1's reports ready after rank 0 switched: rank 1 trains on batches it makes
    # itself while rank 0 trains on its generator's, then switches too.
    "late_generator": ({}, AFTER_RANK0, (0.0, 0.0)),
    # Rank 1's generator never gets ready within the run: rank 1 makes every batch itself.
    "no_generator": ({}, (3600.0, 0.0), (0.0, 0.0)),
    # Rank 1's generator is slow: it gets ahead of its trainer less than rank 0's, whose rows are staler.
    "different_staleness": ({"max_staleness": 3}, (0.0, 0.25), (0.0, 0.0)),
    # Epochs of 5 one-micro-step generation batches per rank, 2 micro-steps per optimizer step: each epoch's last
    # micro-step gets an optimizer step of its own, which the gate's schedule did not predict. The fast rank's queued
    # batches then become too old, while the slow rank's next batch, generated later, is not (tests/test_engine.py's
    # forced eviction, on one rank only).
    "one_rank_evicts": (
        {
            "gradient_accumulation_steps": 2,
            "steps_per_generation": 1,
            "max_staleness": 1,
            "num_prompts": 20,
            "trainer_generates_while_starting": False,
        },
        (0.0, 0.4),
        (0.0, 0.0),
    ),
    "inflight": ({"inflight_weight_updates": True, "max_staleness": 2}, AFTER_RANK0, (0.0, 0.0)),
    "ppo": ({"trainer": "ppo"}, AFTER_RANK0, (0.0, 0.0)),
    "m2po_global": ({"loss_type": "m2po", "m2po_scope": "global"}, AFTER_RANK0, (0.0, 0.0)),
    # Several generation batches per decode (3 of 8 rows, bound 5), rank 1's generator slow: the ranks' blocks arrive
    # at different steps, and their batches' ages differ.
    "blocks": ({"loss_type": "m2po", "max_rows_per_decode": 24}, (0.0, 0.3), (0.0, 0.0)),
    "two_iterations": ({"num_iterations": 2, "steps_per_generation": 2}, AFTER_RANK0, (0.0, 0.0)),
    # Two machines on one host (the test launches two single-process "machines"): both generators start alike.
    "two_machines": ({}, (0.0, 0.0), (0.0, 0.0)),
    # A script that logs on the main process only after training (as the recipe logs its evaluation): `log` must not
    # run a collective that the other ranks never reach.
    "log_on_main_only": ({"logging_steps": 2}, (0.0, 0.0), (0.0, 0.0)),
}


def recording(base):
    class Recording(base):
        """Records what this rank trained on and every staleness agreement (observation only)."""

        def _next_rollout_batch(self):
            batch = super()._next_rollout_batch()
            self.record["batches"].append(
                {
                    "step": self.state.global_step,
                    "from_trainer": batch.from_trainer,
                    "stream_index": batch.payload.stream_index,
                    "version": batch.version,
                    "row_ids": [row["row_id"] for row in batch.payload.rows],
                }
            )
            if not batch.from_trainer and self.accelerator.process_index == 0:
                open(os.path.join(self.args.output_dir, RANK0_SWITCHED), "a").close()  # releases rank 1's generator
            if self._rollout.process is not None:
                self.record["generator_pid"] = self._rollout.process.pid
                self.record["spool_dir"] = self._rollout.queue.spool_dir if self._rollout.queue else None
            return batch

        def _all_reduce_max(self, value):
            agreed = super()._all_reduce_max(value)
            self.record["agreements"].append([value, agreed, self.state.global_step])
            return agreed

    return Recording


def main():
    output_dir, case, max_steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    settings, slow_rank1, slow_rank0 = CASES[case]
    settings = dict(settings)
    trainer_kind = settings.pop("trainer", "grpo")
    num_prompts = settings.pop("num_prompts", 256)
    rank = int(os.environ.get("RANK", "0"))
    generator_speed = slow_rank1 if rank == 1 else slow_rank0
    wait_for = os.path.join(output_dir, RANK0_SWITCHED) if generator_speed == AFTER_RANK0 else None
    startup_delay, call_delay = (2.0, 0.0) if generator_speed == AFTER_RANK0 else generator_speed
    config_class = AsyncPPOConfig if trainer_kind == "ppo" else AsyncGRPOConfig
    args = config_class(
        output_dir=output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        learning_rate=1e-3,
        logging_steps=settings.pop("logging_steps", 5),
        report_to="none",
        save_strategy="no",
        bf16=False,
        use_cpu=not torch.cuda.is_available(),
        seed=0,
        **settings,
    )
    trainer_class = recording(AsyncPPOTrainer if trainer_kind == "ppo" else AsyncGRPOTrainer)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    trainer = trainer_class(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_path()),
        reward_funcs=SlowInChildReward(startup_delay, call_delay, wait_for),
        args=args,
        train_dataset=make_arithmetic_dataset(num_train=num_prompts, num_test=4, seed=1)["train"].map(
            lambda row, index: {"row_id": index}, with_indices=True
        ),
        processing_class=tokenizer,
    )
    trainer.record = {"batches": [], "agreements": [], "generator_pid": None, "spool_dir": None}
    trainer.train()
    if case == "log_on_main_only":
        if trainer.accelerator.is_main_process:
            trainer.log({"after_training": 1.0})
        trainer.accelerator.wait_for_everyone()
    record = {
        **trainer.record,
        "process_index": trainer.accelerator.process_index,
        "num_processes": trainer.accelerator.num_processes,
        "global_step": trainer.state.global_step,
        "collectives_checked": collectives.checked_collectives(),
        "evicted": sum(h.get("async/evicted", 0) for h in trainer.state.log_history),
        "parameter_checksum": sum(p.detach().double().abs().sum().item() for p in trainer.model.parameters()),
        "trainer_pid": os.getpid(),
    }
    with open(os.path.join(output_dir, f"rank{trainer.accelerator.process_index}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
    # Exit with no live gloo group: its threads can otherwise abort the interpreter's exit (pytorch/pytorch#179291).
    torch.distributed.destroy_process_group()
