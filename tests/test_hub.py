"""Model cards and Hub pushes.

The Hub cannot be reached from our machines, so `tests/support/hub/server.py` stands in for it at the HTTP boundary: a local
server that the real `huggingface_hub` client (and `Trainer.push_to_hub`, `from_pretrained`,
`PeftModel.from_pretrained`) talks to through `HF_ENDPOINT`. The pushing and loading runs in child processes whose
environment points the client there (the client reads `HF_ENDPOINT` and `HF_HUB_DISABLE_XET` at import), while the
assertions read what the server received.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from huggingface_hub import ModelCard

from trl_async.hub import (
    CardSummary,
    build_model_card,
    metric_summaries,
    read_eval_results,
    reward_summary,
    validate_push_args,
    write_eval_results,
)
from trl_async.toy import tiny_model_path

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)
RECIPE_DIR = os.path.join(ROOT, "recipes")
from tests.support.hub.server import HubStub  # noqa: E402

BASE_REPO = "trl-async/tiny-qwen2"  # the bundled model, served by the stand-in as if it were on the Hub


# ---------------------------------------------------------------------------------------------------- pure parts
def _log_history():
    history = []
    for step in range(1, 9):
        history.append({"step": step, "reward": 0.1 * step, "async/staleness_mean": step % 2,
                        "async/evicted": float(step // 4), "m2po/masked_fraction": 0.01 * step, "loss": 0.5})  # fmt: skip
    history.append({"step": 8, "train_runtime": 12.5})
    return history


def _eval_results():
    return {
        "dataset": "openai/gsm8k", "split": "test", "num_samples": 200, "max_new_tokens": 256,
        "train_dataset": {"name": "openai/gsm8k", "hub_id": "openai/gsm8k"},
        "before": {"accuracy": 0.25, "correct": 50, "total": 200, "ci95": [0.19, 0.31]},
        "after": {"accuracy": 0.4, "correct": 80, "total": 200, "ci95": [0.33, 0.47]}, "gain": 0.15,
    }  # fmt: skip


def _summary(**overrides):
    fields = dict(
        trainer_kind="grpo", trainer_class="AsyncGRPOTrainer", model_name="qwen-gsm8k-lora",
        hub_model_id="me/qwen-gsm8k-lora", load_id="me/qwen-gsm8k-lora", base_model="Qwen/Qwen2.5-0.5B-Instruct",
        base_model_path=None, is_adapter=True, peft_type="LORA", loss_type="m2po", async_generation=True,
        max_staleness=2, reward_functions=["math_answer_reward", "format_reward"],
        config={"loss_type": "m2po", "max_staleness": 2, "m2po_threshold": 0.04, "reward_weights": [1.0, 0.2]},
        log_history=_log_history(), global_step=8, eval_results=_eval_results(), dataset_name="openai/gsm8k",
    )  # fmt: skip
    fields.update(overrides)
    return CardSummary(**fields)


def test_card_metadata_and_body_for_an_m2po_lora_run():
    card = ModelCard(str(build_model_card(_summary())))  # parsed back from its text, as the Hub would
    data = card.data
    assert data.base_model == "Qwen/Qwen2.5-0.5B-Instruct"
    assert data.library_name == "peft" and data.pipeline_tag == "text-generation"
    assert data.datasets == ["openai/gsm8k"]
    assert {"trl", "trl-async", "grpo", "m2po", "lora"} <= set(data.tags) and "ppo" not in data.tags
    [result] = data.eval_results
    assert (result.metric_type, result.metric_value, result.dataset_type, result.dataset_split) == (
        "accuracy", 0.4, "openai/gsm8k", "test",
    )  # fmt: skip
    text = card.text
    assert "| `max_staleness` | 2 |" in text and "| `loss_type` | m2po |" in text
    assert "`math_answer_reward`, `format_reward` (weights 1.0, 0.2)" in text
    assert "| before training | 0.25 | 50 / 200 |" in text and "| after training | **0.4** | 80 / 200 |" in text
    assert "arXiv:2510.01161" in text and "Haizhong Zheng" in text  # the M2PO citation
    assert "arXiv:2402.03300" in text  # GRPO, from TRL's GRPOTrainer._paper
    assert 'PeftModel.from_pretrained(base, "me/qwen-gsm8k-lora")' in text
    # Final metrics, re-derived here: rewards 0.1..0.8, quarters of two steps.
    assert "| mean reward, first → last quarter of steps | 0.15 → 0.75 (+0.6) |" in text
    assert "| final reward (last logged step) | 0.8 |" in text
    assert "| `async/evicted` | 0.75 | 2 | 2 |" in text  # mean of 0,0,0,1,1,1,1,2
    assert "| `m2po/masked_fraction` | 0.045 | 0.08 | 0.08 |" in text


def test_card_without_m2po_or_eval_and_for_ppo():
    card = ModelCard(
        str(build_model_card(_summary(loss_type="dapo", eval_results=None, config={"loss_type": "dapo"})))
    )
    assert "m2po" not in card.data.tags and "2510.01161" not in card.text
    assert card.data.eval_results is None and "## Results" not in card.text
    assert "truncated importance correction" in card.text  # TRL's loss types, stale rows, async
    ppo = ModelCard(str(build_model_card(_summary(trainer_kind="ppo", is_adapter=False, peft_type=None))))
    assert "ppo" in ppo.data.tags and "grpo" not in ppo.data.tags and "lora" not in ppo.data.tags
    assert ppo.data.library_name == "transformers" and "arXiv:1707.06347" in ppo.text
    assert "arXiv:2402.03300" not in ppo.text
    with pytest.raises(ValueError, match="trainer_kind='sft'"):
        _summary(trainer_kind="sft")


def test_local_base_model_is_named_without_its_path():
    card = build_model_card(_summary(base_model=None, base_model_path="tiny_qwen2"))
    assert card.data.base_model is None and "a local model (`tiny_qwen2`)" in card.text


def test_reward_and_metric_summaries_against_plain_loops():
    history = _log_history()
    summary = reward_summary(history)
    assert summary["steps"] == 8 and summary["first_quarter"] == pytest.approx((0.1 + 0.2) / 2)
    assert summary["last_quarter"] == pytest.approx((0.7 + 0.8) / 2) and summary["final"] == pytest.approx(0.8)
    assert reward_summary(history[:3])["gain"] is None
    # Steps where every reward function returned None log `reward: None` (TRL): left out, never a crash at save time.
    unscored = [{**entry, "reward": None} if "reward" in entry else entry for entry in history[:4]] + history
    assert reward_summary(unscored) == summary
    metrics = metric_summaries(history)
    assert set(metrics) == {"async/staleness_mean", "async/evicted", "m2po/masked_fraction"}
    staleness = [step % 2 for step in range(1, 9)]
    assert metrics["async/staleness_mean"]["mean"] == pytest.approx(sum(staleness) / 8)
    assert metrics["async/staleness_mean"]["last"] == 0 and metrics["async/staleness_mean"]["max"] == 1


def test_eval_results_round_trip_and_schema(tmp_path):
    assert read_eval_results(str(tmp_path)) is None
    write_eval_results(str(tmp_path), _eval_results())
    assert read_eval_results(str(tmp_path)) == _eval_results()
    with pytest.raises(ValueError, match="'after'"):
        write_eval_results(str(tmp_path), {"dataset": "x", "num_samples": 1, "before": {}})


def test_push_without_hub_model_id_is_refused():
    from trl import GRPOConfig

    with pytest.raises(ValueError, match="hub_model_id"):
        validate_push_args(GRPOConfig(output_dir="unused", push_to_hub=True, report_to="none", bf16=False))
    validate_push_args(GRPOConfig(output_dir="unused", push_to_hub=False, report_to="none", bf16=False))


# ---------------------------------------------------------------------------------------------------- the stand-in
@pytest.fixture()
def hub():
    with HubStub() as stub:
        stub.seed(BASE_REPO, tiny_model_path())
        yield stub


def _run(script: str, args: list[str], env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**env, "PYTHONPATH": os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return proc


def test_stub_speaks_the_client_protocol(hub, tmp_path):
    """The stand-in itself: upload (regular + LFS), listing, download and the client's error classes."""
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "notes.txt").write_text("hello")
    (folder / "weights.safetensors").write_bytes(os.urandom(2048))
    script = """
        import sys
        from huggingface_hub import HfApi, hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError
        api = HfApi()
        api.create_repo("me/demo")
        api.create_repo("me/demo", exist_ok=True)
        info = api.upload_folder(repo_id="me/demo", folder_path=sys.argv[1], commit_message="add")
        print("FILES", sorted(api.list_repo_files("me/demo")))
        print("SHA", api.model_info("me/demo").sha == info.oid)
        print("BYTES", open(hf_hub_download("me/demo", "weights.safetensors"), "rb").read() == open(sys.argv[1] + "/weights.safetensors", "rb").read())
        for repo, name, error in (("me/demo", "nope.txt", EntryNotFoundError), ("me/nope", "x", RepositoryNotFoundError)):
            try:
                hf_hub_download(repo, name)
            except error:
                print("RAISED", error.__name__)
    """
    proc = _run(script, [str(folder)], hub.client_env(str(tmp_path / "cache")))
    assert "FILES ['.gitattributes', 'notes.txt', 'weights.safetensors']" in proc.stdout
    assert "SHA True" in proc.stdout and "BYTES True" in proc.stdout
    assert proc.stdout.count("RAISED") == 2
    assert hub.lfs_paths("me/demo") == {"weights.safetensors"}  # as the Hub would store it
    assert any(m == "PUT" and p.startswith("/_lfs/") for m, p, _ in hub.requests)  # LFS basic transfer happened
    assert hub.unhandled == []
    env = hub.client_env(str(tmp_path / "cache"))
    del env["HF_TOKEN"]
    proc = subprocess.run([sys.executable, "-c", "from huggingface_hub import create_repo; create_repo('me/x', token=False)"],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert proc.returncode != 0 and "401" in proc.stderr  # writes need a token, as on the Hub


RECIPE_PUSH_SCRIPT = """
    import json, sys
    import torch
    sys.path.insert(0, sys.argv[1])
    import qwen_math
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    output_dir, repo, repo2, result_path, base_repo = sys.argv[2:7]
    trainer = qwen_math.main([
        "--model_name_or_path", base_repo, "--output_dir", output_dir, "--push_to_hub", "true", "--hub_model_id", repo,
        "--use_peft", "true", "--lora_r", "8", "--lora_alpha", "16",
        "--lora_target_modules", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
        "--max_steps", "4", "--per_device_train_batch_size", "16", "--num_generations", "4", "--learning_rate", "2e-3",
        "--max_completion_length", "32", "--eval_max_samples", "24", "--logging_steps", "1",
    ])
    tokenizer = trainer.processing_class
    probe = tokenizer(["<|im_start|>user\\nWhat is 47+38?<|im_end|>\\n<|im_start|>assistant\\n7+8=15"], return_tensors="pt")
    trained = trainer.accelerator.unwrap_model(trainer.model).eval()
    base = AutoModelForCausalLM.from_pretrained(base_repo).eval()
    with torch.no_grad():
        trained_logits = trained(**probe).logits
        base_logits = base(**probe).logits
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_repo), repo).eval()
        reloaded_logits = reloaded(**probe).logits
    # The trainer's own push_to_hub, from the same run, to a second repository.
    trainer.args.hub_model_id = repo2
    trainer.hub_model_id = None
    trainer.push_to_hub()
    json.dump({
        "reloaded_vs_trained": (reloaded_logits - trained_logits).abs().max().item(),
        "trained_vs_base": (trained_logits - base_logits).abs().max().item(),
        "reloaded_type": type(reloaded).__name__,
    }, open(result_path, "w"))
"""


def test_recipe_push_reload_and_the_trainers_own_push(hub, tmp_path):
    output_dir, result = tmp_path / "out", tmp_path / "result.json"
    repo, repo2 = "alice/tiny-math-lora", "alice/tiny-math-lora-again"
    env = hub.client_env(str(tmp_path / "cache"))
    _run(RECIPE_PUSH_SCRIPT, [RECIPE_DIR, str(output_dir), repo, repo2, str(result), BASE_REPO], env)
    assert hub.unhandled == []

    files = hub.files(repo)
    expected = {
        ".gitattributes", "README.md", "adapter_config.json", "adapter_model.safetensors", "tokenizer.json",
        "tokenizer_config.json", "chat_template.jinja", "training_args.bin", "eval.json", "reward_summary.json",
        "trainer_state.json", "reward_accuracy.png", "timeline.json", "timeline.png",
    }  # fmt: skip
    assert set(files) == expected  # the timeline's fragments (`_timeline-fragments/`) stay out
    assert hub.lfs_paths(repo) == {"adapter_model.safetensors", "training_args.bin", "reward_accuracy.png",
                                   "timeline.png"}  # fmt: skip
    assert files["adapter_model.safetensors"] == (output_dir / "adapter_model.safetensors").read_bytes()
    adapter_config = json.loads(files["adapter_config.json"])
    assert adapter_config["r"] == 8 and adapter_config["lora_alpha"] == 16
    assert set(adapter_config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"}  # fmt: skip
    assert adapter_config["base_model_name_or_path"] == BASE_REPO

    card = ModelCard(files["README.md"].decode())
    assert card.data.base_model == BASE_REPO and card.data.library_name == "peft"
    assert card.data.pipeline_tag == "text-generation"
    assert {"trl", "trl-async", "grpo", "m2po", "lora"} <= set(card.data.tags)
    eval_json = json.loads(files["eval.json"])
    assert eval_json["num_samples"] == 24 and eval_json["dataset"] == "arithmetic"
    [result_entry] = card.data.eval_results
    assert result_entry.metric_value == eval_json["after"]["accuracy"]
    before, after = eval_json["before"], eval_json["after"]
    assert f"| before training | {before['accuracy']:.4g} | {before['correct']} / 24 |" in card.text
    assert f"| after training | **{after['accuracy']:.4g}** | {after['correct']} / 24 |" in card.text
    state = json.loads(files["trainer_state.json"])
    rewards = [e["reward"] for e in state["log_history"] if "reward" in e]
    assert len(rewards) == 4 and f"| final reward (last logged step) | {rewards[-1]:.4g} |" in card.text
    assert "| `max_staleness` | 1 |" in card.text and "`math_answer_reward`" in card.text
    assert "| `async/staleness_mean` |" in card.text and "| `m2po/masked_fraction` |" in card.text
    assert "| `lora_r` | 8 |" in card.text and "arXiv:2510.01161" in card.text
    assert "![Reward per step and accuracy before/after training](reward_accuracy.png)" in card.text

    # Downloaded back through the client, the adapter reloads on the base model with the trained model's logits.
    outcome = json.loads(result.read_text())
    assert outcome["reloaded_type"] == "PeftModelForCausalLM"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(hub.downloads(repo))
    assert outcome["trained_vs_base"] > 1e-3  # training changed the model, so the comparison means something
    assert outcome["reloaded_vs_trained"] < 1e-5

    # The trainer's own push_to_hub (no recipe code) produced the same card, up to the repository name.
    card2 = hub.files(repo2)["README.md"].decode()
    normalize = lambda text, name: text.replace(name, "REPO").replace(name.split("/")[-1], "NAME")  # noqa: E731
    assert normalize(card2, repo2) == normalize(files["README.md"].decode(), repo)
    assert hub.files(repo2)["adapter_model.safetensors"] == files["adapter_model.safetensors"]


USER_SCRIPT = """
    import sys
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig
    from trl_async import AsyncGRPOTrainer
    from trl_async.toy import make_arithmetic_dataset
    from trl_async.rewards import MathAnswerReward

    output_dir, repo, base_repo = sys.argv[1:4]
    tokenizer = AutoTokenizer.from_pretrained(base_repo)
    args = GRPOConfig(output_dir=output_dir, max_steps=3, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=24, logging_steps=1, save_strategy="no", report_to="none", bf16=False,
                      push_to_hub=True, hub_model_id=repo)
    trainer = AsyncGRPOTrainer(model=base_repo, reward_funcs=MathAnswerReward(tokenizer), args=args,
                               train_dataset=make_arithmetic_dataset(num_train=64, seed=1)["train"],
                               processing_class=tokenizer,
                               peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainer.train()
    trainer.push_to_hub(dataset_name="openai/gsm8k")
"""


def test_a_user_scripts_push_to_hub_gets_the_trl_async_card(hub, tmp_path):
    repo = "bob/tiny-grpo-lora"
    _run(USER_SCRIPT, [str(tmp_path / "out"), repo, BASE_REPO], hub.client_env(str(tmp_path / "cache")))
    assert hub.unhandled == []
    files = hub.files(repo)
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md", "tokenizer.json"} <= set(files)
    card = ModelCard(files["README.md"].decode())
    assert card.data.library_name == "peft" and card.data.base_model == BASE_REPO
    assert card.data.datasets == ["openai/gsm8k"]
    assert {"trl", "trl-async", "grpo", "lora"} <= set(card.data.tags) and "m2po" not in card.data.tags
    assert card.data.eval_results is None  # no evaluation was run, and the card does not pretend otherwise
    assert "| `loss_type` | dapo |" in card.text and "| `lora_r` | 4 |" in card.text
    assert "| `async/staleness_mean` |" in card.text and "2510.01161" not in card.text
    assert "| optimizer steps | 3 |" in card.text
