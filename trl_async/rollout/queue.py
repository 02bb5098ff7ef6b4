"""A cross-process FIFO of rollout batches that bounds their staleness.

Every item carries the policy version of the weights that generated it. Two rules keep old data out of the loss:

* **Gate** (producer side). Item n will last be used at version `last_use_version(n)`. Before generating it, the
  producer waits until weights of at least version `last_use_version(n) - max_staleness` are published, so in steady
  state nothing it makes is too old when consumed, and nothing is wasted. Evicted items shift the schedule: the item
  after an eviction is used where the evicted one would have been.
* If the consumer is already waiting for item n at an earlier version than the schedule predicted, the gate follows
  the consumer's real version instead: a wrong prediction can cost slack, never a deadlock.
* **Evict** (consumer side). When an item is taken, its staleness is measured against the version at which the
  consumer will actually use it. An item older than `max_staleness` is dropped and counted. This is the hard
  guarantee: it holds even if the gate's schedule was wrong. With several data-parallel ranks, `get(agree=...)` lets
  the ranks take the same decision (an item is dropped everywhere if it is too old anywhere), so that the batches the
  ranks train on together stay aligned.

**No cross-process lock, condition or pipe.** Each shared counter has exactly one writer (the producer or the
consumer), and both sides poll. Items travel as files in a spool directory (in `/dev/shm` where available), written to
a temporary name and renamed, so a reader never sees half an item. A producer killed at any moment, SIGKILL included,
can leave nothing that the consumer would block on: the consumer's waits poll and call `on_wait`, which is where the
trainer checks the producer's health.

The queue is usable on its own. The trainers use it with one producer (the generation process of a rank) and one
consumer (that rank's trainer). The consumer creates it and owns the spool directory (`cleanup()` removes it).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as torch_mp

from ..schedule import last_use_version


@dataclasses.dataclass
class QueueItem:
    index: int
    version: int
    num_rows: int
    payload: Any
    staleness: int | None = None  # set by `get`: consumer's last-use version minus `version`


class QueueClosed(RuntimeError):
    """Raised on either side once `close()` was called."""


# Shared counters. "C" fields are written by the consumer only, "P" fields by the producer only.
_FIELDS = (
    "published",  # C: newest weights version published
    "start_index",  # C: first index the producer may generate (-1: not yet); see `open`
    "consumed",  # C: items taken by the consumer (used or evicted)
    "waiting_index",  # C: index the consumer is blocked on, -1 if none
    "waiting_last_use",  # C: the version at which it will use that item
    "closed",  # C: 1 once closed
    "evicted_items",  # C
    "evicted_rows",  # C
    "used_items",  # C
    "used_rows",  # C
    "staleness_row_sum",  # C
    "staleness_max",  # C
    "trainer_wait_s",  # C
    "last_index",  # C: the last item the consumer will need, were nothing evicted (-1: no end known); see `set_end`
    "reserved",  # P: next index the producer will generate (items reserved so far)
    "loaded",  # P: items whose generating weights the producer has loaded (see `mark_loaded`)
    "produced",  # P: items put (they are put in index order)
    "produced_rows",  # P
    "generator_wait_s",  # P
)
_SLOT = {name: i for i, name in enumerate(_FIELDS)}


class _Counters:
    """Named float64 slots in one shared array (integers are exact up to 2^53)."""

    def __init__(self, ctx):
        object.__setattr__(self, "_array", ctx.RawArray("d", len(_FIELDS)))

    def __getattr__(self, name):
        if name not in _SLOT:
            raise AttributeError(name)
        return self._array[_SLOT[name]]

    def __getstate__(self):
        return self._array

    def __setstate__(self, array):
        object.__setattr__(self, "_array", array)

    def __setattr__(self, name, value):
        self._array[_SLOT[name]] = value


class _Poller:
    """Sleeps with a short backoff and calls `on_wait` about every 0.2 s. `on_idle(True)` is called when the caller
    first blocks and `on_idle(False)` by `done()` if it did (a caller served at once is never idle)."""

    def __init__(
        self,
        on_wait: Callable[[], None] | None,
        timeout: float | None,
        describe: Callable[[], str],
        on_idle: Callable[[bool], None] | None = None,
    ):
        self.start = time.perf_counter()
        self.last_callback = self.start
        self.on_wait, self.timeout, self.describe, self.on_idle = on_wait, timeout, describe, on_idle
        self.sleep_s = 0.0002
        self.blocked = False

    def done(self) -> None:
        if self.blocked and self.on_idle is not None:
            self.on_idle(False)
        self.blocked = False

    def wait(self) -> None:
        if not self.blocked:
            self.blocked = True
            if self.on_idle is not None:
                self.on_idle(True)
        now = time.perf_counter()
        if self.timeout is not None and now - self.start >= self.timeout:
            raise TimeoutError(self.describe())
        if self.on_wait is not None and now - self.last_callback >= 0.2:
            self.last_callback = now
            self.on_wait()
        time.sleep(self.sleep_s)
        self.sleep_s = min(self.sleep_s * 2, 0.01)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start


class StalenessBoundedQueue:
    """FIFO of versioned items with a staleness gate for the producer and eviction for the consumer.

    Args:
        max_staleness: largest allowed (use version - generating version).
        capacity: most items reserved by the producer and not yet consumed (queued or being generated). Default:
            every item the staleness bound can admit, ceil((max_staleness + 1) * micro_steps_per_version /
            micro_steps_per_item).
        micro_steps_per_item, micro_steps_per_version, base_version: the consumer's schedule, used by the gate to
            predict the version at which each item will be used (see `last_use_version`).
        mp_context: a multiprocessing context or its name.
        start_index: the first index the producer generates. `None` defers it: the producer waits until the consumer
            calls `open(index)` (the trainer produces the first items itself while the generator starts).
        spool_dir: where items are written; default a new directory in `/dev/shm` (else the system temp dir).
    """

    def __init__(
        self,
        max_staleness: int,
        capacity: int | None = None,
        micro_steps_per_item: int = 1,
        micro_steps_per_version: int = 1,
        base_version: int = 0,
        mp_context="spawn",
        start_index: int | None = 0,
        spool_dir: str | None = None,
    ):
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an integer >= 0, got {max_staleness!r}.")
        if micro_steps_per_item < 1 or micro_steps_per_version < 1:
            raise ValueError("micro_steps_per_item and micro_steps_per_version must be >= 1.")
        if capacity is None:
            capacity = max(1, -(-(max_staleness + 1) * micro_steps_per_version // micro_steps_per_item))
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}.")
        ctx = torch_mp.get_context(mp_context) if isinstance(mp_context, str) else mp_context
        self.max_staleness = max_staleness
        self.capacity = capacity
        self.micro_steps_per_item = micro_steps_per_item
        self.micro_steps_per_version = micro_steps_per_version
        self.base_version = base_version
        self.spool_dir = spool_dir or _make_spool_dir()
        self._owner_pid = os.getpid()
        self._counters = _Counters(ctx)
        c = self._counters
        c.published = base_version - 1
        c.start_index = -1
        c.waiting_index = -1
        c.reserved = -1
        c.loaded = -1
        c.last_index = -1
        if start_index is not None:
            self.open(start_index)

    # ----------------------------------------------------------------------------------------------- schedule
    def last_use_version(self, index: int) -> int:
        # Each evicted item shifts the later ones one slot earlier in the consumer's schedule.
        slot = max(0, index - int(self._counters.evicted_items))
        return last_use_version(slot, self.micro_steps_per_item, self.micro_steps_per_version, self.base_version)

    def min_generation_version(self, index: int) -> int:
        """Oldest weights version allowed to generate item `index`."""
        return self.last_use_version(index) - self.max_staleness

    # ----------------------------------------------------------------------------------------------- producer
    def reserve(
        self,
        timeout: float | None = None,
        on_wait: Callable[[], None] | None = None,
        on_idle: Callable[[bool], None] | None = None,
        wait_for_weights: bool = True,
    ) -> tuple[int, int]:
        """Block until the next item may be generated; return `(index, min_version)` (`reserve_block` of one item)."""
        index, _, min_version = self.reserve_block(1, timeout, on_wait, on_idle, wait_for_weights)
        return index, min_version

    def reserve_block(
        self,
        max_items: int = 1,
        timeout: float | None = None,
        on_wait: Callable[[], None] | None = None,
        on_idle: Callable[[bool], None] | None = None,
        wait_for_weights: bool = True,
    ) -> tuple[int, int, int]:
        """Block until the next `max_items` items may be generated together; return `(first_index, count,
        min_version)`.

        The producer must then generate items `first_index .. first_index + count - 1` with weights of version >=
        `min_version` (they are published by then): the oldest weights the *last* of them admits, so every item of
        the block is within the bound (the gate of each item is the one `reserve` applies to it alone). `count` is
        `max_items`, except when the consumer is already waiting for the block's first item: then the items that are
        admissible right away, at least that one (a full block would keep a waiting trainer waiting longer, and the
        gate's fallback for a mispredicted schedule applies to the awaited item only), and at the end of the run
        (`set_end`), where the last block holds what is left. Time spent here is the
        generator's wait on the gate. `on_idle(True)` / `(False)` is called when the producer starts and stops
        blocking (see `cores`). `wait_for_weights=False` waits for room only: a producer that samples with weights
        loaded later (in-flight updates) waits for `min_version` itself, before its first sampled token.
        """
        if not isinstance(max_items, int) or max_items < 1:
            raise ValueError(f"max_items must be an integer >= 1, got {max_items!r}")
        c = self._counters
        poller = _Poller(on_wait, timeout, lambda: self._gate_state(int(c.reserved) + max_items - 1), on_idle)
        try:
            while True:
                if c.closed:
                    raise QueueClosed("the queue was closed")
                if c.start_index >= 0:
                    if c.reserved < c.start_index:
                        c.reserved = c.start_index
                    first = int(c.reserved)
                    awaited = c.waiting_index == first
                    count, min_version = self._admissible(first, max_items, awaited, wait_for_weights)
                    # A block cut short by the end of the run is whole: nothing after it will be needed.
                    if count == max_items or (count and (awaited or self._past_the_end(first + count))):
                        c.reserved = first + count
                        return first, count, min_version
                poller.wait()
        finally:
            poller.done()
            c.generator_wait_s += poller.elapsed

    def _admissible(self, first: int, max_items: int, awaited: bool, wait_for_weights: bool) -> tuple[int, int]:
        """How many items from `first` on may be generated now (room in the queue, and weights recent enough unless
        `wait_for_weights` is off), at most `max_items`, and the oldest weights version all of them admit."""
        c = self._counters
        count, min_version = 0, None
        for index in range(first, first + max_items):
            needed = self.min_generation_version(index)
            if index == first and awaited:
                # The consumer waits for this item at an earlier version than the schedule predicted: follow it.
                needed = min(needed, int(c.waiting_last_use) - self.max_staleness)
            if index - c.consumed >= self.capacity or (wait_for_weights and c.published < needed):
                break
            if self._past_the_end(index) and not (index == first and awaited):
                break
            count += 1
            min_version = needed if min_version is None else max(min_version, needed)
        return count, min_version

    def _past_the_end(self, index: int) -> bool:
        """Item `index` comes after the last one the consumer will need (`set_end`), evictions counted: generating it
        would only compete with the trainer's last steps for the device."""
        c = self._counters
        return c.last_index >= 0 and index > c.last_index + c.evicted_items

    def _gate_state(self, index: int) -> str:
        c = self._counters
        if c.start_index < 0:
            return "the consumer has not opened the queue"
        return (
            f"item {index} needs weights >= v{self.min_generation_version(index)} (published: v{int(c.published)}) "
            f"and room in the queue ({int(index - c.consumed)}/{self.capacity} outstanding)"
        )

    def mark_loaded(self, index: int) -> None:
        """The producer has loaded the weights that will generate item `index` (after `reserve`, before generating).
        Only `wait_for_loads` reads it: a trainer that holds the generator's weights back (`fixed_staleness`)."""
        self._counters.loaded = index + 1

    def put(self, index: int, version: int, payload: Any, num_rows: int = 1) -> None:
        """Enqueue item `index` (from `reserve`, in index order), generated by weights of `version`."""
        c = self._counters
        if c.closed:
            raise QueueClosed("the queue was closed")
        if index != c.produced:
            raise ValueError(f"items must be put in index order: expected item {int(c.produced)}, got {index}")
        item = QueueItem(index=index, version=version, num_rows=num_rows, payload=payload)
        path = self._item_path(index)
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "wb") as f:
            pickle.dump(item, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.rename(temporary, path)  # atomic: the consumer sees the whole item or nothing
        c.produced_rows += num_rows
        c.produced = index + 1

    def published_version(self) -> int:
        return int(self._counters.published)

    # ----------------------------------------------------------------------------------------------- consumer
    def open(self, start_index: int, evicted_before: int = 0) -> None:
        """Let the producer start at `start_index` (items before it were produced elsewhere, `evicted_before` of them
        evicted: the gate's schedule shifts by them as by its own evictions)."""
        c = self._counters
        if c.start_index >= 0:
            raise RuntimeError("the queue is already open")
        c.evicted_items += evicted_before
        c.consumed = start_index
        # `produced` is the producer's field, but the producer touches nothing before it sees `start_index`, which is
        # written last: this is the one write the consumer makes to it, before the producer can run.
        c.produced = start_index
        c.loaded = start_index
        c.start_index = start_index

    def set_end(self, last_index: int) -> None:
        """The consumer will need items up to `last_index` (and one more for each item it evicts): the producer
        reserves nothing beyond. A wrong end costs no deadlock: an item the consumer waits for is always admitted."""
        self._counters.last_index = last_index

    def count_evicted_before_start(self) -> None:
        """An item produced elsewhere just before `start_index` (after `open`) was evicted: it shifts the gate's
        schedule as the `evicted_before` items of `open` do."""
        self._counters.evicted_items += 1

    @property
    def is_open(self) -> bool:
        return self._counters.start_index >= 0

    def publish(self, version: int) -> None:
        """Tell the producer that weights of `version` are available (the consumer's policy reached it)."""
        c = self._counters
        if version > c.published:
            c.published = version

    def wait_for_loads(
        self,
        version: int,
        timeout: float | None = None,
        on_wait: Callable[[], None] | None = None,
        on_idle: Callable[[bool], None] | None = None,
    ) -> None:
        """Block until the producer has loaded the weights of every item whose oldest allowed version is below
        `version`: call it before publishing `version`, and each item is generated with exactly its oldest allowed
        weights, `min_generation_version(n)` (the gate waits for them, and nothing newer is published before the
        producer has loaded them). This is what `fixed_staleness` does; a normal run never waits here.

        Items are loaded in index order and `min_generation_version` does not decrease with the index, so the
        condition is that the next item to load needs `version` or newer. Time spent here is the trainer's wait."""
        c = self._counters
        poller = _Poller(
            on_wait,
            timeout,
            lambda: f"the producer has not loaded the weights of item {int(c.loaded)} (needs v{version - 1} or older)",
            on_idle,
        )
        try:
            while True:
                if c.closed:
                    raise QueueClosed("the queue was closed")
                loaded = int(c.loaded)
                # Past the run's end the producer loads nothing more, and nothing there needs older weights.
                if loaded >= 0 and (self.min_generation_version(loaded) >= version or self._past_the_end(loaded)):
                    return
                poller.wait()
        finally:
            poller.done()
            c.trainer_wait_s += poller.elapsed

    def get(
        self,
        last_use_version: int,
        timeout: float | None = None,
        on_wait: Callable[[], None] | None = None,
        agree: Callable[[int], int] | None = None,
        on_idle: Callable[[bool], None] | None = None,
    ) -> QueueItem:
        """Return the oldest item whose staleness at `last_use_version` is within bound, evicting older ones.

        `on_wait` is called about every 0.2 s while waiting; it may raise to abort (e.g. when the producer died).
        `agree(staleness) -> staleness` turns this rank's staleness of the item into the one every rank acts on (the
        maximum over ranks), so that all ranks evict the same items. Time spent here is the trainer's wait.
        `on_idle(True)` / `(False)` is called when the consumer starts and stops blocking (see `cores`).
        """
        c = self._counters
        if not self.is_open:
            raise RuntimeError("open() the queue before taking items from it")
        # The version first: the producer pairs `waiting_index` with `waiting_last_use`, so the index must not be
        # visible with a previous wait's version.
        c.waiting_last_use = last_use_version
        c.waiting_index = c.consumed
        poller = _Poller(on_wait, timeout, lambda: "no item arrived in time", on_idle)
        try:
            while True:
                if c.closed:
                    raise QueueClosed("the queue was closed")
                index = int(c.consumed)
                if c.produced <= index:
                    poller.wait()
                    continue
                poller.done()  # busy again: reading the item
                item = self._take(index)
                local = last_use_version - item.version
                staleness = local if agree is None else agree(local)
                c.consumed = index + 1
                if staleness > self.max_staleness:
                    c.evicted_items += 1
                    c.evicted_rows += item.num_rows
                    c.waiting_index = index + 1  # still waiting, now for the next item, at the same version (set)
                    continue
                c.waiting_index = -1
                c.used_items += 1
                c.used_rows += item.num_rows
                c.staleness_row_sum += max(local, 0) * item.num_rows
                c.staleness_max = max(c.staleness_max, local)
                item.staleness = local
                return item
        finally:
            poller.done()
            c.waiting_index = -1
            c.trainer_wait_s += poller.elapsed

    def _item_path(self, index: int) -> str:
        return os.path.join(self.spool_dir, f"item-{index:09d}.pkl")

    def _take(self, index: int) -> QueueItem:
        path = self._item_path(index)
        with open(path, "rb") as f:
            item = pickle.load(f)
        os.unlink(path)
        return item

    # ----------------------------------------------------------------------------------------------- both
    def close(self) -> None:
        self._counters.closed = 1

    def cleanup(self) -> None:
        """Close and remove the spool directory (consumer side; idempotent)."""
        self.close()
        if os.getpid() == self._owner_pid:
            shutil.rmtree(self.spool_dir, ignore_errors=True)

    @property
    def closed(self) -> bool:
        return bool(self._counters.closed)

    def qsize(self) -> int:
        """Items reserved by the producer and not yet consumed: queued, or being generated."""
        c = self._counters
        return int(max(0, c.reserved - c.consumed))

    def stats(self) -> dict[str, float]:
        """Cumulative counters, for metrics (`async/*`)."""
        c = self._counters
        used_rows = c.used_rows
        return {
            "reserved_items": max(0, int(c.reserved)),
            "consumed_items": int(c.consumed),
            "produced_rows": int(c.produced_rows),
            "used_rows": int(used_rows),
            "used_items": int(c.used_items),
            "evicted_rows": int(c.evicted_rows),
            "evicted_items": int(c.evicted_items),
            "staleness_mean": c.staleness_row_sum / used_rows if used_rows else 0.0,
            "staleness_max": int(c.staleness_max),
            "generator_wait_s": c.generator_wait_s,
            "trainer_wait_s": c.trainer_wait_s,
            "published_version": int(c.published),
        }


def _make_spool_dir() -> str:
    # The owner's pid in the name tells whose folder it is (`ls /dev/shm`).
    prefix = f"trl_async-{os.getpid()}-"
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        try:
            return tempfile.mkdtemp(prefix=prefix, dir=shm)
        except OSError:
            pass
    return tempfile.mkdtemp(prefix=prefix)
