"""TRL's own GRPO test file, run offline with stock `GRPOTrainer` and with it swapped for `AsyncGRPOTrainer`.

The yardstick of issue 8's bar: of the tests that pass with stock TRL, how many still pass when the test file's
`GRPOTrainer` is `trl_async.AsyncGRPOTrainer`, and did those tests really generate asynchronously.

What it does (see README.md next to this file):

1. Reads TRL's `tests/test_grpo_trainer.py`, `tests/testing_utils.py` and `tests/conftest.py` from a TRL git
   directory at a revision (`--trl-repo`, `--trl-rev`) or from explicit paths, and copies them into two temporary
   test trees: `stock/` unchanged, `swapped/` with the `GRPOTrainer` import replaced by a thin subclass of
   `AsyncGRPOTrainer` (written by the harness) that records whether each `train()` logged `async/*` metrics.
   Nothing of TRL's is committed to this repository.
2. Builds offline stand-ins for the Hub models and datasets the tests load (`tests/support/hub/cache.py`) and points the
   Hugging Face clients at them with `HF_HUB_OFFLINE=1`.
3. Collects the tests, drops the excluded ones (`EXCLUDED`, each with its reason), and runs the rest in both trees
   (`pytest -p no:cacheprovider`, per-test timeout, `OMP_NUM_THREADS=1`, `nice -n 15`), with `--package-path`
   first on `PYTHONPATH` for the swapped run. A pytest process that dies or hangs is killed (its process group
   only) and restarted after the test it was in.
4. Writes `benchmarks/results/trl_compat.json` and prints a summary: stock passes, swapped passes kept, kept with
   asynchronous generation proven, failures grouped by cause.

Usage:
    python benchmarks/trl_compat/run_trl_compat.py --trl-repo /work/.mirror/huggingface+trl/repo
    python benchmarks/trl_compat/run_trl_compat.py --trl-repo ... --package-path /work/main --subset quick
    python benchmarks/trl_compat/run_trl_compat.py --test-file t.py --testing-utils u.py --conftest c.py
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import datetime as dt
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run as a script: the repository's packages (this folder, the Hub stand-in)

from benchmarks.trl_compat.swap_module import SWAP_MODULE_SOURCE  # noqa: E402
from tests.support.hub import cache as hub_standins  # noqa: E402

DEFAULT_OUTPUT = REPO_ROOT / "benchmarks" / "results" / "trl_compat.json"
TEST_FILE = "tests/test_grpo_trainer.py"
SUPPORT_FILES = {  # name in the copied tests/ package -> path in TRL's repository (None: required)
    "testing_utils.py": "tests/testing_utils.py",
    "conftest.py": "tests/conftest.py",
    "testing_constants.py": "tests/testing_constants.py",
}
ZEN_SCRIPT = "scripts/generate_zen_dataset.py"

# Tests left out of the selection, by regular expression on the node id, with the reason. Everything else that the
# file collects runs; tests that TRL's own marks skip on this machine (no GPU, no vllm/liger/jmespath/...) are
# reported as skipped with TRL's reason, and are not part of the selection either.
EXCLUDED: list[tuple[str, str]] = [
    (
        r"::TestGRPOTrainerVLM::.*(Qwen2_5_VL|Qwen2VL|Qwen3_5|Gemma4)",
        "stand-in not buildable here: the model's processor includes a video processor, which needs torchvision "
        "(not in the venv); with the real Hub repository the test would fail the same way on this machine",
    ),
]

# Named subsets for quick checks: node-id substrings.
SUBSETS = {
    "quick": [
        "TestGetHighEntropyMask::test_compute_entropy_mask_0",
        "TestGRPOTrainer::test_init_minimal",
        "TestGRPOTrainer::test_train_reward_func_standard",
        "TestGRPOTrainer::test_train_with_iterable_dataset",
        "TestGRPOTrainer::test_train_multiple_reward_funcs_with_weights",
        "TestGRPOTrainer::test_train_with_reward_func_accessing_trainer_state",
    ],
}

# Human labels for failure causes, matched in order against "message | root cause"; unmatched failures are grouped by
# their normalized message.
CAUSE_LABELS: list[tuple[str, str]] = [
    (r"generate is replaced on the model instance", "`trainer.model.generate` patched on the instance: refused"),
    (r"Timeout", "timed out"),
    (r"reward model .*only callables|nn\.Module reward", "reward model (nn.Module reward func) refused"),
    (r"iterable train_dataset|IterableDataset", "iterable (streaming) dataset refused"),
    (r"max_staleness", "schedule needs a larger max_staleness than the default"),
    (r"has no attribute 'async_", "args object without the async fields"),
    (r"environment_factory", "environment_factory refused"),
    (r"vision-language", "vision-language model refused"),
    (r"rollout_func", "rollout_func refused"),
    (r"GeneratorError|generation process", "generation process error"),
    (r"assert 'test_column' in", "log_extra column missing from trainer._logs['extra']"),
    (r"assert 'custom_accuracy' in", "log_metric value missing from log_history"),
    (r"All reward functions returned None", "reward-function warning not logged in the trainer process (caplog)"),
]


# ------------------------------------------------------------------------------------------------ sources


def _git_show(git_dir: str, rev: str, path: str) -> str | None:
    result = subprocess.run(
        ["git", "-C", git_dir, "show", f"{rev}:{path}"],
        capture_output=True,
        text=True,
    )
    return result.stdout if result.returncode == 0 else None


def load_sources(args) -> dict:
    """The texts of TRL's test file, its support files and (if available) the zen dataset script."""
    sources: dict = {"files": {}, "origin": {}}
    if args.trl_repo:
        rev = subprocess.run(
            ["git", "-C", args.trl_repo, "rev-parse", "--verify", f"{args.trl_rev}^{{commit}}"],
            capture_output=True,
            text=True,
        )
        if rev.returncode != 0:
            sys.exit(f"--trl-repo {args.trl_repo}: cannot resolve revision {args.trl_rev!r}: {rev.stderr.strip()}")
        commit = rev.stdout.strip()
        sources["origin"] = {"trl_repo": str(args.trl_repo), "trl_rev": args.trl_rev, "trl_commit": commit}
        text = _git_show(args.trl_repo, commit, TEST_FILE)
        if text is None:
            sys.exit(f"{TEST_FILE} not found at {commit} in {args.trl_repo}")
        sources["files"]["test_grpo_trainer.py"] = text
        for name, path in SUPPORT_FILES.items():
            support = _git_show(args.trl_repo, commit, path)
            if support is not None:
                sources["files"][name] = support
        sources["zen_script"] = _git_show(args.trl_repo, commit, ZEN_SCRIPT)
        version = _git_show(args.trl_repo, commit, "VERSION")
        sources["origin"]["trl_repo_version"] = version.strip() if version else None
    explicit = {
        "test_grpo_trainer.py": args.test_file,
        "testing_utils.py": args.testing_utils,
        "conftest.py": args.conftest,
        "testing_constants.py": args.testing_constants,
    }
    for name, path in explicit.items():
        if path:
            sources["files"][name] = Path(path).read_text()
            sources["origin"][name] = str(Path(path).resolve())
    if args.zen_script:
        sources["zen_script"] = Path(args.zen_script).read_text()
    missing = [n for n in ("test_grpo_trainer.py", "testing_utils.py", "conftest.py") if n not in sources["files"]]
    if missing:
        sys.exit(f"missing {', '.join(missing)}: pass --trl-repo, or --test-file/--testing-utils/--conftest")
    sources["origin"]["sha256"] = {
        name: hashlib.sha256(text.encode()).hexdigest()[:16] for name, text in sorted(sources["files"].items())
    }
    return sources


def swap_grpo_trainer_import(source: str) -> str:
    """The test file with every `from trl... import GRPOTrainer` replaced by the harness's swapped class."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trl":
            names = [alias for alias in node.names if alias.name == "GRPOTrainer"]
            if not names:
                continue
            alias = names[0].asname or "GRPOTrainer"
            indent = re.match(r"\s*", lines[node.lineno - 1]).group(0)
            kept = [a for a in node.names if a.name != "GRPOTrainer"]
            replacement = ""
            if kept:
                joined = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in kept)
                replacement += f"{indent}from {node.module} import {joined}\n"
            replacement += f"{indent}from ._trl_compat_swap import GRPOTrainer as {alias}  # trl_compat harness\n"
            edits.append((node.lineno, node.end_lineno, replacement))
    if not edits:
        raise ValueError("the test file imports no GRPOTrainer from trl: nothing to swap")
    for start, end, replacement in sorted(edits, reverse=True):
        lines[start - 1 : end] = [replacement]
    patched = "".join(lines)
    leftovers = [
        n.lineno
        for n in ast.walk(ast.parse(patched))
        if isinstance(n, ast.Attribute) and n.attr == "GRPOTrainer" and getattr(n.value, "id", None) == "trl"
    ]
    if leftovers:
        raise ValueError(f"the test file also uses trl.GRPOTrainer directly (lines {leftovers}): not swapped")
    return patched


def tolerate_missing_import_utils(source: str) -> str:
    """`from trl.import_utils import is_x, ...` made to survive names the installed TRL lacks (they read as False).

    TRL's test support files at a newer revision can import availability checks (`is_joblib_available`, ...) that
    the installed TRL does not have; the import error would fail the whole file in both runs. A missing check can
    only guard an optional dependency, so it is treated as unavailable, exactly as on a machine without it.
    """
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "trl.import_utils" and node.col_offset == 0:
            replacement = (
                "import trl.import_utils as _trl_import_utils  # trl_compat harness: tolerate missing names\n"
            )
            for alias in node.names:
                name = alias.asname or alias.name
                replacement += f"{name} = getattr(_trl_import_utils, {alias.name!r}, lambda *a, **k: False)\n"
            edits.append((node.lineno, node.end_lineno, replacement))
    for start, end, replacement in sorted(edits, reverse=True):
        lines[start - 1 : end] = [replacement]
    return "".join(lines)


PYTEST_INI = """\
[pytest]
markers =
    slow: marks tests as slow
    low_priority: marks tests as low priority
    invariant: training-invariant checks
"""


def write_tree(root: Path, sources: dict, swapped: bool) -> None:
    tests = root / "tests"
    tests.mkdir(parents=True)
    (tests / "__init__.py").write_text("")
    for name, text in sources["files"].items():
        text = tolerate_missing_import_utils(text)
        if name == "test_grpo_trainer.py" and swapped:
            text = swap_grpo_trainer_import(text)
        (tests / name).write_text(text)
    if swapped:
        (tests / "_trl_compat_swap.py").write_text(SWAP_MODULE_SOURCE)
    (root / "pytest.ini").write_text(PYTEST_INI)
    shutil.copy(HERE / "pytest_recorder.py", root / "pytest_recorder.py")


# ------------------------------------------------------------------------------------------------ running


def base_env(args, hub_dir: Path, tree: Path, swapped: bool) -> dict:
    env = dict(os.environ)
    env.update(hub_standins.hub_env(hub_dir))
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="" if not args.allow_accelerator else env.get("CUDA_VISIBLE_DEVICES", ""),
        PYTHONDONTWRITEBYTECODE="1",
        WANDB_MODE="disabled",
        TRL_EXPERIMENTAL_SILENCE="1",
    )
    paths = [str(tree)]
    if swapped:
        paths.insert(0, str(Path(args.package_path).resolve()))
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def pytest_command(args, tree: Path, extra: list[str]) -> list[str]:
    command = ["nice", "-n", str(args.nice), sys.executable, "-m", "pytest", "-c", str(tree / "pytest.ini")]
    command += ["--rootdir", str(tree), "-p", "no:cacheprovider", "-p", "pytest_recorder", "-q", "-rN"]
    command += ["--color=no", "-W", "ignore::DeprecationWarning"]
    if args.timeout and _has_pytest_timeout():
        command += [f"--timeout={args.timeout}"]
    return command + extra


def _has_pytest_timeout() -> bool:
    try:
        import pytest_timeout  # noqa: F401
    except ImportError:
        return False
    return True


def collect(args, tree: Path, env: dict, keyword: str | None) -> list[str]:
    extra = ["--collect-only", "tests/test_grpo_trainer.py"]
    if keyword:
        extra += ["-k", keyword]
    result = subprocess.run(
        pytest_command(args, tree, extra), cwd=tree, env=env, capture_output=True, text=True, timeout=600
    )
    ids = [line.strip() for line in result.stdout.splitlines() if line.startswith("tests/") and "::" in line]
    if not ids:
        sys.exit(
            f"collection found no tests (rc={result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
        )
    return ids


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a killed process
    return records


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


_ACTIVE: set[subprocess.Popen] = set()  # pytest processes running now, killed (by process group) if we are stopped
_STOPPING = threading.Event()  # set when the harness is stopped: workers start no new pytest process


def _stop_active(signum=None, frame=None) -> None:
    _STOPPING.set()
    for process in list(_ACTIVE):
        _kill_group(process)
    if signum is not None:
        raise SystemExit(128 + signum)


def run_chunk(args, run: str, chunk: int, tree: Path, env: dict, nodeids: list[str], logdir: Path, say) -> dict:
    """Run `nodeids` in `tree`, restarting pytest after a test whose process died or hung. Returns {nodeid: rec}."""
    results_path = logdir / f"{run}-{chunk}.results.jsonl"
    env = {**env, "TRL_COMPAT_RESULTS": str(results_path), "TRL_COMPAT_TRAIN_LOG": str(logdir / f"{run}.train.jsonl")}
    finished: dict[str, dict] = {}
    remaining = list(nodeids)
    attempt = 0
    while remaining and not _STOPPING.is_set():
        attempt += 1
        argsfile = logdir / f"{run}-{chunk}.args-{attempt}.txt"
        argsfile.write_text("\n".join(remaining) + "\n")
        log = open(logdir / f"{run}-{chunk}.log", "a", encoding="utf-8")
        log.write(f"\n===== attempt {attempt}: {len(remaining)} tests =====\n")
        log.flush()
        process = subprocess.Popen(
            pytest_command(args, tree, [f"@{argsfile}"]),
            cwd=tree,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a kill reaches its children (the generators) only
        )
        _ACTIVE.add(process)
        seen_before = len(_read_jsonl(results_path))
        last_progress, hung = time.time(), False
        while process.poll() is None:
            time.sleep(2)
            records = _read_jsonl(results_path)
            if len(records) != seen_before:
                seen_before, last_progress = len(records), time.time()
            # pytest-timeout fails a stuck test itself; this catches what it cannot (a hang outside the test call).
            if time.time() - last_progress > args.timeout + args.hang_grace:
                hung = True
                _kill_group(process)
                break
        rc = process.wait()
        _ACTIVE.discard(process)
        log.close()
        records = _read_jsonl(results_path)
        for record in records:
            if record["event"] == "end":
                finished[record["nodeid"]] = record
        started = [r["nodeid"] for r in records if r["event"] == "start"]
        crashed = [n for n in started if n not in finished and n in remaining]
        for nodeid in crashed:
            why = "hung (no progress; pytest process killed)" if hung else f"pytest process died (rc={rc})"
            finished[nodeid] = {"event": "end", "nodeid": nodeid, "outcome": "crashed", "message": why}
            say(f"  [{run}] {nodeid}: {why}")
        progress = [n for n in remaining if n in finished]
        remaining = [n for n in remaining if n not in finished]
        if remaining and not progress:
            for nodeid in remaining:
                finished[nodeid] = {
                    "event": "end",
                    "nodeid": nodeid,
                    "outcome": "not run",
                    "message": f"pytest exited (rc={rc}) without running it; see {log.name}",
                }
            break
    return finished


def run_all(args, trees: dict, envs: dict, todo: dict[str, list[str]], logdir: Path, say) -> dict:
    """The runs in chunks of `--chunk` tests, pulled by `--jobs` workers from one queue that alternates the runs.

    Chunks rather than one process per run keep both runs progressing and both cores busy when one run is much
    faster than the other (today's swapped run refuses many tests at once); chunks rather than one process per test
    keep pytest's start-up (imports, collection: ~15 s) rare.
    """
    chunks = {run: [ids[i : i + args.chunk] for i in range(0, len(ids), args.chunk)] for run, ids in todo.items()}
    queue = []
    for index in range(max((len(c) for c in chunks.values()), default=0)):
        for run in trees:
            if index < len(chunks.get(run, [])):
                queue.append((run, index, chunks[run][index]))
    results: dict[str, dict] = {run: {} for run in trees}
    lock = threading.Lock()
    done = [0]

    def work(task):
        run, index, ids = task
        finished = run_chunk(args, run, index, trees[run], envs[run], ids, logdir, say)
        with lock:
            results[run].update(finished)
            done[0] += 1
            counts = Counter(r["outcome"] for r in results[run].values())
            say(f"  [{run}] chunk {index + 1}/{len(chunks[run])} done ({done[0]}/{len(queue)}); {dict(counts)}")

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs))
    try:
        for future in [pool.submit(work, task) for task in queue]:
            future.result()
    except BaseException:
        _STOPPING.set()  # stopped (signal, Ctrl-C) or a worker failed: start nothing more, wait for nothing
        raise
    finally:
        pool.shutdown(wait=not _STOPPING.is_set(), cancel_futures=True)
    return results


# ------------------------------------------------------------------------------------------------ report


def normalize_message(message: str) -> str:
    message = re.sub(r"Parameter \S+", "Parameter …", message)
    message = re.sub(r"'[^']*'", "'…'", message)
    message = re.sub(r"\d+(\.\d+)?", "N", message)
    return message[:200]


def cause_of(record: dict) -> str:
    """A failure's group: a human label where a known pattern matches, else its normalized message."""
    text = " | ".join(record.get(k) or "" for k in ("message", "detail", "root_cause"))
    for pattern, label in CAUSE_LABELS:
        if re.search(pattern, text):
            if label == "generation process error" and record.get("detail"):
                return f"{label}: {normalize_message(record['detail'])}"
            return label
    return normalize_message(record.get("message") or record.get("outcome", "?"))


def summarize(nodeids, excluded, results, train_log, collected: int, filtered_out: int = 0) -> dict:
    stock, swapped = results["stock"], results["swapped"]
    trains = defaultdict(list)
    for record in train_log:
        trains[record["nodeid"]].append(record)
    tests, groups = {}, defaultdict(list)
    selected = [n for n in nodeids if stock.get(n, {}).get("outcome") not in ("skipped",)]
    trl_skipped = [n for n in nodeids if stock.get(n, {}).get("outcome") == "skipped"]
    stock_passes = [n for n in selected if stock.get(n, {}).get("outcome") == "passed"]
    kept, kept_async, kept_no_train, kept_sync = [], [], [], []
    for nodeid in nodeids:
        calls = trains.get(nodeid, [])
        s, w = stock.get(nodeid, {}), swapped.get(nodeid, {})
        entry = {
            "stock": {k: s.get(k) for k in ("outcome", "duration", "message", "reason") if s.get(k) is not None},
            "swapped": {
                k: w.get(k) for k in ("outcome", "duration", "message", "detail", "root_cause", "reason") if w.get(k)
            },
            "train_calls": len(calls),
            "async_ran": (all(c["async_keys"] for c in calls) if calls else None),
            "async_keys": sorted({k for c in calls for k in c["async_keys"]}),
        }
        if nodeid in stock_passes:
            if w.get("outcome") == "passed":
                kept.append(nodeid)
                if not calls:
                    kept_no_train.append(nodeid)
                elif entry["async_ran"]:
                    kept_async.append(nodeid)
                else:
                    kept_sync.append(nodeid)
            else:
                cause = cause_of(w)
                entry["cause"] = cause
                groups[cause].append(nodeid)
        tests[nodeid] = entry

    def pct(part, whole):
        return round(100.0 * len(part) / len(whole), 1) if whole else None

    summary = {
        "collected": collected,
        "excluded_by_harness": len(excluded),
        "outside_keyword_or_subset": filtered_out,
        "skipped_by_trl_marks": len(trl_skipped),
        "selected": len(selected),
        "stock_outcomes": dict(Counter(stock.get(n, {}).get("outcome", "missing") for n in selected)),
        "swapped_outcomes": dict(Counter(swapped.get(n, {}).get("outcome", "missing") for n in selected)),
        "stock_passes": len(stock_passes),
        "kept": len(kept),
        "kept_pct": pct(kept, stock_passes),
        "kept_async_proven": len(kept_async),
        "kept_without_train": len(kept_no_train),
        "kept_but_trained_synchronously": len(kept_sync),
        "kept_strict": len(kept_async) + len(kept_no_train),
        "kept_strict_pct": pct(kept_async + kept_no_train, stock_passes),
        "lost": len(stock_passes) - len(kept),
    }
    failure_groups = [
        {
            "cause": cause,
            "count": len(ids),
            "example": {"test": ids[0], **{k: swapped[ids[0]].get(k) for k in ("message", "detail", "root_cause")}},
            "tests": ids,
        }  # fmt: skip
        for cause, ids in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    ]
    lists = {
        "kept_but_trained_synchronously": kept_sync,
        "kept_without_train": kept_no_train,
        "trl_skipped": {n: stock[n].get("reason") for n in trl_skipped},
        # Not part of the measure; read them when the stand-ins or the TRL revision change.
        "stock_failures": {
            n: stock.get(n, {}).get("message") or stock.get(n, {}).get("outcome")
            for n in selected
            if stock.get(n, {}).get("outcome") != "passed"
        },
    }
    return {"summary": summary, "failure_groups": failure_groups, "lists": lists, "tests": tests}


def _short(nodeid: str) -> str:
    return nodeid.replace("tests/test_grpo_trainer.py::", "")


def print_report(report: dict, out=sys.stdout) -> None:
    s = report["summary"]
    tests = report["tests"]
    width = max((len(_short(n)) for n in tests), default=40)
    width = min(width, 90)
    print(f"\n{'test':<{width}}  {'stock':<8} {'swapped':<8} {'async':<6} cause of loss", file=out)
    for nodeid, entry in tests.items():
        stock = entry["stock"].get("outcome", "-")
        if stock == "skipped":
            continue
        swapped = entry["swapped"].get("outcome", "-")
        if entry["async_ran"] is None:
            ran = "-" if not entry["train_calls"] else "?"
        else:
            ran = "yes" if entry["async_ran"] else "NO"
        print(
            f"{_short(nodeid)[:width]:<{width}}  {stock:<8} {swapped:<8} {ran:<6} {entry.get('cause', '')}", file=out
        )
    print("\nfailure groups (stock passes lost in the swapped run):", file=out)
    for group in report["failure_groups"]:
        ex = group["example"]
        print(f"  {group['count']:>3}  {group['cause']}", file=out)
        print(f"       e.g. {_short(ex['test'])}: {ex['message']}", file=out)
        if ex.get("detail"):
            print(f"            ... {ex['detail']}", file=out)
    print(
        f"\ncollected {s['collected']}: {s['excluded_by_harness']} excluded by the harness, "
        f"{s['outside_keyword_or_subset']} outside --keyword/--subset, "
        f"{s['skipped_by_trl_marks']} skipped by TRL's own marks, {s['selected']} selected", file=out
    )  # fmt: skip
    print(f"stock:   {s['stock_outcomes']}", file=out)
    print(f"swapped: {s['swapped_outcomes']}", file=out)
    print(
        f"KEPT {s['kept']} of {s['stock_passes']} stock passes ({s['kept_pct']}%); with asynchronous generation "
        f"proven or no train(): {s['kept_strict']} ({s['kept_strict_pct']}%) = {s['kept_async_proven']} async + "
        f"{s['kept_without_train']} without train(); {s['kept_but_trained_synchronously']} passed but trained "
        f"synchronously",
        file=out,
    )


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("TRL's test file")
    src.add_argument(
        "--trl-repo", help="TRL git directory (bare or work tree), e.g. /work/.mirror/huggingface+trl/repo"
    )
    src.add_argument("--trl-rev", default="HEAD", help="revision of --trl-repo (default: HEAD)")
    src.add_argument("--test-file", help="path of tests/test_grpo_trainer.py (overrides --trl-repo's)")
    src.add_argument("--testing-utils", help="path of tests/testing_utils.py")
    src.add_argument("--conftest", help="path of tests/conftest.py")
    src.add_argument("--testing-constants", help="path of tests/testing_constants.py (optional)")
    src.add_argument("--zen-script", help="path of scripts/generate_zen_dataset.py (exact zen rows; optional)")
    p.add_argument(
        "--package-path", default=str(REPO_ROOT), help="trl_async checkout to test, put first on PYTHONPATH "
        "(default: this checkout)"
    )  # fmt: skip
    p.add_argument("--keyword", "-k", help="pytest -k expression to narrow the selection")
    p.add_argument("--subset", choices=sorted(SUBSETS), help="a named small selection for quick checks")
    p.add_argument("--runs", default="stock,swapped", help="which runs (default: stock,swapped)")
    p.add_argument(
        "--reuse-stock",
        metavar="JSON",
        help="take the stock outcomes from a previous results JSON (same test file, TRL, transformers and "
        "stand-ins; checked) and run only the swapped side, plus stock for tests that JSON lacks",
    )
    p.add_argument("--jobs", type=int, default=2, help="pytest processes at a time, over both runs (default 2)")
    p.add_argument("--chunk", type=int, default=10, help="tests per pytest process (default 10)")
    p.add_argument("--timeout", type=int, default=300, help="per-test timeout in seconds (pytest-timeout)")
    p.add_argument(
        "--hang-grace", type=int, default=120, help="seconds past --timeout before a silent pytest is killed"
    )
    p.add_argument("--nice", type=int, default=15)
    p.add_argument("--hub-dir", help="stand-in cache directory to build or reuse (default: under --work-dir)")
    p.add_argument("--work-dir", help="where the test trees and logs go (default: a new temporary directory)")
    p.add_argument("--output", default=str(DEFAULT_OUTPUT), help=f"results JSON (default: {DEFAULT_OUTPUT})")
    p.add_argument("--allow-accelerator", action="store_true", help="do not hide GPUs (default: CPU only)")
    args = p.parse_args(argv)
    if args.jobs < 1 or args.chunk < 1:
        p.error("--jobs and --chunk must be >= 1")
    return args


REUSABLE_STOCK_OUTCOMES = ("passed", "skipped", "xfailed", "xpassed")


def reused_stock(path: str, sources: dict, versions: dict, manifest: dict) -> dict[str, dict]:
    """Stock records from a previous run, refused unless that run saw the same test file, libraries and stand-ins."""
    previous = json.loads(Path(path).read_text())
    meta = previous.get("meta", {})
    checks = {
        "test file and support files": (meta.get("source", {}).get("sha256"), sources["origin"]["sha256"]),
        "library versions": (meta.get("versions"), versions),
        "stand-ins": (
            {k: meta.get("standins", {}).get(k) for k in ("version", "models", "zen_digest")},
            {k: manifest.get(k) for k in ("version", "models", "zen_digest")},
        ),
    }
    differ = [name for name, (old, new) in checks.items() if old != new]
    if differ:
        sys.exit(f"--reuse-stock {path}: its stock run differs from this one in: {', '.join(differ)}; rerun stock")
    records = {}
    for nodeid, entry in previous.get("tests", {}).items():
        stock = entry.get("stock") or {}
        # Passes and skips are reused; failures are run again: they are few and quick, and one can be environmental
        # (a package installed into the shared venv mid-run, a timeout on a loaded machine).
        if stock.get("outcome") in REUSABLE_STOCK_OUTCOMES:
            records[nodeid] = {"event": "end", "nodeid": nodeid, **stock, "reused": True}
    return records


def package_info(package_path: str) -> dict:
    path = Path(package_path).resolve()
    info = {"path": str(path)}
    probe = subprocess.run(
        [sys.executable, "-c", "import trl_async, sys; print(trl_async.__file__)"],
        env={**os.environ, "PYTHONPATH": str(path)},
        capture_output=True,
        text=True,
    )
    info["trl_async_file"] = probe.stdout.strip() or probe.stderr.strip()[-300:]
    git = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True)
    info["commit"] = git.stdout.strip() or None
    dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain"], capture_output=True, text=True)
    info["dirty"] = bool(dirty.stdout.strip()) if git.returncode == 0 else None
    return info


def main(argv=None) -> int:
    signal.signal(signal.SIGTERM, _stop_active)
    try:
        return _main(argv)
    finally:
        _stop_active()


def _main(argv=None) -> int:
    args = parse_args(argv)
    started = time.time()

    def say(message):
        print(f"[{time.time() - started:7.1f}s] {message}", flush=True)

    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not set(runs) <= {"stock", "swapped"} or not runs:
        sys.exit("--runs takes stock, swapped or both")
    sources = load_sources(args)
    package = package_info(args.package_path)
    if "swapped" in runs and not package["trl_async_file"].startswith(package["path"]):
        sys.exit(f"--package-path {package['path']}: trl_async resolves to {package['trl_async_file']}")
    say(f"trl_async under test: {package['trl_async_file']} (commit {package['commit']})")

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="trl_compat-"))
    work.mkdir(parents=True, exist_ok=True)
    hub_dir = Path(args.hub_dir) if args.hub_dir else work / "hub"
    if sources.get("zen_script"):
        zen = hub_standins.ZenRows(hub_standins.parse_zen_script(sources["zen_script"]), "trl:" + ZEN_SCRIPT)
    else:
        zen = hub_standins.ZenRows(hub_standins.zen_rows_from_this(), "import this (approximate)")
    say(f"stand-in hub in {hub_dir} (zen rows from {zen.source})")
    manifest = hub_standins.build_hub(hub_dir, zen, log=say)

    trees, envs = {}, {}
    for run in ("stock", "swapped"):
        tree = work / run
        if tree.exists():
            shutil.rmtree(tree)
        write_tree(tree, sources, swapped=(run == "swapped"))
        trees[run], envs[run] = tree, base_env(args, hub_dir, tree, swapped=(run == "swapped"))
    logdir = work / "logs"
    if logdir.exists():
        shutil.rmtree(logdir)
    logdir.mkdir()

    all_ids = collect(args, trees["stock"], envs["stock"], None)
    wanted = set(collect(args, trees["stock"], envs["stock"], args.keyword)) if args.keyword else set(all_ids)
    if args.subset:
        wanted = {n for n in wanted if any(s in n for s in SUBSETS[args.subset])}
    excluded = {}
    for nodeid in all_ids:
        for pattern, reason in EXCLUDED:
            if re.search(pattern, nodeid):
                excluded[nodeid] = reason
                break
    nodeids = [n for n in all_ids if n in wanted and n not in excluded]
    say(f"collected {len(all_ids)} tests; {len(excluded)} excluded; running {len(nodeids)} in {runs}")

    versions = _versions()
    reused = reused_stock(args.reuse_stock, sources, versions, manifest) if args.reuse_stock else {}
    reused = {n: r for n, r in reused.items() if n in nodeids}
    if reused:
        say(f"stock outcomes of {len(reused)} tests reused from {args.reuse_stock}")
    todo = {run: [n for n in nodeids if not (run == "stock" and n in reused)] for run in runs}
    results = run_all(args, {r: trees[r] for r in runs if todo[r]}, envs, todo, logdir, say)
    for run in ("stock", "swapped"):
        results.setdefault(run, {})
    results["stock"].update(reused)
    train_log = _read_jsonl(logdir / "swapped.train.jsonl")
    filtered_out = sum(1 for n in all_ids if n not in wanted and n not in excluded)
    report = summarize(nodeids, excluded, results, train_log, collected=len(all_ids), filtered_out=filtered_out)
    report["excluded"] = [{"test": n, "reason": r} for n, r in excluded.items()]
    report["meta"] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "wall_s": round(time.time() - started, 1),
        "runs": runs,
        "keyword": args.keyword,
        "subset": args.subset,
        "timeout_s": args.timeout,
        "jobs": args.jobs,
        "chunk": args.chunk,
        "source": sources["origin"],
        "package": package,
        "versions": versions,
        "optional_packages": _optional_packages(),
        "stock_reused_from": args.reuse_stock,
        "stock_reused_tests": len(reused),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "shared": True},
        "standins": manifest,
        "work_dir": str(work),
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print_report(report)
    say(f"wrote {output}; logs in {logdir}")
    return 0


# Packages whose presence changes code paths of the tests without being their subject (recorded, not compared).
OPTIONAL_PACKAGES = (
    "deepspeed", "einops", "liger-kernel", "vllm", "jmespath", "torchvision", "kernels", "bitsandbytes", "wandb",
)  # fmt: skip


def _optional_packages() -> dict:
    from importlib import metadata

    found = {}
    for name in OPTIONAL_PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def _versions() -> dict:
    probe = (
        "import json, trl, transformers, torch, datasets, accelerate, huggingface_hub, peft, sys;"
        "print(json.dumps({m.__name__: m.__version__ for m in (trl, transformers, torch, datasets, accelerate, "
        "huggingface_hub, peft)} | {'python': sys.version.split()[0]}))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    try:
        return json.loads(result.stdout)
    except json.JSONDecodeError:
        return {"error": result.stderr[-300:]}


if __name__ == "__main__":
    sys.exit(main())
