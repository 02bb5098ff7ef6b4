"""The toy tool-calling task: the bundled chat template's tool calling, the tools variant of the tiny model
(`trl_async/toy/tiny_qwen2_tools`), the calculator tool and real stock-TRL runs with `tools=` on both models."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trl_async.toy import tiny_model_path
from trl_async.toy.build import CHAT_TEMPLATE, TOOL_TOKENS
from trl_async.toy.tools import (
    make_multiplication_dataset,
    multiply,
    tiny_tools_model_path,
    tool_accuracy,
    tool_call_text,
    tool_rollouts,
    tool_suffix_ids,
)

# The bundled tokenizer's chat template before tool calling was added: plain ChatML.
PLAIN_CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TOOL_CONVERSATION = [
    {"role": "user", "content": "What is 347*829?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 347, "b": 829}}}],
    },
    {"role": "tool", "name": "multiply", "content": "287663"},
    {"role": "assistant", "content": "#### 287663"},
]
TOOL_CONVERSATION_TEXT = (
    "<|im_start|>system\n<tools>\nmultiply(a, b): Multiply two integers.\n</tools><|im_end|>\n"
    "<|im_start|>user\nWhat is 347*829?<|im_end|>\n"
    '<|im_start|>assistant\n<tool_call>\n{"name": "multiply", "arguments": {"a": 347, "b": 829}}\n</tool_call>'
    "<|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n287663\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n#### 287663<|im_end|>\n"
)


def add(a: int, b: int) -> int:
    """
    Add two integers.

    Args:
        a: The first number.
        b: The second number.

    Returns:
        The sum of a and b.
    """
    return a + b


def _load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return _load_tokenizer(tiny_model_path())


@pytest.fixture(scope="module")
def tools_tokenizer():
    return _load_tokenizer(tiny_tools_model_path())


@pytest.fixture(scope="module")
def tools_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_tools_model_path(), local_files_only=True)


# --------------------------------------------------------------------------------------------- the chat template
def test_both_bundled_tokenizers_carry_the_build_template(tiny_tokenizer, tools_tokenizer):
    """A rebuild (`python -m trl_async.toy.build [--tools]`) writes the template the folders ship."""
    assert tiny_tokenizer.chat_template == CHAT_TEMPLATE
    assert tools_tokenizer.chat_template == CHAT_TEMPLATE


@pytest.mark.parametrize(
    "conversation",
    [
        [{"role": "user", "content": "What is 23+58?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 23+58?"}],
        [
            {"role": "user", "content": "What is 2+3?"},
            {"role": "assistant", "content": "2+3=5. #### 5"},
            {"role": "user", "content": "And 4+4?"},
        ],
        [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": ""}],
    ],
)
def test_plain_conversations_render_as_before(tiny_tokenizer, conversation):
    """Without tools or tool calls the template is the plain ChatML one, to the byte and to the token: no prompt or
    completion of the plain arithmetic task changes."""
    for add_generation_prompt in (True, False):
        kwargs = dict(add_generation_prompt=add_generation_prompt)
        before = tiny_tokenizer.apply_chat_template(conversation, chat_template=PLAIN_CHATML, tokenize=False, **kwargs)
        after = tiny_tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
        assert after == before
        ids_before = tiny_tokenizer.apply_chat_template(conversation, chat_template=PLAIN_CHATML, **kwargs)
        assert tiny_tokenizer.apply_chat_template(conversation, **kwargs) == ids_before


def test_template_renders_a_tool_calling_conversation(tiny_tokenizer):
    text = tiny_tokenizer.apply_chat_template(TOOL_CONVERSATION, tools=[multiply], tokenize=False)
    assert text == TOOL_CONVERSATION_TEXT
    # A system message joins the tools' system turn; consecutive tool results share one user turn (Qwen2.5).
    two_calls = [
        {"role": "system", "content": "Use the tools."},
        TOOL_CONVERSATION[0],
        {**TOOL_CONVERSATION[1], "tool_calls": TOOL_CONVERSATION[1]["tool_calls"] * 2},
        TOOL_CONVERSATION[2],
        TOOL_CONVERSATION[2],
    ]
    text = tiny_tokenizer.apply_chat_template(two_calls, tools=[multiply, add], tokenize=False)
    assert text.startswith(
        "<|im_start|>system\nUse the tools.\n<tools>\nmultiply(a, b): Multiply two integers.\n"
        "add(a, b): Add two integers.\n</tools><|im_end|>\n<|im_start|>user\n"
    )
    assert "</tool_call>\n<tool_call>" in text
    assert text.endswith(
        "<tool_response>\n287663\n</tool_response>\n<tool_response>\n287663\n</tool_response><|im_end|>\n"
    )


def test_trl_accepts_the_template_for_tool_calling(tiny_tokenizer):
    """The checks `GRPOTrainer.__init__` runs with `tools=`."""
    from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

    assert supports_tool_calling(tiny_tokenizer)
    assert is_chat_template_prefix_preserving(tiny_tokenizer)
    plain = _load_tokenizer(tiny_model_path())
    plain.chat_template = PLAIN_CHATML
    assert not supports_tool_calling(plain)  # what `tools=` used to fail on


def test_trl_parses_tool_calls_in_this_format(tiny_tokenizer, tools_tokenizer):
    """TRL's Qwen response template parses what the template renders, on both tokenizers (the tools variant ships it
    in its config; the plain one is given it)."""
    from trl.chat_template_utils import parse_response, qwen3_template

    tiny = _load_tokenizer(tiny_model_path())
    tiny.response_template = qwen3_template
    assert getattr(tiny_tokenizer, "response_template", None) is None  # the plain job's decoding is unchanged
    assert tools_tokenizer.response_template == qwen3_template
    call = tool_call_text("multiply", {"a": 347, "b": 829}) + "<|im_end|>"
    for tokenizer in (tiny, tools_tokenizer):
        prefix = tokenizer.apply_chat_template(
            TOOL_CONVERSATION[:1], tools=[multiply], add_generation_prompt=True, return_dict=False
        )  # ids, as TRL passes them
        ids = tokenizer(call, add_special_tokens=False)["input_ids"]
        parsed = parse_response(tokenizer, ids, prefix=prefix, tools=[multiply])
        assert parsed["tool_calls"] == TOOL_CONVERSATION[1]["tool_calls"]
        assert parsed["content"] == ""
        answer = tokenizer("#### 287663<|im_end|>", add_special_tokens=False)["input_ids"]
        assert parse_response(tokenizer, answer, prefix=prefix, tools=[multiply]) == {
            "role": "assistant",
            "content": "#### 287663",
        }
        broken = tokenizer(call.replace("}}", "}"), add_special_tokens=False)["input_ids"]
        assert "tool_calls" not in parse_response(tokenizer, broken, prefix=prefix, tools=[multiply])


# --------------------------------------------------------------------------------------------- the tool and the task
def test_multiply_schema_and_strictness():
    """TRL renders and types tool calls from this schema (built from the type hints and the docstring)."""
    from transformers.utils import get_json_schema

    assert get_json_schema(multiply) == {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiply two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first factor."},
                    "b": {"type": "integer", "description": "The second factor."},
                },
                "required": ["a", "b"],
            },
            "return": {"type": "integer", "description": "The product of a and b."},
        },
    }
    assert multiply(347, 829) == 287663
    for bad in ("347", 3.0, True):
        with pytest.raises(TypeError, match="multiply: a must be an integer"):
            multiply(bad, 2)


def test_multiplication_dataset():
    data = make_multiplication_dataset(num_train=300, num_test=50, seed=3)
    test, train = data["test"], data["train"]
    assert len(train) == 300 and len(test) == 50
    prompts = [p[0]["content"] for p in list(train["prompt"]) + list(test["prompt"])]
    assert len(set(prompts)) == 350  # no problem twice, none shared by the splits
    for prompt, answer in zip(train["prompt"], train["answer"], strict=True):
        a, b = (int(x) for x in prompt[0]["content"].removeprefix("What is ").removesuffix("?").split("*"))
        assert 100 <= a <= 999 and 100 <= b <= 999 and answer == str(a * b)
    # The test split does not depend on num_train, and the seed matters.
    assert list(make_multiplication_dataset(num_train=10, num_test=50, seed=3)["test"]["prompt"]) == list(
        test["prompt"]
    )
    assert list(make_multiplication_dataset(num_train=10, num_test=50, seed=4)["test"]["prompt"]) != list(
        test["prompt"]
    )


# --------------------------------------------------------------------------------------------- the tools model
def test_tools_model_folder_and_offline_load(tools_tokenizer):
    path = tiny_tools_model_path()
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert os.path.isfile(os.path.join(path, name)), name
    assert os.path.getsize(os.path.join(path, "model.safetensors")) <= 6 * 1024 * 1024
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen2ForCausalLM"]
    # Each tool marker is one token, as in Qwen2.5, and digits are single tokens.
    for token in TOOL_TOKENS + tuple("0123456789"):
        assert len(tools_tokenizer(token, add_special_tokens=False)["input_ids"]) == 1, token
    code = (
        "import sys; from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "from trl_async.toy.tools import multiply\n"
        "p = sys.argv[1]; t = AutoTokenizer.from_pretrained(p); m = AutoModelForCausalLM.from_pretrained(p)\n"
        "enc = t.apply_chat_template([[{'role': 'user', 'content': 'What is 347*829?'}]], tools=[multiply],"
        " add_generation_prompt=True, return_dict=True, return_tensors='pt')\n"
        "out = m.generate(**enc, max_new_tokens=40, do_sample=False)\n"
        "print('OK', t.decode(out[0, enc['input_ids'].shape[1]:]))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code, path], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("OK ")


def test_tool_rollouts_execute_calls_and_mask_tool_tokens(tools_model, tools_tokenizer):
    """Sampled rollouts of the tools model: it emits well-formed calls, the tool runs, its result tokens are exactly the
    tool suffix and are masked 0, and the model's answer follows."""
    prompts = make_multiplication_dataset(num_train=0, num_test=48, seed=11)["test"]["prompt"]
    out = tool_rollouts(tools_model, tools_tokenizer, prompts, do_sample=True, temperature=1.0, seed=0)
    executed = [i for i, c in enumerate(out["completions"]) if len(c) > 1]
    assert executed, "no sampled rollout called the tool"
    for i in executed:
        call, tool_message = out["completions"][i][:2]
        args = call["tool_calls"][0]["function"]["arguments"]
        expected = str(multiply(**args)) if set(args) == {"a", "b"} else None
        if expected is not None and out["tool_failures"][i] == 0:
            assert tool_message == {"role": "tool", "name": "multiply", "content": expected}
        suffix = tool_suffix_ids(tools_tokenizer, [tool_message])
        mask, ids = out["tool_mask"][i], out["completion_ids"][i]
        start = mask.index(0)
        assert mask[start : start + len(suffix)] == [0] * len(suffix)
        assert ids[start : start + len(suffix)] == suffix
        assert all(mask[start + len(suffix) :])  # the answer turn is sampled
        assert ids[start - 1] == tools_tokenizer.eos_token_id  # the call turn ended with EOS
    for i in set(range(len(prompts))) - set(executed):
        assert all(out["tool_mask"][i]) and out["tool_calls"][i] == 0


def test_tools_model_has_rl_headroom(tools_model, tools_tokenizer):
    """What the build promises: sampled tool calls are often well-formed, answers often wrong."""
    test = make_multiplication_dataset(num_train=0, num_test=200, seed=0)["test"]
    sampled = tool_accuracy(tools_model, tools_tokenizer, test, do_sample=True, temperature=1.0, seed=0)
    assert 0.25 <= sampled["well_formed_rate"] <= 0.65
    assert sampled["accuracy"] <= 0.35
    assert sampled["correct_call_rate"] <= sampled["well_formed_rate"] <= sampled["tool_call_rate"]


# --------------------------------------------------------------------------------------------- stock TRL runs
def _grpo_config(tmp_path, **overrides):
    from trl import GRPOConfig

    values = dict(
        output_dir=str(tmp_path),
        report_to="none",
        max_steps=2,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=48,
        max_tool_calling_iterations=1,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        gradient_checkpointing=False,
        seed=0,
    )
    values.update(overrides)
    return GRPOConfig(**values)


def test_stock_trl_with_tools_on_the_bundled_tokenizer(tmp_path):
    """Stock `GRPOTrainer(tools=[add])` on the bundled tiny model: the template is accepted (it used to fail with "does
    not support tool calling") and two steps run. The plain model never calls a tool; TRL's Qwen response template is
    set on its tokenizer, which does not ship one."""
    from trl import GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from trl_async.rewards import math_answer_text_reward
    from trl_async.toy import make_arithmetic_dataset

    tokenizer = _load_tokenizer(tiny_model_path())
    tokenizer.response_template = qwen3_template
    trainer = GRPOTrainer(
        model=tiny_model_path(),
        processing_class=tokenizer,
        reward_funcs=math_answer_text_reward,
        args=_grpo_config(tmp_path, max_completion_length=16),
        train_dataset=make_arithmetic_dataset(num_train=16, num_test=0)["train"],
        tools=[add],
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "tools/call_frequency" in h]
    assert len(logs) == 2


def test_stock_trl_with_tools_on_the_tools_model(tmp_path):
    """Stock `GRPOTrainer(model=<tools model path>, tools=[multiply])`, no mocks: two steps, and the model's tool
    calls really run (the tool records them), appear in TRL's metrics and in the logged completions."""
    from trl import GRPOTrainer

    from trl_async.rewards import math_answer_text_reward

    calls = []

    def multiply(a: int, b: int) -> int:  # the task's tool, recording its calls
        """
        Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.

        Returns:
            The product of a and b.
        """
        calls.append((a, b))
        return a * b

    trainer = GRPOTrainer(
        model=tiny_tools_model_path(),  # a path: the tokenizer's saved response template is what TRL parses with
        reward_funcs=math_answer_text_reward,
        args=_grpo_config(tmp_path, per_device_train_batch_size=16, num_generations=8, log_completions=True),
        train_dataset=make_multiplication_dataset(num_train=32, num_test=0, seed=5)["train"],
        tools=[multiply],
    )
    trainer.train()
    assert calls, "the tools model made no tool call in 32 rollouts"
    frequencies = [h["tools/call_frequency"] for h in trainer.state.log_history if "tools/call_frequency" in h]
    assert len(frequencies) == 2 and sum(frequencies) > 0
    # The toy's suffix ids are TRL's (tool_rollouts and the tools build rely on it).
    messages = [{"role": "tool", "name": "multiply", "content": "287663"}]
    assert trainer._get_tool_suffix_ids(messages) == tool_suffix_ids(trainer.processing_class, messages)
