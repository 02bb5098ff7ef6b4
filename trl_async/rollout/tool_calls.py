"""How the generation process calls tools and environments: each call timed (`CallTimer`, the `tools` timeline span),
bounded by `tool_timeout` (`CallWatchdog`), and the first tool round of a batch run concurrently (`FirstRoundCalls`,
`PrefetchedTool`). Used by `rollout.agentic`; imports neither TRL nor torch."""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

from ..timeline import current as timeline
from ..timeline import names as span


class ToolTimeoutError(RuntimeError):
    """A tool or environment call did not return within `tool_timeout` (reported by the generation process)."""


class ToolLoopContractError(BaseException):
    """TRL's tool loop made a call other than the one the first round made for it: TRL changed how it runs the calls.

    A `BaseException`, not an `Exception`: it is raised inside TRL's call of the tool, and TRL's loop turns every
    `Exception` there into the tool's `{'error': ...}` result and goes on, so an `Exception` would never stop the run
    (the model would be trained on a conversation where the call silently failed). Like `KeyboardInterrupt` it passes
    through `except Exception` to the generation process, which reports every `BaseException` to the trainer
    (`GeneratorError`), and it stops the batch at the call that diverged, before a wrong result reaches any rollout."""


class CallWatchdog:
    """`tool_timeout` for the tool and environment calls of the generation process.

    A call that hangs cannot be interrupted from Python (a thread cannot be killed; a tool blocked in C ignores
    signals), so a late call ends the generation process: a watch thread calls `on_late(message)`, which the
    generation process implements as "report the error to the trainer, then exit" (`generator._generator_main`). The
    trainer raises `GeneratorError` naming the call and, as on every exit of `train()`, stops the process and removes
    its spool: nothing is left running. The call itself runs where it runs in TRL (on the generation process's main
    thread), so tools that rely on that (signals, thread-locals) behave as in TRL. While calls run, the watch thread
    beats the generation process's heartbeat: a slow tool is not a hung generation process."""

    def __init__(
        self,
        timeout: float | None,
        on_late: Callable[[str], None] | None,
        heartbeat: Callable[[], None] | None = None,
        poll_s: float = 0.1,
    ):
        self.timeout, self.on_late, self.heartbeat, self.poll_s = timeout, on_late, heartbeat, poll_s
        self._running: dict[int, tuple[str, float]] = {}  # call id -> (what, deadline); dict operations are atomic
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    @property
    def enforced(self) -> bool:
        return self.timeout is not None and self.on_late is not None

    @contextlib.contextmanager
    def watching(self, what: str):
        """The block is one call of `what` (e.g. "tool 'multiply'"): it must end within `timeout` seconds."""
        if not self.enforced:
            yield
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, daemon=True, name="trl-async-tool-watchdog")
            self._thread.start()
        key = next(self._ids)
        self._running[key] = (what, time.monotonic() + self.timeout)
        try:
            yield
        finally:
            self._running.pop(key, None)

    def _watch(self) -> None:
        while True:
            time.sleep(self.poll_s)
            running = list(self._running.values())
            if not running:
                continue
            if self.heartbeat is not None:
                self.heartbeat()
            now = time.monotonic()
            late = [what for what, deadline in running if deadline <= now]
            if late:
                self.on_late(
                    f"{late[0]} did not return within tool_timeout={self.timeout:g}s. A call that hangs cannot be "
                    "interrupted, so the generation process stops: make it return (or raise) in time, or raise "
                    "tool_timeout."
                )
                return


class CallTimer:
    """Seconds during which a tool or environment call ran (`RolloutPayload.tool_s`; concurrent calls count once),
    and each call's `tools` timeline span."""

    def __init__(self):
        self.total_s = 0.0
        self._lock = threading.Lock()
        self._running, self._since = 0, 0.0

    @contextlib.contextmanager
    def timing(self):
        recorder = timeline()
        started = recorder.begin()
        with self._lock:
            if self._running == 0:
                self._since = time.perf_counter()
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0:
                    self.total_s += time.perf_counter() - self._since
            recorder.end(span.TOOLS, started)


def watched(fn: Callable, what: str, watchdog: CallWatchdog, timer: CallTimer) -> Callable:
    """`fn` timed and bounded by the watchdog, with its name, docstring and signature (`functools.wraps`), sync or
    async as `fn` is. Whatever `fn` raises propagates unchanged: TRL's loop turns it into the tool's error result."""
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def call_async(*args, **kwargs):
            with timer.timing(), watchdog.watching(what):
                return await fn(*args, **kwargs)

        return call_async

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with timer.timing(), watchdog.watching(what):
            return fn(*args, **kwargs)

    return call


class FirstRoundCalls:
    """The sync tool calls of a batch's first tool round, started at once on `threads` threads, their outcomes handed
    to TRL's loop as it makes the calls (`PrefetchedTool`).

    TRL's loop calls the tools of one rollout after another; with a tool of real latency (a search, a sandbox) the
    generation process would wait for each call in turn. The first round's calls are known before TRL's loop starts
    (the parsed first turn), so they run concurrently, one rollout's calls in their order on one thread (its
    environment instance is used by that thread only); the results, and the exceptions, are the calls' own, and TRL
    turns them into tool messages and counts as it does. Later rounds run as TRL runs them. Tools shared by rollouts
    must then be thread-safe (`tool_call_threads=1`: TRL's one-after-another order)."""

    def __init__(self, threads: int):
        self.threads = threads
        self._executor = None
        self._rows: dict[int, Any] = {}  # row -> future of [(name, arguments, outcome, raised)] in TRL's call order

    def start(self, completions: list, sync_dicts: list[dict]) -> None:
        self._rows = {}
        calls = [(row, turn[0].get("tool_calls")) for row, turn in enumerate(completions)]
        # The calls TRL's loop makes through a sync tool: a function call of a known name whose arguments unpack
        # (`tool(**arguments)`); any other fails in TRL's loop before a tool is called, and is left to it.
        calls = [(row, [c["function"] for c in cs if c.get("type") == "function" and isinstance(c.get("function"), dict)
                        and c["function"].get("name") in sync_dicts[row]
                        and isinstance(c["function"].get("arguments"), dict)]) for row, cs in calls if cs]  # fmt: skip
        calls = [(row, functions) for row, functions in calls if functions]
        if self.threads <= 1 or len(calls) < 2:
            return  # nothing to overlap
        if self._executor is None:
            import concurrent.futures

            self._executor = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="trl-async-tool")
        for row, functions in calls:
            self._rows[row] = self._executor.submit(_call_in_order, sync_dicts[row], functions)

    def take(self, row: int, name: str, arguments: dict):
        """The outcome of row `row`'s next prefetched call, which must be TRL's call of `name(**arguments)`; None when
        the row has none left (later rounds: TRL calls the tool itself)."""
        future = self._rows.get(row)
        if future is None:
            return None
        outcomes = future.result()
        if not outcomes:
            return None
        called, called_with, outcome, raised = outcomes.pop(0)
        if (called, called_with) != (name, arguments):
            raise ToolLoopContractError(
                f"TRL's tool loop called {name}({arguments}) where the first round's calls, in TRL's order, had "
                f"{called}({called_with}): TRL changed how it runs the calls (trl_contract); set tool_call_threads=1."
            )
        if raised:
            raise outcome
        return (outcome,)

    def finish(self) -> None:
        self._rows = {}


def _call_in_order(sync_dict: dict, functions: list[dict]) -> list:
    """One rollout's first-round calls, in order: (name, arguments, result or exception, raised)."""
    outcomes = []
    for function in functions:
        try:
            outcomes.append((function["name"], function["arguments"], sync_dict[function["name"]].call(
                **function["arguments"]), False))  # fmt: skip
        except Exception as error:  # TRL's loop catches these (its tool error result); re-raised where it calls
            outcomes.append((function["name"], function["arguments"], error, True))
    return outcomes


class PrefetchedTool:
    """A sync tool as TRL's loop calls it (`_sync_tool_dicts[row][name](**arguments)`): the outcome of the call
    `FirstRoundCalls` already made, or else the call itself (`call`: the tool, timed and watched)."""

    def __init__(self, call: Callable, row: int, name: str, first_round: FirstRoundCalls):
        self.call, self.row, self.name, self.first_round = call, row, name, first_round
        functools.update_wrapper(self, call)

    def __call__(self, **arguments):
        prefetched = self.first_round.take(self.row, self.name, arguments)
        return self.call(**arguments) if prefetched is None else prefetched[0]
