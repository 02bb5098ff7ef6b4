"""Checks of the trl_compat harness itself: `python -m pytest tests/test_trl_compat_harness.py`.

The harness's numbers are only as good as its pieces: the import swap must replace exactly TRL's class, the
stand-ins must be read by the real Hugging Face clients offline, the recorder must report pytest's outcomes, and the
async evidence must tell an asynchronous `train()` from a synchronous one. Each test below checks one of these
against the real thing (real pytest, real `datasets`/`transformers` clients in a fresh offline process, a real
`AsyncGRPOTrainer` run).
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.trl_compat import run_trl_compat
from benchmarks.trl_compat.swap_module import SWAP_MODULE_SOURCE
from tests.support.hub import cache as hub_standins

HERE = Path(run_trl_compat.__file__).resolve().parent

TRL_MIRROR = Path("/work/.mirror/huggingface+trl/repo")


def _imported_from(source: str) -> dict[str, tuple[str | None, int]]:
    """{bound name: (module, level)} of every `from X import Y [as Z]` in `source`."""
    bound = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                bound[alias.asname or alias.name] = (node.module, node.level)
    return bound


# ------------------------------------------------------------------------------------------------ the import swap


@pytest.mark.parametrize(
    "source, bound_name, other_names",
    [
        ("from trl import GRPOConfig, GRPOTrainer\n", "GRPOTrainer", ["GRPOConfig"]),
        ("from trl import (\n    GRPOConfig,\n    GRPOTrainer as Trainer,\n)\nx = 1\n", "Trainer", ["GRPOConfig"]),
        ("from trl.trainer.grpo_trainer import GRPOTrainer\n", "GRPOTrainer", []),
        ("import os\n\nif True:\n    from trl import GRPOTrainer\n", "GRPOTrainer", []),
    ],
)
def test_swap_replaces_only_grpo_trainer(source, bound_name, other_names):
    patched = run_trl_compat.swap_grpo_trainer_import(source)
    bound = _imported_from(patched)
    assert bound[bound_name] == ("_trl_compat_swap", 1)
    for name in other_names:
        assert bound[name][0] == "trl"
    assert not any(
        module and module.startswith("trl") and name == "GRPOTrainer" for name, (module, _) in bound.items()
    )
    compile(patched, "patched", "exec")


def test_swap_refuses_what_it_cannot_swap():
    with pytest.raises(ValueError, match="nothing to swap"):
        run_trl_compat.swap_grpo_trainer_import("from trl import GRPOConfig\n")
    with pytest.raises(ValueError, match="trl.GRPOTrainer directly"):
        run_trl_compat.swap_grpo_trainer_import("import trl\nfrom trl import GRPOTrainer\nT = trl.GRPOTrainer\n")


@pytest.mark.skipif(not TRL_MIRROR.exists(), reason="TRL mirror not fetched")
def test_swap_on_trls_test_file():
    source = run_trl_compat._git_show(str(TRL_MIRROR), "HEAD", run_trl_compat.TEST_FILE)
    patched = run_trl_compat.swap_grpo_trainer_import(source)
    assert patched.count("from ._trl_compat_swap import GRPOTrainer") == 1
    assert _imported_from(patched)["GRPOTrainer"] == ("_trl_compat_swap", 1)
    # Only the import lines changed: everything else is byte-identical.
    changed = set(source.splitlines()) ^ set(patched.splitlines())
    assert all("import" in line for line in changed), changed


def test_missing_import_utils_names_read_as_unavailable():
    source = "from trl.import_utils import is_vllm_available, is_surely_not_in_trl_available\n"
    namespace: dict = {}
    exec(compile(run_trl_compat.tolerate_missing_import_utils(source), "patched", "exec"), namespace)
    import_utils = importlib.import_module("trl.import_utils")
    assert namespace["is_vllm_available"] is import_utils.is_vllm_available
    assert namespace["is_surely_not_in_trl_available"]() is False


# ------------------------------------------------------------------------------------------------ stand-ins

_ZEN_LIKE_SCRIPT = textwrap.dedent(
    """
    from datasets import Dataset
    def main(test_size, push_to_hub, repo_id):
        a = Dataset.from_dict({"prompt": ["one", "two"]})
        a = a.train_test_split(test_size=test_size, shuffle=False)
        if push_to_hub:
            a.push_to_hub(repo_id, config_name="standard_prompt_only")
        b = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]]})
        b.push_to_hub(repo_id, config_name="conversational_prompt_only")
        c = Dataset.from_dict(make_rows())  # not a literal: skipped
        c.push_to_hub(repo_id, config_name="computed")
    """
)


def test_parse_zen_script_reads_literal_configs_only():
    configs = hub_standins.parse_zen_script(_ZEN_LIKE_SCRIPT)
    assert configs == {
        "standard_prompt_only": {"prompt": ["one", "two"]},
        "conversational_prompt_only": {"prompt": [[{"role": "user", "content": "hi"}]]},
    }


@pytest.mark.skipif(not TRL_MIRROR.exists(), reason="TRL mirror not fetched")
def test_parse_trls_zen_script():
    source = run_trl_compat._git_show(str(TRL_MIRROR), "HEAD", run_trl_compat.ZEN_SCRIPT)
    configs = hub_standins.parse_zen_script(source)
    prompts = configs["standard_prompt_only"]["prompt"]
    # The prompts TRL's test_prepare_input_called_with_correct_data expects first, in order.
    assert prompts[:3] == ["Beautiful is better than", "Explicit is", "Simple is better"]
    assert len(prompts) == 19
    assert configs["conversational_prompt_only"]["prompt"][0] == [
        {"role": "user", "content": "What is better than ugly?"}
    ]


@pytest.mark.parametrize("family_name", ["qwen2.5", "llama3", "gemma3"])
def test_tokenizer_has_the_family_special_ids(tmp_path, family_name):
    from transformers import AutoTokenizer

    family = hub_standins.TOKENIZER_FAMILIES[family_name]
    hub_standins.write_tokenizer(family, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == family.vocab_size
    for token_id, token in family.specials.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
    assert tokenizer.eos_token == family.eos
    text = "Beautiful is better than ugly."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    # Every regular id decodes to some text (what a random model samples must be decodable).
    regular = [i for i in (0, 1000, family.vocab_size // 2, family.vocab_size - 1) if i not in family.specials]
    assert all(tokenizer.decode([i]).strip() for i in regular)


def _offline_python(hub_dir: Path, code: str) -> dict:
    """Run `code` in a fresh interpreter pointed at the stand-in cache, offline; it prints one JSON line."""
    env = {**os.environ, **hub_standins.hub_env(hub_dir)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_datasets_are_served_offline_by_the_real_client(tmp_path):
    prompts = [f"prompt {i}" for i in range(10)]
    env = hub_standins.hub_env(tmp_path)
    hub_standins._write_dataset_config(
        Path(env["HF_DATASETS_CACHE"]), "trl-internal-testing/zen", "standard_prompt_only", {"prompt": prompts}
    )
    out = _offline_python(
        tmp_path,
        "import json; from datasets import load_dataset\n"
        "train = load_dataset('trl-internal-testing/zen', 'standard_prompt_only', split='train')\n"
        "whole = load_dataset('trl-internal-testing/zen', 'standard_prompt_only')\n"
        "stream = load_dataset('trl-internal-testing/zen', 'standard_prompt_only', split='test', streaming=True)\n"
        "print(json.dumps({'train': list(train['prompt']), 'splits': sorted(whole), 'stream': [r['prompt'] for r in stream],"
        " 'stream_type': type(stream).__name__}))",
    )
    # datasets' own train_test_split(test_size=0.1, shuffle=False) of 10 rows: 9 train, the last one test.
    assert out == {
        "train": prompts[:9],
        "splits": ["test", "train"],
        "stream": prompts[9:],
        "stream_type": "IterableDataset",
    }


def test_models_are_served_offline_by_the_real_client(tmp_path):
    repo_id = "trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5"
    env = hub_standins.hub_env(tmp_path)
    hub_standins._write_model_repo(Path(env["HF_HUB_CACHE"]), repo_id, hub_standins.MODEL_STANDINS[repo_id], tmp_path)
    out = _offline_python(
        tmp_path,
        "import json; from transformers import AutoModelForSequenceClassification, AutoTokenizer\n"
        f"m = AutoModelForSequenceClassification.from_pretrained({repo_id!r})\n"
        f"t = AutoTokenizer.from_pretrained({repo_id!r})\n"
        "print(json.dumps({'cls': type(m).__name__, 'labels': m.config.num_labels, 'dtype': str(m.dtype),"
        " 'eos': t.eos_token_id, 'pad': t.pad_token_id, 'template': t.chat_template is not None}))",
    )
    assert out == {
        "cls": "Qwen2ForSequenceClassification",
        "labels": 1,
        "dtype": "torch.bfloat16",
        "eos": 151645,
        "pad": 151643,
        "template": True,
    }


# ------------------------------------------------------------------------------------------------ recorder


def test_recorder_reports_pytests_outcomes(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.fixture
            def broken():
                raise RuntimeError("fixture broke")

            def test_pass():
                pass

            def test_fail():
                raise ValueError("first line\\nsecond line\\nlast line")

            def test_chained():
                try:
                    raise KeyError("inner")
                except KeyError as exc:
                    raise RuntimeError("outer") from exc

            @pytest.mark.skip(reason="not here")
            def test_skip():
                pass

            @pytest.mark.xfail(reason="known")
            def test_xfail():
                assert False

            def test_error(broken):
                pass
            """
        )
    )
    results = tmp_path / "results.jsonl"
    env = {**os.environ, "PYTHONPATH": str(HERE), "TRL_COMPAT_RESULTS": str(results)}
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_recorder", "test_sample.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        timeout=120,
    )
    records = [json.loads(line) for line in results.read_text().splitlines()]
    ends = {r["nodeid"].split("::")[-1]: r for r in records if r["event"] == "end"}
    starts = [r["nodeid"].split("::")[-1] for r in records if r["event"] == "start"]
    assert starts == ["test_pass", "test_fail", "test_chained", "test_skip", "test_xfail", "test_error"]
    assert {name: r["outcome"] for name, r in ends.items()} == {
        "test_pass": "passed",
        "test_fail": "failed",
        "test_chained": "failed",
        "test_skip": "skipped",
        "test_xfail": "xfailed",
        "test_error": "error",
    }
    assert ends["test_fail"]["message"] == "ValueError: first line"
    assert ends["test_fail"]["detail"] == "last line"
    assert ends["test_chained"]["message"] == "RuntimeError: outer"
    assert ends["test_chained"]["root_cause"] == "KeyError: 'inner'"
    assert ends["test_skip"]["reason"] == "not here"
    assert ends["test_error"]["message"] == "RuntimeError: fixture broke"


# ------------------------------------------------------------------------------------------------ summary


def test_summary_counts_kept_and_strict():
    ids = ["a", "b", "c", "d", "e", "f"]
    stock = {n: {"outcome": "passed"} for n in "abcde"} | {"f": {"outcome": "failed", "message": "X: y"}}
    swapped = {n: {"outcome": "passed"} for n in "abcf"} | {
        "d": {"outcome": "failed", "message": "ValueError: does not support reward model 'x' (only callables ...)"},
        "e": {"outcome": "failed", "message": "AssertionError: Parameter w.0 has not changed."},
    }
    train_log = [
        {"nodeid": "a", "async_keys": ["async/staleness_mean"]},  # trained asynchronously
        {"nodeid": "b", "async_keys": []},  # trained, but synchronously
        {"nodeid": "b", "async_keys": ["async/staleness_mean"]},
        # "c" never calls train()
    ]
    report = run_trl_compat.summarize(ids, {}, {"stock": stock, "swapped": swapped}, train_log, collected=6)
    s = report["summary"]
    assert (s["stock_passes"], s["kept"], s["kept_async_proven"], s["kept_without_train"]) == (5, 3, 1, 1)
    assert (s["kept_but_trained_synchronously"], s["kept_strict"], s["lost"]) == (1, 2, 2)
    assert s["kept_pct"] == 60.0 and s["kept_strict_pct"] == 40.0
    causes = {g["cause"]: g["tests"] for g in report["failure_groups"]}
    assert causes == {
        "reward model (nn.Module reward func) refused": ["d"],
        "AssertionError: Parameter … has not changed.": ["e"],
    }
    assert report["lists"]["kept_but_trained_synchronously"] == ["b"]
    assert report["lists"]["stock_failures"] == {"f": "X: y"}


# ------------------------------------------------------------------------------------------------ async evidence


def _train_with_swapped_class(tmp_path, async_generation: bool) -> dict:
    """A real short run of the harness's swapped class on the bundled tiny model; returns its train-log record."""
    package = tmp_path / "swapped_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "_trl_compat_swap.py").write_text(SWAP_MODULE_SOURCE)
    log = tmp_path / "train.jsonl"
    code = textwrap.dedent(
        f"""
        import os
        os.environ["PYTEST_CURRENT_TEST"] = "tests/x.py::test_case (call)"
        from swapped_pkg._trl_compat_swap import GRPOTrainer
        from trl_async import AsyncGRPOConfig
        from trl_async.toy import tiny_model_path
        from datasets import Dataset

        prompts = [[{{"role": "user", "content": f"{{i}}+{{i}}="}}] for i in range(8)]
        args = AsyncGRPOConfig(
            output_dir={str(tmp_path / "out")!r}, per_device_train_batch_size=4, num_generations=4,
            max_completion_length=4, max_steps=2, report_to="none", use_cpu=True, bf16=False,
            logging_steps=1, async_generation={async_generation},
        )
        trainer = GRPOTrainer(
            model=tiny_model_path(), reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
            args=args, train_dataset=Dataset.from_dict({{"prompt": prompts}}),
        )
        trainer.train()
        """
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(run_trl_compat.REPO_ROOT)]),
        "TRL_COMPAT_TRAIN_LOG": str(log),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 1
    return records[0]


def test_async_evidence_tells_async_from_sync(tmp_path):
    asynchronous = _train_with_swapped_class(tmp_path / "a", async_generation=True)
    synchronous = _train_with_swapped_class(tmp_path / "s", async_generation=False)
    assert asynchronous["nodeid"] == synchronous["nodeid"] == "tests/x.py::test_case"
    assert "async/staleness_mean" in asynchronous["async_keys"]
    assert asynchronous["async_generation"] is True and asynchronous["global_step"] == 2
    assert synchronous["async_keys"] == []
    assert synchronous["async_generation"] is False and synchronous["global_step"] == 2
