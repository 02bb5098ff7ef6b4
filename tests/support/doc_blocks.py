"""The code blocks of the project's markdown, and what `tests/test_doc_blocks.py` runs for each.

`blocks()` finds the fenced blocks of README.md and of the markdown under docs/, recipes/ and benchmarks/, with the
`doc-test` marker before each; `python_program` and `shell_script` rewrite a block into the program that runs here.
The rules (which Hub models become the tiny model, how steps are cut, which commands run with which flags) are in
`tests/test_doc_blocks.py`'s docstring, and the tables they come from are below.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib
import inspect
import io
import itertools
import re
import shlex
import tokenize
from pathlib import Path

from tests.support.doc_stand_ins import DOC_MAX_STEPS, PLACEHOLDERS, STAND_INS

ROOT = Path(__file__).resolve().parents[2]
MARKDOWN_ROOTS = ("README.md", "docs", "recipes", "benchmarks")

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<language>[\w+-]*)[^`]*$")
MARKER = re.compile(r"^\s*<!--\s*doc-test:\s*(?P<directive>.*?)\s*-->\s*$")
DIRECTIVE = re.compile(r"^(?:skip \((?P<reason>.+)\)|signature of (?P<target>[A-Za-z_][\w.]*))$")
HEADING = re.compile(r"^#{1,6}\s+(?P<title>.+?)\s*$")
PYTHON_LANGUAGES = {"python", "py", "python3"}
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}

# --- Python blocks
# Hub models that documentation blocks name: each becomes the bundled tiny model (same architecture family, offline).
HUB_MODEL_IDS = {"Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-7B-Instruct"}
# Configs whose runs are cut to DOC_MAX_STEPS (given max_steps when they have none: an epoch is far longer).
TRAINING_CONFIGS = {"GRPOConfig", "AsyncGRPOConfig", "AsyncPPOConfig"}
STAND_IN_MODULE = "_doc_test"

# --- shell blocks
# The cheapest flags of each command of this project a block runs; appended to the documented command (argparse
# and TrlParser keep the last value of an option, so these win). A command missing here is an error: add its flags.
RECIPE_FLAGS = ("--max_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "4",
                "--max_completion_length", "16", "--eval_max_samples", "8", "--plot", "false")  # fmt: skip
CHEAP_FLAGS: dict[str, tuple[str, ...]] = {
    "recipes/qwen_math.py": RECIPE_FLAGS,
    "recipes/accelerate_configs/multinode_grpo.py": RECIPE_FLAGS,
    "benchmarks/bench_losses.py": ("--quick", "--shapes", "64x256", "--out", "bench_losses.json"),
    "benchmarks/bench_tools.py": (
        "--pairs",
        "1",
        "--steps",
        "2",
        "--eval-problems",
        "4",
        "--output",
        "bench_tools.json",
    ),
    "-m tests.support.hub.server": (),
}
# Other programs a block names, and why they do not run here (the block's own commands still do).
OTHER_TOOLS = {
    "pip": "installs packages from the package index",
    "huggingface-cli": "logs in to the real Hub",
    "hf": "talks to the real Hub",
    "trackio": "`trackio show` serves a dashboard until it is stopped",
    "tensorboard": "serves a dashboard until it is stopped",
    "source": "activates another environment",
}
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")


class BlockError(ValueError):
    """A block that cannot be prepared to run here: the message says what to add (a stand-in, flags, a marker)."""


@dataclasses.dataclass(frozen=True)
class Block:
    path: str  # from the repository root
    line: int  # of the opening fence, from 1
    language: str
    code: str
    heading: str  # the nearest heading above the block
    directive: str | None  # the doc-test marker's text, e.g. "skip (needs a GPU)"
    anchor: str  # the heading's GitHub anchor, "-2", "-3", ... for a later block under the same heading

    @property
    def id(self) -> str:
        """Stable while the file is edited elsewhere: `README.md#use-it-in-your-own-script`."""
        return f"{self.path}#{self.anchor}"

    @property
    def location(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def kind(self) -> str:
        if self.language in PYTHON_LANGUAGES:
            return "python"
        if self.language in SHELL_LANGUAGES:
            return "shell"
        return "text"  # diagrams, sample output, file layouts: nothing to run

    def _directive(self) -> re.Match | None:
        if self.directive is None:
            return None
        match = DIRECTIVE.match(self.directive)
        if match is None:
            raise BlockError(
                f"{self.location}: unknown marker <!-- doc-test: {self.directive} -->; use 'skip (why)' or "
                "'signature of module.Name'"
            )
        return match

    @property
    def skip_reason(self) -> str | None:
        match = self._directive()
        return match and match["reason"]

    @property
    def signature_target(self) -> str | None:
        match = self._directive()
        return match and match["target"]


def markdown_files() -> list[Path]:
    files = []
    for name in MARKDOWN_ROOTS:
        path = ROOT / name
        files.extend([path] if path.is_file() else sorted(path.rglob("*.md")))
    return [f for f in files if "results" not in f.relative_to(ROOT).parts]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") or "top"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one markdown file, each with the marker on the last non-blank line above its fence."""
    lines = path.read_text().splitlines()
    found, heading, i = [], "", 0
    under_heading: dict[str, int] = {}
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            title = HEADING.match(lines[i])
            heading = title["title"] if title else heading
            i += 1
            continue
        start, indent, closing = i, fence["indent"], fence["fence"]
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(closing):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        i += 1  # the closing fence
        above = next((line for line in reversed(lines[:start]) if line.strip()), "")
        marker = MARKER.match(above)
        anchor = github_anchor(heading)
        under_heading[anchor] = under_heading.get(anchor, 0) + 1
        found.append(
            Block(
                path=path.relative_to(ROOT).as_posix(),
                line=start + 1,
                language=fence["language"].lower(),
                code="\n".join(body) + "\n",
                heading=heading,
                directive=marker["directive"] if marker else None,
                anchor=anchor if under_heading[anchor] == 1 else f"{anchor}-{under_heading[anchor]}",
            )
        )
    return found


def all_blocks() -> list[Block]:
    return [block for path in markdown_files() for block in blocks(path)]


def stray_markers(path: Path) -> list[str]:
    """Markers not followed by a code block (a marker applies to the fence that comes next, after blank lines)."""
    lines = path.read_text().splitlines()
    stray = []
    for i, line in enumerate(lines):
        if MARKER.match(line):
            following = next((other for other in lines[i + 1 :] if other.strip()), "")
            if not FENCE.match(following):
                stray.append(f"{path.relative_to(ROOT)}:{i + 1}")
    return stray


# ----------------------------------------------------------------------------------------------- Python blocks
def _call_name(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _stand_in_call(function: str, *arguments: str) -> ast.Call:
    return ast.Call(
        func=ast.Attribute(value=ast.Name(STAND_IN_MODULE, ast.Load()), attr=function, ctx=ast.Load()),
        args=[ast.Constant(a) for a in arguments],
        keywords=[],
    )


class _Substitutions(ast.NodeTransformer):
    """Hub model ids -> the tiny model; max_steps cut to DOC_MAX_STEPS; `keyword=...` -> a stand-in."""

    def visit_Constant(self, node: ast.Constant):
        if isinstance(node.value, str) and node.value in HUB_MODEL_IDS:
            return ast.copy_location(_stand_in_call("tiny_model"), node)
        return node

    def visit_Call(self, node: ast.Call):
        self.generic_visit(node)
        name = _call_name(node)
        for keyword in node.keywords:
            value = keyword.value
            if keyword.arg == "max_steps" and isinstance(value, ast.Constant) and isinstance(value.value, int):
                keyword.value = ast.Constant(min(value.value, DOC_MAX_STEPS))
            elif isinstance(value, ast.Constant) and value.value is Ellipsis:
                if keyword.arg not in PLACEHOLDERS:
                    raise BlockError(
                        f"`{name}({keyword.arg}=...)`: no stand-in for {keyword.arg!r}; add one to "
                        "tests/support/doc_stand_ins.py PLACEHOLDERS, or write the value in the block"
                    )
                keyword.value = _stand_in_call("placeholder", keyword.arg, name)
        given = {k.arg for k in node.keywords}
        if name in TRAINING_CONFIGS and "max_steps" not in given and None not in given:  # (None: a **mapping)
            node.keywords.append(ast.keyword("max_steps", ast.Constant(DOC_MAX_STEPS)))
        return node


def free_names(tree: ast.Module) -> set[str]:
    """Names the code reads but never binds (no assignment, import, def, parameter or loop variable)."""
    bound, read = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return read - bound - set(dir(builtins))


def trains(code: str) -> bool:
    """Whether the block calls `.train()` (then its trainers must have taken their steps)."""
    return any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "train"
        for node in ast.walk(ast.parse(code))
    )


def python_program(code: str) -> str:
    """The program that runs a Python block here: stand-ins for what the block leaves to its reader, the block with
    its substitutions, and the report of its trainers."""
    tree = ast.parse(code)
    missing = sorted(free_names(tree) - set(STAND_INS))
    if missing:
        raise BlockError(
            f"the block uses {missing} without defining them: define them in the block, or add stand-ins to "
            "tests/support/doc_stand_ins.py STAND_INS"
        )
    names = sorted(free_names(tree))
    tree = ast.fix_missing_locations(_Substitutions().visit(tree))
    prelude = [f"from tests.support import doc_stand_ins as {STAND_IN_MODULE}  # tests/test_doc_blocks.py"]
    prelude += [f"{name} = {STAND_IN_MODULE}.stand_in({name!r})" for name in names]
    return "\n".join([*prelude, "", ast.unparse(tree), "", f"{STAND_IN_MODULE}.report(globals())", ""])


# ----------------------------------------------------------------------------------------------- signatures
def signature_mismatches(code: str, target: str) -> list[str]:
    """Where a block that shows a call signature, `Name(a, b=1, *, c=None)`, differs from `target`'s own: names,
    order, keyword-only marks and literal defaults (a documented lambda must be a callable default)."""
    module_name, _, attribute = target.rpartition(".")
    tokens = tokenize.generate_tokens(io.StringIO(code.strip()).readline)
    call = tokenize.untokenize(t for t in tokens if t.type != tokenize.COMMENT)  # a comment would hide the ':'
    documented = ast.parse(f"def {call.strip()}:\n    pass").body[0].args
    actual = list(inspect.signature(getattr(importlib.import_module(module_name), attribute)).parameters.values())
    positional = documented.posonlyargs + documented.args
    defaults = [None] * (len(positional) - len(documented.defaults)) + documented.defaults
    shown = [(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, d) for a, d in zip(positional, defaults, strict=True)]
    shown += [(a.arg, inspect.Parameter.KEYWORD_ONLY, d) for a, d in zip(documented.kwonlyargs, documented.kw_defaults, strict=True)]  # fmt: skip
    problems = []
    if [s[0] for s in shown] != [p.name for p in actual]:
        problems.append(f"parameters {[s[0] for s in shown]} documented, {[p.name for p in actual]} in the code")
        return problems
    for (name, kind, default), parameter in zip(shown, actual, strict=True):
        if kind != parameter.kind:
            problems.append(f"{name}: documented as {kind.description}, is {parameter.kind.description}")
        if default is None:
            if parameter.default is not inspect.Parameter.empty:
                problems.append(f"{name}: documented without a default, has {parameter.default!r}")
        elif isinstance(default, ast.Lambda):
            if not callable(parameter.default):
                problems.append(f"{name}: documented default is a function, is {parameter.default!r}")
        elif isinstance(default, ast.Name):  # a named default (a function): the same name
            if getattr(parameter.default, "__name__", None) != default.id:
                problems.append(f"{name}: documented default {default.id}, is {parameter.default!r}")
        elif ast.literal_eval(default) != parameter.default:
            problems.append(f"{name}: documented default {ast.unparse(default)}, is {parameter.default!r}")
    return problems


# ----------------------------------------------------------------------------------------------- shell blocks
@dataclasses.dataclass
class ShellCommand:
    text: str  # the command, continuation lines joined
    heredoc: str = ""  # the lines after it up to the heredoc's end marker, that marker included


def shell_commands(code: str) -> list[ShellCommand]:
    lines = code.splitlines()
    commands, i = [], 0
    while i < len(lines):
        text = lines[i]
        while text.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text.rstrip()[:-1].rstrip() + " " + lines[i].strip()
        i += 1
        command = ShellCommand(text)
        heredoc = re.search(r"<<-?\s*(['\"]?)(\w+)\1", text)
        if heredoc:
            end = heredoc[2]
            body = []
            while i < len(lines):
                body.append(lines[i])
                i += 1
                if body[-1].strip() == end:
                    break
            command.heredoc = "\n".join(body)
        commands.append(command)
    return commands


def _words(text: str) -> list[str]:
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def project_command(words: list[str]) -> str | None:
    """The CHEAP_FLAGS key of a command of this project (`recipes/x.py`, `-m trl_async.y`), "inline" for Python
    written into the block (`python -`, `python -c`), None for another program."""
    if not words:
        return None
    program, arguments = words[0], words[1:]
    if program in ("python", "python3") and arguments:
        if arguments[0] == "-m" and len(arguments) > 1:
            top = arguments[1].split(".")[0]
            return f"-m {arguments[1]}" if top in ("trl_async", "tests") else None
        if arguments[0] in ("-", "-c"):
            return "inline"
        return arguments[0] if (ROOT / arguments[0]).is_file() else None
    if program == "accelerate" and arguments[:1] == ["launch"]:
        scripts = [a for a in arguments if a.endswith(".py")]
        return scripts[0] if scripts and (ROOT / scripts[0]).is_file() else None
    if program == "bash" and arguments and arguments[0].endswith(".sh"):
        return arguments[0] if (ROOT / arguments[0]).is_file() else None
    return None


def shell_script(code: str, free_port: int | None = None) -> tuple[str, list[str]]:
    """The bash script that runs a shell block here, and the commands it leaves out (other programs, with why).

    Commands of this project run with CHEAP_FLAGS appended; `export` lines and Python written into the block run
    as they are; other programs (OTHER_TOOLS) are echoed, not run. A `--port N` of the block becomes `free_port`
    everywhere the block names N (a fixed port may be taken by another run on this machine)."""
    if free_port is not None:
        for port in set(re.findall(r"--port\s+(\d+)", code)):
            code = re.sub(rf"\b{port}\b", str(free_port), code)
    script = ["set -eo pipefail", "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT  # background servers"]
    left_out, ran = [], 0
    for command in shell_commands(code):
        words = _words(command.text)
        words_after_env = list(itertools.dropwhile(ENV_ASSIGNMENT.match, words))  # past `OMP_NUM_THREADS=1 ...`
        if not words or words[0] == "export":
            script.append(command.text)
            continue
        key = project_command(words_after_env)
        if key is None:
            program = words_after_env[0] if words_after_env else words[0]
            if program not in OTHER_TOOLS:
                raise BlockError(
                    f"`{command.text.strip()}`: {program!r} is neither a command of this project nor in OTHER_TOOLS "
                    "(tests/support/doc_blocks.py); add it there with the reason it does not run, or mark the block"
                )
            left_out.append(f"{command.text.strip()}  ({OTHER_TOOLS[program]})")
            script.append(f"echo {shlex.quote('[doc-test] not run: ' + command.text.strip())}")
            continue
        ran += 1
        if key == "inline":
            script.append(command.text + ("\n" + command.heredoc if command.heredoc else ""))
            continue
        if key not in CHEAP_FLAGS:
            raise BlockError(f"`{command.text.strip()}`: add the cheapest flags of {key!r} to CHEAP_FLAGS")
        background = words[-1] == "&"
        if background:
            words = words[:-1]
        if any(set(w) <= set("&|;<>()") or "$" in w for w in words) or command.heredoc:  # (quoting would break them)
            raise BlockError(
                f"`{command.text.strip()}`: cheap flags can only be appended to a simple command (no operators, "
                "heredoc or $expansions)"
            )
        rewritten = shlex.join([*words, *CHEAP_FLAGS[key]])
        script.append(rewritten + (" &" if background else ""))
    if not ran:
        raise BlockError("no command of this project in the block: mark it <!-- doc-test: skip (why) -->")
    return "\n".join(script) + "\n", left_out
