"""pytest plugin (loaded with `-p pytest_recorder`) that appends one JSON line per test to $TRL_COMPAT_RESULTS.

A line is written when a test starts (so that a crashed or killed pytest process still tells which test it was in)
and when its teardown ends, with the outcome and, for a failure, the first line of the exception and of its root
cause. Writing as we go, not at session end, keeps the results of a run whose process died.
"""

from __future__ import annotations

import json
import os
import time

import pytest

_phases: dict[str, dict] = {}


def _write(record: dict) -> None:
    path = os.environ.get("TRL_COMPAT_RESULTS")
    if path:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _last_line(exc: BaseException) -> str | None:
    """The last line of a multi-line message (e.g. the child's exception inside a GeneratorError's traceback)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if len(lines) > 1 else None


def _root_cause(exc: BaseException) -> BaseException:
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        nxt = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        if nxt is None:
            break
        exc = nxt
    return exc


def pytest_runtest_logstart(nodeid, location):
    _phases[nodeid] = {"start": time.time(), "duration": 0.0}
    _write({"event": "start", "nodeid": nodeid, "time": time.time()})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is not None and report.failed:
        exc = call.excinfo.value
        entry = _phases.setdefault(item.nodeid, {"start": time.time(), "duration": 0.0})
        entry.setdefault("message", _first_line(exc))
        entry.setdefault("root_cause", _first_line(_root_cause(exc)))
        entry.setdefault("failed_phase", call.when)
        if _last_line(exc):
            entry.setdefault("detail", _last_line(exc))


def pytest_runtest_logreport(report):
    entry = _phases.setdefault(report.nodeid, {"start": time.time(), "duration": 0.0})
    entry["duration"] += report.duration
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if hasattr(report, "wasxfail"):
            entry["outcome"] = "xfailed" if report.skipped else "xpassed"
            entry["reason"] = report.wasxfail
        elif report.skipped:
            entry["outcome"] = "skipped"
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
            entry["reason"] = reason.removeprefix("Skipped: ")
        elif report.failed:
            entry["outcome"] = "failed" if report.when == "call" else "error"
        else:
            entry["outcome"] = "passed"
    elif report.when == "teardown" and report.failed and entry.get("outcome") in (None, "passed"):
        entry["outcome"] = "error"
    if report.when == "teardown":
        record = {"event": "end", "nodeid": report.nodeid, "outcome": entry.get("outcome", "error")}
        for key in ("duration", "message", "detail", "root_cause", "failed_phase", "reason"):
            if key in entry:
                record[key] = entry[key]
        _write(record)
        _phases.pop(report.nodeid, None)
