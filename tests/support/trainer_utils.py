"""Shared helpers of the trainer tests: the bundled tiny model, small configs, and an instrumented trainer that
measures the staleness of every row from the weights that really generated it."""

from __future__ import annotations

import copy
import os
import socket

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
from trl_async.toy import tiny_model_path


def load_model():
    return AutoModelForCausalLM.from_pretrained(tiny_model_path())


def load_tokenizer():
    return AutoTokenizer.from_pretrained(tiny_model_path())


def make_args(tmp_path, config_cls=AsyncGRPOConfig, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        seed=0,
    )
    kwargs.update(overrides)
    return config_cls(**kwargs)


def answer_reward(completions, answer, **kwargs):
    """A text reward as TRL's docs write them: 1.0 when the text after '####' is the answer."""
    return [
        float(c[0]["content"].rsplit("####", 1)[-1].strip() == a) for c, a in zip(completions, answer, strict=True)
    ]


def length_reward(completions, **kwargs):
    return [len(c[0]["content"]) / 50.0 for c in completions]


def pid_is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers kill(pid, 0); it is gone for our purposes only once reaped.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] == "Z"


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


class _KeepWeights(TrainerCallback):
    """Keeps a copy of the policy's weights at every version (optimizer step), keyed by the version."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.weights_by_version[state.global_step] = self.trainer.current_weights()

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.weights_by_version[state.global_step] = self.trainer.current_weights()


class WeightTracingTrainer(AsyncGRPOTrainer):
    """For every batch that enters a loss, finds which weights version really generated its rows, independently of
    the engine's own version tags: the behaviour log-probs μ the generator recorded are compared with the log-probs
    of the same tokens under every version the trainer went through; the version that reproduces μ generated them.

    Records per batch `true_staleness` (trainer version at loss time minus the newest version that reproduces μ: steps
    with a zero gradient leave the weights, hence the policy, unchanged), `tagged_staleness` (from the engine's
    `rollout_versions`) and `tag_is_true` (the tagged version reproduces μ). Needs default sampling settings.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.weights_by_version: dict[int, dict] = {}
        self.true_staleness: list[int] = []
        self.tagged_staleness: list[int] = []
        self.tag_is_true: list[bool] = []
        self.generating_versions: list[set[int]] = []  # per batch: every version whose weights reproduce μ
        self.loss_versions: list[int] = []
        self.add_callback(_KeepWeights(self))
        self._probe = None

    def current_weights(self) -> dict:
        model = self.accelerator.unwrap_model(self.model)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def _generating_versions(self, inputs) -> set[int]:
        if self._probe is None:
            self._probe = copy.deepcopy(self.accelerator.unwrap_model(self.model)).eval()
        mask = inputs["completion_mask"].bool()
        mu = inputs["sampling_per_token_logps"]
        gaps = {}
        for version, weights in self.weights_by_version.items():
            self._probe.load_state_dict(weights)
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self._probe,
                torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
                torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
                inputs["completion_ids"].size(1),
            )
            gaps[version] = (logps - mu).abs()[mask].max().item()
        best_gap = min(gaps.values())
        assert best_gap < 1e-3, f"no weights version reproduces the behaviour log-probs (closest gap {best_gap})"
        # Versions whose weights did not change (a step with zero gradient) reproduce μ equally: the same policy.
        return {v for v, gap in gaps.items() if gap <= best_gap + 1e-6}

    def _compute_loss(self, model, inputs):
        if self.model.training and "sampling_per_token_logps" in inputs:
            version = self.state.global_step
            self.loss_versions.append(version)
            generating = self._generating_versions(inputs)
            self.generating_versions.append(generating)
            tagged = int(inputs["rollout_versions"].min())
            self.true_staleness.append(version - max(generating))
            self.tagged_staleness.append(version - tagged)
            self.tag_is_true.append(tagged in generating)
        return super()._compute_loss(model, inputs)


def make_batch(tokenizer, model, seed=0, batch=6, width=9):
    """A batch dict as TRL builds it, with behaviour log-probs μ that differ from the current policy."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [tokenizer(f"What is {i}+{2 * i}?")["input_ids"] for i in range(batch)]
    plen = max(len(p) for p in prompts)
    prompt_ids = torch.full((batch, plen), tokenizer.pad_token_id)
    prompt_mask = torch.zeros(batch, plen, dtype=torch.long)
    for row, ids in enumerate(prompts):
        prompt_ids[row, plen - len(ids) :] = torch.tensor(ids)
        prompt_mask[row, plen - len(ids) :] = 1
    completion_ids = torch.randint(3, model.config.vocab_size, (batch, width), generator=generator)
    lengths = torch.tensor([width, width - 2, 4, width, 1, 6][:batch])
    completion_mask = (torch.arange(width)[None] < lengths[:, None]).long()
    completion_ids = completion_ids.masked_fill(completion_mask == 0, tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(
            input_ids=torch.cat([prompt_ids, completion_ids], 1),
            attention_mask=torch.cat([prompt_mask, completion_mask], 1),
        ).logits[:, plen - 1 : -1]
        policy = torch.log_softmax(logits.float(), -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    behaviour = (policy + 0.3 * torch.randn(policy.shape, generator=generator)) * completion_mask
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(batch, generator=generator),
        "num_items_in_batch": completion_mask.sum(),
        "sampling_per_token_logps": behaviour,
        "rollout_versions": torch.zeros(batch, dtype=torch.long),
        "rollout_token_versions": torch.zeros(batch, width, dtype=torch.long),
    }, policy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
