"""What a documentation block leaves to its reader, bound when `tests/test_doc_blocks.py` runs the block.

The program the test writes for a Python block imports this module as `_doc_test` (in the child process that runs
the block): `tiny_model()` replaces a Hub model, `placeholder(...)` an argument written `...`, `stand_in(name)` a
name the block uses without defining it, and `report(globals())` tells the test what the block's trainers did.
The rules are in `tests/test_doc_blocks.py`'s docstring. Nothing here is imported before it is needed: the test
process reads `PLACEHOLDERS` and `STAND_INS` (their keys) without loading torch.
"""

from __future__ import annotations

import functools
import json
import os

DOC_MAX_STEPS = 2  # the most optimizer steps a documented training run takes here
REPORT_ENV = "DOC_TEST_REPORT"  # where `report` writes its JSON


def tiny_model() -> str:
    """The bundled model's folder, in place of a Hub model id."""
    from trl_async.toy import tiny_model_path

    return tiny_model_path()


# --------------------------------------------------------------------------------------- `...` arguments of a trainer
def answer_reward(completions, answer, **kwargs) -> list[float]:
    """A TRL text reward for the arithmetic rows: 1.0 when the completion's final number is the answer."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(text.rsplit("####", 1)[-1].strip() == gold) for text, gold in zip(texts, answer, strict=True)]


def arithmetic_prompts():
    """64 prompts of the bundled arithmetic task (a `prompt` and an `answer` column)."""
    from trl_async.toy import make_arithmetic_dataset

    return make_arithmetic_dataset(num_train=64, num_test=8, seed=0)["train"]


def training_args(trainer: str):
    """A small config of the trainer's kind: DOC_MAX_STEPS steps of 8 rows, short completions, float32 on a CPU."""
    import torch

    from trl_async import AsyncGRPOConfig, AsyncPPOConfig

    config_class = AsyncPPOConfig if "PPO" in trainer else AsyncGRPOConfig
    return config_class(
        output_dir="out",
        max_steps=DOC_MAX_STEPS,
        per_device_train_batch_size=8,
        max_completion_length=16,
        bf16=torch.cuda.is_available(),
        report_to="none",
        save_strategy="no",
        **({} if "PPO" in trainer else {"num_generations": 4}),
    )


PLACEHOLDERS = {
    "model": lambda trainer: tiny_model(),
    "reward_funcs": lambda trainer: [answer_reward],
    "train_dataset": lambda trainer: arithmetic_prompts(),
    "args": training_args,
}


def placeholder(keyword: str, trainer: str):
    """The value of `keyword=...` in a call of `trainer` (e.g. `AsyncPPOTrainer(model=..., ...)`)."""
    return PLACEHOLDERS[keyword](trainer)


# --------------------------------------------------------------------------------------- names a block does not define
@functools.cache
def m2po_tensors() -> dict:
    """Log-probs, behaviour log-probs, advantages and masks for the M2PO API's sketch (docs/m2po.md): a batch, and
    two micro-batches (`_mb0`, `_mb1`) of the same optimizer batch. Seeded; padding at the end of each row."""
    import torch

    generator = torch.Generator().manual_seed(0)

    def batch():
        logps = -3 * torch.rand(4, 8, generator=generator)
        behaviour = logps - 0.3 * torch.randn(4, 8, generator=generator)  # stale rows: δ² well above τ = 0.04
        advantages = torch.randn(4, generator=generator)
        mask = torch.ones(4, 8, dtype=torch.bool)
        mask[:, 6:] = False
        return logps.requires_grad_(), behaviour, advantages, mask

    logps, behaviour, advantages, mask = batch()
    logp_mb0, mu_mb0, a0, m0 = batch()
    logp_mb1, mu_mb1, a1, m1 = batch()
    return {
        "per_token_logps": logps, "behaviour_logps": behaviour, "advantages": advantages, "mask": mask,
        "log_ratio": logps.detach() - behaviour, "A": advantages,
        "logp_mb0": logp_mb0, "mu_mb0": mu_mb0, "lr_mb0": logp_mb0.detach() - mu_mb0, "A0": a0, "m0": m0,
        "lr_mb1": logp_mb1.detach() - mu_mb1, "A1": a1, "m1": m1,
        "N": float(m0.sum() + m1.sum()),  # the optimizer batch's valid tokens: the loss normalizer
    }  # fmt: skip


def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model())


@functools.cache
def output_dir() -> str:
    """A run's output folder (docs/timeline.md's `output_dir`): a short asynchronous run of the tiny model, which
    writes its `timeline.json` there."""
    from trl_async import AsyncGRPOTrainer

    args = training_args("AsyncGRPOTrainer")
    args.max_steps, args.output_dir = 6, os.path.abspath("timeline-run")
    trainer = AsyncGRPOTrainer(model=tiny_model(), reward_funcs=[answer_reward], args=args,
                               train_dataset=arithmetic_prompts())  # fmt: skip
    trainer.train()
    return args.output_dir


M2PO_NAMES = ("per_token_logps", "behaviour_logps", "advantages", "mask", "log_ratio", "A", "logp_mb0", "mu_mb0",
              "lr_mb0", "A0", "m0", "lr_mb1", "A1", "m1", "N")  # fmt: skip
STAND_INS = {
    "tokenizer": tokenizer,
    "output_dir": output_dir,
    **{name: functools.partial(lambda n: m2po_tensors()[n], name) for name in M2PO_NAMES},
}


def stand_in(name: str):
    return STAND_INS[name]()


# --------------------------------------------------------------------------------------- what the block did
def report(namespace: dict) -> None:
    """Writes, for the test, every trainer the block left in its globals: its class, steps taken and max_steps."""
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    from transformers import Trainer

    trainers = [
        {"name": name, "class": type(value).__name__, "global_step": value.state.global_step,
         "max_steps": value.args.max_steps}
        for name, value in namespace.items()
        if isinstance(value, Trainer)
    ]  # fmt: skip
    with open(path, "w") as f:
        json.dump({"trainers": trainers}, f)
