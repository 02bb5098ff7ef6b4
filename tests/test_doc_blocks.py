"""README's and the docs' code blocks run (issue 32), so they cannot drift from the code unnoticed.

Which blocks: every fenced block of README.md and of the markdown under docs/, recipes/ and benchmarks/
(`tests/support/doc_blocks.py` finds them). Blocks without a language (diagrams, sample output, file layouts) are
text and do not run.

**Marker.** A block that cannot run here says why on the line right above its fence, as an HTML comment (GitHub
does not show it):

    <!-- doc-test: skip (needs a GPU) -->

Such a block is reported as skipped with that reason (pytest's `-ra` summary lists them all). A block that shows a
call signature instead of code carries `<!-- doc-test: signature of module.Name -->`: its parameters, their order,
keyword-only marks and defaults are compared with `inspect.signature` of that object. Any other marker text is an
error, and so is a marker with no code block after it.

**Python blocks** run in a fresh interpreter, offline, from an empty temporary folder, as the program
`python_program` writes (`tests/support/doc_blocks.py`), with these substitutions:

1. A Hub model the block names (`HUB_MODEL_IDS`, e.g. "Qwen/Qwen2.5-0.5B-Instruct") becomes the bundled tiny model
   (`trl_async.toy.tiny_model_path()`, same Qwen2 architecture). A block naming another Hub model fails offline
   until its id is added there, or the block is marked.
2. Steps are cut short: `max_steps=N` becomes `max_steps=min(N, 2)` (`DOC_MAX_STEPS`), and a config of
   `TRAINING_CONFIGS` (GRPOConfig, AsyncGRPOConfig, AsyncPPOConfig) written without `max_steps` gets `max_steps=2`.
3. An argument written `...` (`AsyncPPOTrainer(model=..., reward_funcs=..., train_dataset=...)`) gets a stand-in:
   the tiny model, a text reward on the arithmetic task, 64 arithmetic prompts, or a small config of the trainer's
   kind (`PLACEHOLDERS` in `tests/support/doc_stand_ins.py`).
4. A name the block uses without defining it (`tokenizer`, the tensors of docs/m2po.md's API sketch) is bound to a
   stand-in first (`STAND_INS` there); one without a stand-in is an error.

A block that calls `.train()` must leave trainers that took every one of their (cut) steps.

**Shell blocks** run with bash from a temporary folder that links the repository's folders (so `recipes/...` paths
resolve and outputs stay out of the checkout), offline, with a private HF_HOME and TRACKIO_DIR:

- a command of this project (`python recipes/...`, `accelerate launch recipes/...`, `python benchmarks/...`,
  `python -m trl_async...` / `tests...`) runs with its cheapest flags appended (`CHEAP_FLAGS`: 2 steps of 8 rows,
  8 held-out problems, no picture; a benchmark's quick mode and an output file in the temporary folder); a command
  of this project without an entry there is an error;
- `export` lines, `&` (a background server, stopped when the block ends) and Python written into the block
  (`python - <<'EOF'`) run as written;
- other programs (`OTHER_TOOLS`: pip, dashboards, a Hub login) are not run; the test prints them. A block with no
  command of this project must be marked;
- a `--port N` becomes a free port wherever the block names N.

Tiers: the default suite checks every block's preparation (markers, stand-ins, flags, Python syntax), the signature
blocks, README's "Use it in your own script" block (it trains 2 steps) and every Python block that trains nothing;
`-m slow` runs every block.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.doc_blocks import (
    ROOT,
    Block,
    BlockError,
    all_blocks,
    markdown_files,
    python_program,
    shell_script,
    signature_mismatches,
    stray_markers,
    trains,
)
from tests.support.doc_stand_ins import DOC_MAX_STEPS, REPORT_ENV

BLOCKS = [block for block in all_blocks() if block.kind != "text"]
FAST_HEADINGS = {("README.md", "Use it in your own script")}  # blocks that train, yet run in the default suite
LINKED = ("recipes", "benchmarks", "tests", "trl_async", "docs", ".ci")  # what the shell blocks' paths name


def in_default_suite(block: Block) -> bool:
    if block.skip_reason or block.signature_target:
        return True
    if block.kind == "python":
        return (block.path, block.heading) in FAST_HEADINGS or not trains(block.code)
    return False


def block_params(blocks: list[Block]) -> list:
    return [
        pytest.param(block, id=block.id, marks=() if in_default_suite(block) else pytest.mark.slow) for block in blocks
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workdir(tmp_path: Path) -> Path:
    """An empty folder for the block, with the repository's folders linked in."""
    work = tmp_path / "work"
    work.mkdir()
    for name in LINKED:
        if (ROOT / name).exists():
            (work / name).symlink_to(ROOT / name)
    return work


def environment(tmp_path: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf_home"),  # no cache or accelerate config of this machine's user
        "TRACKIO_DIR": str(tmp_path / "trackio"),
        "MPLBACKEND": "Agg",
        "PYTHONPATH": str(ROOT),
        # `python` and `accelerate` in a block are this environment's
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
        REPORT_ENV: str(tmp_path / "report.json"),
    }
    return env


def run(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def output_tail(proc: subprocess.CompletedProcess) -> str:
    return f"--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-5000:]}"


# ----------------------------------------------------------------------------------------------- every block
@pytest.mark.parametrize("block", block_params(BLOCKS))
def test_doc_block_runs(block: Block, tmp_path):
    if block.skip_reason:
        pytest.skip(f"{block.location} ({block.kind}): {block.skip_reason}")
    if block.signature_target:
        problems = signature_mismatches(block.code, block.signature_target)
        assert not problems, f"{block.location} shows a signature that is not {block.signature_target}'s: {problems}"
        return
    work, env = workdir(tmp_path), environment(tmp_path)
    if block.kind == "python":
        program = python_program(block.code)
        (work / "block.py").write_text(program)
        proc = run([sys.executable, "block.py"], work, env)
        assert proc.returncode == 0, f"{block.location} failed; the program was:\n{program}\n{output_tail(proc)}"
        trainers = json.loads((tmp_path / "report.json").read_text())["trainers"]
        if trains(block.code):
            assert trainers, f"{block.location} calls .train() but leaves no trainer"
            for trainer in trainers:
                assert 0 < trainer["max_steps"] <= DOC_MAX_STEPS, trainer
                assert trainer["global_step"] == trainer["max_steps"], (
                    f"{block.location}: a run stopped early: {trainer}"
                )
        return
    script, left_out = shell_script(block.code, free_port())
    (work / "block.sh").write_text(script)
    proc = run(["bash", "block.sh"], work, env)
    assert proc.returncode == 0, f"{block.location} failed; the script was:\n{script}\n{output_tail(proc)}"
    assert "Traceback" not in proc.stderr, f"{block.location}: a command printed a traceback\n{output_tail(proc)}"
    if left_out:
        print(f"{block.location}: not run here: {left_out}")


def test_every_block_that_runs_is_prepared():
    """In the default suite, for every block the slow suite runs: its markers are known, Python parses and has a
    stand-in for every name it leaves open, every shell command is classified and has its cheap flags."""
    problems = []
    for block in BLOCKS:
        try:
            if block.skip_reason or block.signature_target:
                continue
            if block.kind == "python":
                compile(python_program(block.code), block.location, "exec")
            else:
                shell_script(block.code, free_port())
        except (BlockError, SyntaxError) as error:
            problems.append(f"{block.location}: {error}")
    assert not problems, "\n".join(problems)


def test_markers_sit_above_code_blocks():
    stray = [marker for path in markdown_files() for marker in stray_markers(path)]
    assert not stray, f"doc-test markers with no code block after them: {stray}"


def test_the_blocks_are_found():
    """The finder is not vacuous: README's blocks and a skip-marked and a signature block of the docs are found."""
    ids = {(b.path, b.heading, b.kind) for b in BLOCKS}
    assert ("README.md", "Use it in your own script", "python") in ids
    assert ("README.md", "Quick start", "shell") in ids
    assert any(b.skip_reason for b in BLOCKS) and any(b.signature_target for b in BLOCKS)
    assert all(b.kind != "text" for b in BLOCKS) and any(b.kind == "text" for b in all_blocks())


# ----------------------------------------------------------------------------------------------- the machinery
def test_substitutions_of_a_python_block():
    code = (
        'from trl import GRPOConfig\n'
        'from trl_async import AsyncPPOTrainer\n'
        'model = "Qwen/Qwen2.5-0.5B-Instruct"\n'
        'long = GRPOConfig(output_dir="a", max_steps=150)\n'
        'short = GRPOConfig(output_dir="b", max_steps=1)\n'
        'unset = GRPOConfig(output_dir="c")\n'
        'trainer = AsyncPPOTrainer(model=..., args=unset)\n'
        'print(tokenizer)\n'
    )  # fmt: skip
    program = python_program(code)
    assert "Qwen/" not in program and "model = _doc_test.tiny_model()" in program
    assert "max_steps=2)" in program.split("long =")[1].splitlines()[0]
    assert "max_steps=1)" in program.split("short =")[1].splitlines()[0]
    assert "max_steps=2)" in program.split("unset =")[1].splitlines()[0]
    assert "model=_doc_test.placeholder('model', 'AsyncPPOTrainer')" in program
    assert "tokenizer = _doc_test.stand_in('tokenizer')" in program
    assert program.rstrip().endswith("_doc_test.report(globals())")


def test_a_python_block_without_stand_ins_is_refused():
    with pytest.raises(BlockError, match=r"\['my_dataset'\]"):
        python_program("print(my_dataset)\n")
    with pytest.raises(BlockError, match="no stand-in for 'peft_config'"):
        python_program("from trl_async import AsyncGRPOTrainer\nAsyncGRPOTrainer(peft_config=...)\n")


def test_shell_block_rewriting():
    code = (
        "pip install -e .   # first\n"
        "python -m tests.support.hub.server --port 8765 &\n"
        "export HF_ENDPOINT=http://127.0.0.1:8765\n"
        "OMP_NUM_THREADS=1 python recipes/qwen_math.py --use_peft true \\\n"
        "    --lora_target_modules q_proj v_proj   # trains\n"
        "python - <<'EOF'\n"
        "print('#', 1)\n"
        "EOF\n"
    )
    script, left_out = shell_script(code, free_port=4321)
    lines = script.splitlines()
    assert left_out == ["pip install -e .   # first  (installs packages from the package index)"]
    assert "python -m tests.support.hub.server --port 4321 &" in lines
    assert "export HF_ENDPOINT=http://127.0.0.1:4321" in lines
    recipe = next(line for line in lines if "qwen_math.py" in line)
    assert recipe.startswith("OMP_NUM_THREADS=1 python recipes/qwen_math.py --use_peft true --lora_target_modules")
    assert recipe.endswith("--max_steps 2 --per_device_train_batch_size 8 --num_generations 4 "
                           "--max_completion_length 16 --eval_max_samples 8 --plot false")  # fmt: skip
    assert "print('#', 1)\nEOF" in script  # the heredoc kept whole, its '#' not read as a comment
    assert not any(line.startswith("pip") for line in lines)


def test_shell_blocks_that_cannot_run_are_refused():
    with pytest.raises(BlockError, match="no command of this project"):
        shell_script("pip install trl-async\n")
    with pytest.raises(BlockError, match="neither a command of this project nor in OTHER_TOOLS"):
        shell_script("docker run trl-async\n")
    with pytest.raises(BlockError, match="cheapest flags of 'benchmarks/bench_soak.py'"):
        shell_script("python benchmarks/bench_soak.py\n")
    with pytest.raises(BlockError, match="simple command"):
        shell_script("python recipes/qwen_math.py --seed $SEED\n")  # quoted, $SEED would not expand


def test_signature_check_names_each_difference():
    from trl_async.rollout.backends.vllm_server import VLLMServerBackend  # noqa: F401  (the module the check imports)

    target = "trl_async.rollout.backends.vllm_server.VLLMServerBackend"
    block = next(b for b in BLOCKS if b.signature_target == target)
    assert signature_mismatches(block.code, target) == []
    wrong_default = block.code.replace("port=8000", "port=8001")
    assert signature_mismatches(wrong_default, target) == ["port: documented default 8001, is 8000"]
    renamed = block.code.replace("group_port=", "nccl_port=")
    assert "documented" in signature_mismatches(renamed, target)[0]
    not_keyword_only = block.code.replace("*,", "")
    assert any("keyword-only" in p for p in signature_mismatches(not_keyword_only, target))
