"""A cross-process FIFO of rollout batches that bounds their staleness.

Every item carries the policy version of the weights that generated it. Two rules keep old data out of the loss:

* **Gate** (producer side). Item n will last be used at version `last_use_version(n)`. Before generating it, the
  producer waits until weights of at least version `last_use_version(n) - max_staleness` are published, so in steady
  state nothing it makes is too old when consumed, and nothing is wasted.
* If the consumer is already waiting for item n at an earlier version than the schedule predicted (for example
  after an eviction), the gate follows the consumer's real version instead: a wrong prediction can cost slack,
  never a deadlock.
* **Evict** (consumer side). When an item is dequeued, its staleness is measured against the version at which the
  consumer will actually use it. An item older than `max_staleness` is dropped and counted. This is the hard
  guarantee: it holds even if the gate's schedule was wrong (a resumed run, a consumer that skipped ahead).

The queue is made from `multiprocessing` primitives of one context (spawn by default), so it can be handed to a
child process as a `Process` argument. It is usable on its own; the trainers use it with one producer (the
generation process of a rank) and one consumer (that rank's trainer).
"""

from __future__ import annotations

import dataclasses
import queue as std_queue
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as torch_mp


def last_use_version(index: int, micro_steps_per_item: int = 1, micro_steps_per_version: int = 1, base: int = 0):
    """Version at which item `index` is last used, when the consumer takes one item every `micro_steps_per_item`
    micro-steps and advances one version every `micro_steps_per_version` micro-steps, starting at `base`."""
    g, a = micro_steps_per_item, micro_steps_per_version
    return base + (index * g + g - 1) // a


@dataclasses.dataclass
class QueueItem:
    index: int
    version: int
    num_rows: int
    payload: Any
    staleness: int | None = None  # set by `get`: consumer's last-use version minus `version`


class QueueClosed(RuntimeError):
    """Raised on either side once `close()` was called."""


class StalenessBoundedQueue:
    """FIFO of versioned items with a staleness gate for the producer and eviction for the consumer.

    Args:
        max_staleness: largest allowed (use version - generating version).
        capacity: most items reserved by the producer and not yet consumed (queued or being generated). Default:
            every item the staleness bound can admit, ceil((max_staleness + 1) * micro_steps_per_version /
            micro_steps_per_item).
        micro_steps_per_item, micro_steps_per_version, base_version: the consumer's schedule, used by the gate to
            predict the version at which each item will be used (see `last_use_version`).
        mp_context: a multiprocessing context or its name; items pickled across it must be picklable there.
    """

    def __init__(
        self,
        max_staleness: int,
        capacity: int | None = None,
        micro_steps_per_item: int = 1,
        micro_steps_per_version: int = 1,
        base_version: int = 0,
        mp_context="spawn",
    ):
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an integer >= 0, got {max_staleness!r}.")
        if capacity is None:
            capacity = max(1, -(-(max_staleness + 1) * micro_steps_per_version // micro_steps_per_item))
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}.")
        if micro_steps_per_item < 1 or micro_steps_per_version < 1:
            raise ValueError("micro_steps_per_item and micro_steps_per_version must be >= 1.")
        ctx = torch_mp.get_context(mp_context) if isinstance(mp_context, str) else mp_context
        self.max_staleness = max_staleness
        self.capacity = capacity
        self.micro_steps_per_item = micro_steps_per_item
        self.micro_steps_per_version = micro_steps_per_version
        self.base_version = base_version
        self._cond = ctx.Condition()
        self._items = ctx.Queue()
        # All counters are guarded by self._cond's lock.
        self._published = ctx.RawValue("q", base_version - 1)
        self._reserved = ctx.RawValue("q", 0)
        self._consumed = ctx.RawValue("q", 0)
        self._closed = ctx.RawValue("b", False)
        # While the consumer blocks in `get`, the index it waits for and that item's real last-use version: the gate
        # then never asks for weights newer than the consumer has, so a mispredicted schedule cannot deadlock.
        self._waiting_index = ctx.RawValue("q", -1)
        self._waiting_last_use = ctx.RawValue("q", 0)
        self._produced_rows = ctx.RawValue("q", 0)
        self._used_rows = ctx.RawValue("q", 0)
        self._used_items = ctx.RawValue("q", 0)
        self._evicted_rows = ctx.RawValue("q", 0)
        self._evicted_items = ctx.RawValue("q", 0)
        self._staleness_row_sum = ctx.RawValue("q", 0)
        self._staleness_max = ctx.RawValue("q", 0)
        self._generator_wait_s = ctx.RawValue("d", 0.0)
        self._trainer_wait_s = ctx.RawValue("d", 0.0)

    # ----------------------------------------------------------------------------------------------- schedule
    def last_use_version(self, index: int) -> int:
        return last_use_version(index, self.micro_steps_per_item, self.micro_steps_per_version, self.base_version)

    def min_generation_version(self, index: int) -> int:
        """Oldest weights version allowed to generate item `index`."""
        return self.last_use_version(index) - self.max_staleness

    # ----------------------------------------------------------------------------------------------- producer
    def reserve(
        self,
        timeout: float | None = None,
        on_wait: Callable[[], None] | None = None,
        poll_s: float = 0.2,
    ) -> tuple[int, int]:
        """Block until the next item may be generated; return `(index, min_version)`.

        The producer must then generate item `index` with weights of version >= `min_version` (they are published
        by then) and `put` it. Time spent blocked here is the generator's wait on the gate.
        """
        start = time.perf_counter()
        deadline = None if timeout is None else start + timeout
        with self._cond:
            while True:
                if self._closed.value:
                    raise QueueClosed("the queue was closed")
                index = self._reserved.value
                min_version = self.min_generation_version(index)
                if self._waiting_index.value == index:
                    min_version = min(min_version, self._waiting_last_use.value - self.max_staleness)
                has_room = index - self._consumed.value < self.capacity
                if has_room and self._published.value >= min_version:
                    self._reserved.value = index + 1
                    self._generator_wait_s.value += time.perf_counter() - start
                    return index, min_version
                if deadline is not None and time.perf_counter() >= deadline:
                    raise TimeoutError(
                        f"item {index} needs weights >= v{min_version} (published: v{self._published.value}) and "
                        f"room in the queue ({index - self._consumed.value}/{self.capacity} outstanding)"
                    )
                self._cond.wait(poll_s)
                if on_wait is not None:
                    on_wait()

    def put(self, index: int, version: int, payload: Any, num_rows: int = 1) -> None:
        """Enqueue item `index` (from `reserve`), generated by weights of `version`."""
        with self._cond:
            if self._closed.value:
                raise QueueClosed("the queue was closed")
            self._produced_rows.value += num_rows
        self._items.put(QueueItem(index=index, version=version, num_rows=num_rows, payload=payload))

    def published_version(self) -> int:
        return self._published.value

    # ----------------------------------------------------------------------------------------------- consumer
    def publish(self, version: int) -> None:
        """Tell the producer that weights of `version` are available (the consumer's policy reached it)."""
        with self._cond:
            if version > self._published.value:
                self._published.value = version
            self._cond.notify_all()

    def get(
        self,
        last_use_version: int,
        timeout: float | None = None,
        on_wait: Callable[[], None] | None = None,
        poll_s: float = 0.2,
    ) -> QueueItem:
        """Return the oldest item whose staleness at `last_use_version` is within bound, evicting older ones.

        `on_wait` is called about every `poll_s` seconds while waiting; it may raise to abort (e.g. when the
        producer died). Time spent blocked here is the trainer's wait on the queue.
        """
        start = time.perf_counter()
        deadline = None if timeout is None else start + timeout
        with self._cond:
            self._waiting_index.value = self._consumed.value
            self._waiting_last_use.value = last_use_version
            self._cond.notify_all()
        try:
            while True:
                if self._closed.value:
                    raise QueueClosed("the queue was closed")
                try:
                    item = self._items.get(timeout=poll_s)
                except std_queue.Empty:
                    if deadline is not None and time.perf_counter() >= deadline:
                        raise TimeoutError("no item arrived in time") from None
                    if on_wait is not None:
                        on_wait()
                    continue
                staleness = last_use_version - item.version
                with self._cond:
                    self._consumed.value += 1
                    if staleness > self.max_staleness:
                        self._evicted_items.value += 1
                        self._evicted_rows.value += item.num_rows
                        # Still waiting, now for the next item, at the same version.
                        self._waiting_index.value = self._consumed.value
                    else:
                        # Not waiting any more: a stale `_waiting_last_use` must not lower the gate for the next item.
                        self._waiting_index.value = -1
                        self._used_items.value += 1
                        self._used_rows.value += item.num_rows
                        self._staleness_row_sum.value += max(staleness, 0) * item.num_rows
                        self._staleness_max.value = max(self._staleness_max.value, staleness)
                    self._cond.notify_all()
                if staleness <= self.max_staleness:
                    item.staleness = staleness
                    return item
        finally:
            with self._cond:
                self._waiting_index.value = -1
                self._trainer_wait_s.value += time.perf_counter() - start

    # ----------------------------------------------------------------------------------------------- both
    def close(self) -> None:
        with self._cond:
            self._closed.value = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return bool(self._closed.value)

    def qsize(self) -> int:
        """Items reserved by the producer and not yet consumed: queued, or being generated."""
        with self._cond:
            return max(0, self._reserved.value - self._consumed.value)

    def stats(self) -> dict[str, float]:
        """Cumulative counters, for metrics (`async/*`)."""
        with self._cond:
            used_rows = self._used_rows.value
            return {
                "reserved_items": self._reserved.value,
                "consumed_items": self._consumed.value,
                "produced_rows": self._produced_rows.value,
                "used_rows": used_rows,
                "used_items": self._used_items.value,
                "evicted_rows": self._evicted_rows.value,
                "evicted_items": self._evicted_items.value,
                "staleness_mean": self._staleness_row_sum.value / used_rows if used_rows else 0.0,
                "staleness_max": self._staleness_max.value,
                "generator_wait_s": self._generator_wait_s.value,
                "trainer_wait_s": self._trainer_wait_s.value,
                "published_version": self._published.value,
            }
