"""`--help` of every command a user can run (issue 32): each exits 0 and names its main options.

The commands are discovered, so a new one is covered the day it is added:

- every script under `recipes/` and `benchmarks/`: a `.py` file with an `if __name__ == "__main__":` block or one
  that reads `sys.argv` at module level (a guard-less script such as `benchmarks/docs_style_grpo.py`), and every
  `.sh` file (run with `bash`);
- every `python -m` entry point of the package: a module under `trl_async/` with a `__main__` block, or a package's
  `__main__.py`;
- the test tools the docs tell users to run (`DOCUMENTED_TEST_TOOLS`).

Each runs in a child process, offline, from a temporary folder. `MAIN_OPTIONS` says which options the help of each
known command must name (written here by hand from what each command is for, not read from its parser); a command
not listed there must still print a usage that names at least one option besides `--help`. A `MAIN_OPTIONS` entry
whose command is no longer discovered fails the suite, so the table cannot go stale.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT_FOLDERS = ("recipes", "benchmarks")
PACKAGE = "trl_async"
DOCUMENTED_TEST_TOOLS = ("tests.support.hub.server",)  # docs/recipe.md: a local Hub stand-in for trying a push

RECIPE_OPTIONS = ("--config", "--model_name_or_path", "--dataset", "--trainer", "--max_steps", "--loss_type",
                  "--max_staleness", "--use_peft", "--push_to_hub", "--hub_model_id", "--output_dir", "--report_to")  # fmt: skip
# command (a script's path from the repository root, or "-m module") -> the options its --help must name
MAIN_OPTIONS: dict[str, tuple[str, ...]] = {
    "recipes/qwen_math.py": RECIPE_OPTIONS,
    "recipes/accelerate_configs/multinode_grpo.py": ("VLLM_SERVER_URLS", *RECIPE_OPTIONS, "--use_vllm", "--vllm_mode"),
    "benchmarks/bench_async.py": ("--repeats", "--steps", "--contenders", "--quick", "--output"),
    "benchmarks/bench_before_after.py": ("--before", "--after", "--pairs", "--output"),
    "benchmarks/bench_components.py": ("--repeats", "--output"),
    "benchmarks/bench_docs_style.py": ("--pairs", "--steps", "--seeds", "--output"),
    "benchmarks/bench_tools.py": ("--pairs", "--steps", "--tool-latency-ms", "--eval-problems", "--output"),
    "benchmarks/bench_is_modes.py": ("--seeds", "--steps", "--staleness", "--quick", "--output"),
    "benchmarks/bench_losses.py": ("--repeats", "--quick", "--shapes", "--contenders", "--device", "--out"),
    "benchmarks/bench_main_job.py": ("--pairs", "--max_steps", "--seeds", "--regime", "--out"),
    "benchmarks/bench_ppo_vs_grpo.py": ("--steps", "--seeds", "--out"),
    "benchmarks/bench_rewards.py": ("--quick", "--repeats", "--out"),
    "benchmarks/bench_real_size.py": ("--pairs", "--steps", "--arms", "--completion-length", "--shape", "--out"),
    "benchmarks/real_size_grpo.py": ("MODEL_DIR", "DATA_JSONL", "OUTPUT_DIR", "--max-steps", "--steps-per-generation"),
    "benchmarks/bench_soak.py": ("--steps", "--modes", "--out"),
    "benchmarks/bench_staleness.py": ("--contenders", "--k", "--seeds", "--steps", "--out"),
    "benchmarks/bench_timeline_overhead.py": ("--output",),
    "benchmarks/bench_vllm_backends.py": ("--rows", "--max-new-tokens", "--repeats", "--out"),
    "benchmarks/docs_style_grpo.py": (
        "{trl,async,limit}",
        "MODEL_PATH",
        "DATA_JSONL",
        "OUTPUT_DIR",
        "MAX_STEPS",
        "SEED",
    ),
    "benchmarks/gpu_check.sh": ("--fetch-wheels", "--cpu-smoke"),
    "benchmarks/nightly.sh": ("-m nightly", "-k"),
    "benchmarks/run_all.py": ("--quick", "--smoke", "--render-only", "--list", "--only", "--skip", "--strict"),
    "benchmarks/trl_compat/run_trl_compat.py": ("--trl-repo", "--subset", "--runs", "--reuse-stock", "--output"),
    "-m trl_async.timeline": ("--png", "--no-png", "--steps", "--json", "--top"),
    "-m trl_async.toy.build": ("--out", "--seed", "--max-steps"),
    "-m trl_async.rollout.backends.vllm": ("--model", "--port", "--host", "--tensor_parallel_size"),
    "-m trl_async.rollout.backends.vllm_server": ("--model", "--port", "--host", "--tensor_parallel_size"),
    "-m tests.support.hub.server": ("--port",),
}
# Further invocations of a discovered command: (command, arguments before --help, options the help must name).
MORE_INVOCATIONS = [
    ("recipes/qwen_math.py", ("--trainer", "ppo"), ("--vf_coef", "--kl_coef", "--cliprange", "--lam")),
]


def is_main_guard(node: ast.stmt) -> bool:
    """`if __name__ == "__main__":` (either operand order)."""
    if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and len(node.test.comparators) == 1):
        return False
    operands = [node.test.left, node.test.comparators[0]]
    names = [o.id for o in operands if isinstance(o, ast.Name)]
    strings = [o.value for o in operands if isinstance(o, ast.Constant)]
    return isinstance(node.test.ops[0], ast.Eq) and names == ["__name__"] and strings == ["__main__"]


def reads_argv_at_module_level(tree: ast.Module) -> bool:
    """A statement outside any function or class that reads `sys.argv`: a script without a `__main__` block."""
    for statement in tree.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for node in ast.walk(statement):
            if isinstance(node, ast.Attribute) and node.attr == "argv" and getattr(node.value, "id", None) == "sys":
                return True
    return False


def is_python_script(path: Path) -> bool:
    tree = ast.parse(path.read_text(), filename=str(path))
    return any(is_main_guard(statement) for statement in tree.body) or reads_argv_at_module_level(tree)


def discover_commands() -> list[str]:
    """Every command a user can run, as a key of MAIN_OPTIONS."""
    commands = []
    for folder in SCRIPT_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            relative = path.relative_to(ROOT).as_posix()
            if "results" in path.relative_to(ROOT).parts or not path.is_file():
                continue
            if (path.suffix == ".py" and is_python_script(path)) or path.suffix == ".sh":
                commands.append(relative)
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if path.name == "__main__.py":
            commands.append(f"-m {module.removesuffix('.__main__')}")
        elif is_python_script(path):
            commands.append(f"-m {module}")
    commands.extend(f"-m {module}" for module in DOCUMENTED_TEST_TOOLS)
    return commands


COMMANDS = discover_commands()


def run_help(command: str, arguments: tuple[str, ...], cwd: Path) -> subprocess.CompletedProcess:
    if command.startswith("-m "):
        argv = [sys.executable, "-m", command.removeprefix("-m ")]
    elif command.endswith(".sh"):
        argv = ["bash", str(ROOT / command)]
    else:
        argv = [sys.executable, str(ROOT / command)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("VLLM_SERVER_URLS", None)  # multinode_grpo.py's --help must not need its servers
    return subprocess.run([*argv, *arguments, "--help"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def options_in(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", text))


@pytest.mark.parametrize("command", COMMANDS)
def test_help_exits_0_and_names_the_main_options(command, tmp_path):
    proc = run_help(command, (), tmp_path)
    assert proc.returncode == 0, f"`{command} --help` exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    expected = MAIN_OPTIONS.get(command)
    if expected is None:  # a command added since the table was written: a usage with options at least
        assert "usage" in proc.stdout.lower(), proc.stdout[:2000]
        assert options_in(proc.stdout) - {"--help"}, f"`{command} --help` names no option: {proc.stdout[:2000]}"
        return
    missing = [option for option in expected if option not in proc.stdout]
    assert not missing, f"`{command} --help` does not name {missing}:\n{proc.stdout[:3000]}"
    assert not list(tmp_path.iterdir()), f"`{command} --help` wrote files: {list(tmp_path.iterdir())}"


@pytest.mark.parametrize(
    "command, arguments, expected", MORE_INVOCATIONS, ids=[f"{c} {' '.join(a)}" for c, a, _ in MORE_INVOCATIONS]
)
def test_help_with_arguments(command, arguments, expected, tmp_path):
    """`python recipes/qwen_math.py --trainer ppo --help`: the help of the PPO config's options."""
    proc = run_help(command, arguments, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    missing = [option for option in expected if option not in proc.stdout]
    assert not missing, f"`{command} {' '.join(arguments)} --help` does not name {missing}"


def test_the_table_of_main_options_names_only_discovered_commands():
    """Discovery finds what the table was written for (so it is not vacuous), and the table has no entry for a
    command that no longer exists."""
    stale = sorted(set(MAIN_OPTIONS) - set(COMMANDS))
    assert not stale, f"MAIN_OPTIONS names commands that are not discovered any more: {stale}"
    assert {"recipes/qwen_math.py", "benchmarks/docs_style_grpo.py", "-m trl_async.toy.build"} <= set(COMMANDS)


def test_discovery_tells_scripts_from_modules(tmp_path):
    """The rules on files written here: a `__main__` block or a module-level `sys.argv` makes a script; a library
    module that reads `sys.argv` only inside a function does not."""
    cases = {
        "guarded.py": 'import sys\n\ndef main():\n    print(sys.argv)\n\nif __name__ == "__main__":\n    main()\n',
        "reversed_guard.py": 'if "__main__" == __name__:\n    pass\n',
        "guardless.py": "import sys\n\nname = sys.argv[1]\n",
        "library.py": "import sys\n\ndef command():\n    return sys.argv[1:]\n",
        "other_guard.py": 'if __name__ == "not_main":\n    pass\n',
    }
    found = {}
    for name, source in cases.items():
        (tmp_path / name).write_text(source)
        found[name] = is_python_script(tmp_path / name)
    assert found == {"guarded.py": True, "reversed_guard.py": True, "guardless.py": True, "library.py": False,
                     "other_guard.py": False}  # fmt: skip
