"""Tests for the bundled tiny model in trl_async/toy/tiny_qwen2 (built by ``python -m trl_async.toy.build``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trl_async.toy import arithmetic_solution, greedy_accuracy, make_arithmetic_dataset, tiny_model_path

PATH = tiny_model_path()
CHATML = "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(PATH, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(PATH, local_files_only=True)


def test_folder_contents():
    assert os.path.isabs(PATH) and os.path.isdir(PATH)
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert os.path.isfile(os.path.join(PATH, name)), name
    assert os.path.getsize(os.path.join(PATH, "model.safetensors")) <= 10 * 1024 * 1024
    with open(os.path.join(PATH, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "qwen2"
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["torch_dtype"] == "float32"


def test_loads_with_hub_offline():
    """A fresh interpreter with HF_HUB_OFFLINE=1 loads both and generates."""
    code = (
        "import sys; from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "p = sys.argv[1]\n"
        "t = AutoTokenizer.from_pretrained(p); m = AutoModelForCausalLM.from_pretrained(p)\n"
        "enc = t.apply_chat_template([[{'role': 'user', 'content': 'What is 12+34?'}]], add_generation_prompt=True,"
        " tokenize=True, return_dict=True, return_tensors='pt')\n"
        "out = m.generate(**enc, max_new_tokens=40, do_sample=False)\n"
        "print('OK', type(m).__name__, t.decode(out[0, enc['input_ids'].shape[1]:], skip_special_tokens=True))\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", code, PATH], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "OK Qwen2ForCausalLM" in res.stdout
    assert "####" in res.stdout  # it answers in the trained format


def test_every_digit_is_one_token(tokenizer):
    digit_ids = []
    for d in "0123456789":
        ids = tokenizer.encode(d, add_special_tokens=False)
        assert len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids) == [d]
        digit_ids.append(ids[0])
    assert len(set(digit_ids)) == 10
    for number in ["10", "99", "1234567890", "100000", "-35", "007"]:
        ids = tokenizer.encode(number, add_special_tokens=False)
        digits = [c for c in number if c.isdigit()]
        assert [i for i in ids if i in digit_ids] == [digit_ids[int(c)] for c in digits]
        assert sum(i in digit_ids for i in ids) == len(digits)
    # also inside text: one token per digit, and the text round-trips
    text = "What is 47+38? 7+8=15, 4+3+1=8. #### 85"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert sum(i in digit_ids for i in ids) == sum(c.isdigit() for c in text)
    assert tokenizer.decode(ids) == text


def test_special_tokens(tokenizer, model):
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.eos_token_id == im_end and tokenizer.pad_token_id == pad
    assert len({im_end, pad, im_start}) == 3
    assert tokenizer.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)[0] == im_start
    assert model.generation_config.eos_token_id == im_end
    assert model.generation_config.pad_token_id == pad
    assert model.config.vocab_size == len(tokenizer)


def test_chat_template(tokenizer):
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    assert tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == CHATML
    assert tokenizer.apply_chat_template(msgs, tokenize=False) == CHATML.removesuffix("<|im_start|>assistant\n")
    # exactly how TRL calls it: batched, tokenized, as a dict
    out = tokenizer.apply_chat_template([msgs, msgs[:1]], add_generation_prompt=True, tokenize=True, return_dict=True)
    assert len(out["input_ids"]) == 2 and out["input_ids"][0] == out["input_ids"][1]
    assert out["input_ids"][0] == tokenizer.encode(CHATML, add_special_tokens=False)
    assert all(m == 1 for m in out["attention_mask"][0])
    multi = msgs + [{"role": "assistant", "content": "#### 5"}]
    assert tokenizer.apply_chat_template(multi, tokenize=False) == CHATML + "#### 5<|im_end|>\n"


def test_solution_token_counts(tokenizer):
    texts = [arithmetic_solution(a, op, b) for op in "+-" for a in range(10, 100) for b in range(10, 100)]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    assert 12 <= min(lengths) and max(lengths) <= 30, (min(lengths), max(lengths))


def test_model_architecture_and_size(model):
    import torch
    from transformers import Qwen2ForCausalLM

    assert isinstance(model, Qwen2ForCausalLM)
    assert model.config.model_type == "qwen2"
    n = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= n <= 3_000_000, n
    assert model.config.tie_word_embeddings
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_greedy_accuracy_in_band(model, tokenizer):
    test = make_arithmetic_dataset()["test"]
    assert len(test) == 200
    acc = greedy_accuracy(model, tokenizer, test)
    assert 0.20 <= acc <= 0.45, acc
