"""`SharedWeightStore` between real processes: no torn snapshot ever reaches a reader, and a reader (the generation
process) that dies at any moment can never stall the writer (the trainer).

A torn snapshot is detected from the data itself: every published version fills every element of every tensor with
the version number, so a consistent snapshot is constant and equals the version `read_into` returns. A control reader
that copies the same buffers without the store's sequence check runs beside it and must see torn snapshots, which
shows that the writer really overwrites the buffers while they are being read.

Child processes are forked: a spawned child costs seconds of imports per test, and the store's buffers and counters
are shared memory either way (`tests/test_backends.py` passes stores to a spawned generation process).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import threading
import time

import pytest
import torch
import torch.multiprocessing as torch_mp

from tests.support.weights import read_copy
from trl_async.rollout import weights
from trl_async.rollout.weights import SharedWeightStore

SHAPES = {
    "embed.weight": ((256, 256), torch.float32),
    "layer.0.bias": ((4096,), torch.float64),
    "layer.1.weight": ((128, 512), torch.int32),
}


def filled(version: int, shapes=SHAPES) -> dict[str, torch.Tensor]:
    return {name: torch.full(shape, version, dtype=dtype) for name, (shape, dtype) in shapes.items()}


def snapshot_values(tensors: dict[str, torch.Tensor]) -> set[float]:
    """Every distinct value in a snapshot: a single value for a consistent one."""
    return {float(v) for t in tensors.values() for v in torch.aminmax(t)}


def make_store(shapes=SHAPES, ctx="fork") -> SharedWeightStore:
    return SharedWeightStore(filled(0, shapes).items(), mp_context=ctx)


# ------------------------------------------------------------------------------------------------ torn reads
def _writer(store: SharedWeightStore, stop, published, seed: int) -> None:
    torch.set_num_threads(1)
    rng = random.Random(seed)
    version = store.version
    tensors = filled(version)
    while not stop.value:
        version += 1
        for t in tensors.values():
            t.fill_(version)
        store.publish(tensors.items(), version)
        published.value = version
        time.sleep(rng.random() * 0.002)  # the trainer publishes between steps; here as often as ~1 kHz


def _reader(store: SharedWeightStore, num_reads: int, results) -> None:
    torch.set_num_threads(1)
    destination = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in SHAPES.items()}
    torn, mismatched, versions = 0, 0, []
    naive_torn, naive_reads = 0, 0
    deadline = time.perf_counter() + 60
    while (len(versions) < num_reads or naive_torn == 0) and time.perf_counter() < deadline:
        if len(versions) < num_reads:
            version = store.read_into(destination, timeout=30)
            values = snapshot_values(destination)
            torn += len(values) > 1
            mismatched += values != {float(version)}
            versions.append(version)
        # Control: the same copy without the sequence check.
        naive = {name: buffer.clone() for name, buffer in store.buffers.items()}
        naive_reads += 1
        naive_torn += len(snapshot_values(naive)) > 1
    results.put(
        dict(torn=torn, mismatched=mismatched, versions=versions, naive_torn=naive_torn, naive_reads=naive_reads)
    )


def test_concurrent_reader_never_sees_a_torn_snapshot():
    ctx = torch_mp.get_context("fork")
    store = make_store()
    store.publish(filled(0).items(), 0)
    stop, published = ctx.RawValue("i", 0), ctx.RawValue("q", 0)
    results = ctx.Queue()
    writer = ctx.Process(target=_writer, args=(store, stop, published, 0), daemon=True)
    reader = ctx.Process(target=_reader, args=(store, 3000, results), daemon=True)
    writer.start()
    reader.start()
    try:
        result = results.get(timeout=120)
    finally:
        stop.value = 1
        writer.join(10)
        reader.join(10)
        for p in (writer, reader):
            if p.is_alive():
                p.kill()
    versions = result["versions"]
    assert len(versions) == 3000
    assert result["torn"] == 0 and result["mismatched"] == 0, result
    assert versions == sorted(versions)  # a reader never goes back to older weights
    assert len(set(versions)) > 50, "the writer hardly published while the reader read: the race was not exercised"
    assert result["naive_torn"] > 0, "the harness never caught the writer mid-copy: it could not detect tearing"
    assert writer.exitcode == 0 and reader.exitcode == 0


# ------------------------------------------------------------------------------------------------ read_copy
def test_read_copy_returns_an_independent_consistent_snapshot():
    store = make_store()
    store.publish(filled(7).items(), 7)
    copy, version = read_copy(store)
    assert version == 7 and set(copy) == set(SHAPES)
    for name, (shape, dtype) in SHAPES.items():
        assert copy[name].shape == shape and copy[name].dtype == dtype
        assert copy[name].untyped_storage().data_ptr() != store.buffers[name].untyped_storage().data_ptr()
    assert snapshot_values(copy) == {7.0}
    copy["embed.weight"].fill_(-1)  # the copy is the caller's: the store keeps its contents
    store.publish(filled(8).items(), 8)
    assert snapshot_values(copy) == {7.0, -1.0}
    assert snapshot_values(read_copy(store)[0]) == {8.0}


def test_publish_and_read_refuse_missing_tensors():
    store = make_store()
    with pytest.raises(KeyError, match="missing 1 tensors"):
        store.publish([(n, t) for n, t in filled(1).items() if n != "layer.0.bias"], 1)
    assert store.version == -1  # nothing was published
    destination = {n: torch.empty(s, dtype=d) for n, (s, d) in SHAPES.items() if n != "embed.weight"}
    with pytest.raises(KeyError, match="no destination"):
        store.read_into(destination)


# ------------------------------------------------------------------------------------------------ wait_for_version
def _publish_later(store: SharedWeightStore, delay: float, version: int) -> None:
    time.sleep(delay)
    store.publish(filled(version).items(), version)


def test_wait_for_version_returns_when_another_process_publishes():
    ctx = torch_mp.get_context("fork")
    store = make_store()
    store.publish(filled(0).items(), 0)
    assert store.wait_for_version(0, timeout=0.1) == 0  # already there: no wait
    publisher = ctx.Process(target=_publish_later, args=(store, 0.5, 3), daemon=True)
    publisher.start()
    try:
        assert store.wait_for_version(2, timeout=120) == 3
        assert snapshot_values(read_copy(store)[0]) == {3.0}
    finally:
        publisher.join(10)


class _PollClock:
    """The store's clock, advanced only by the store's own sleeps: the wait is counted in polls, not measured, so
    what happens at each moment of the wait is exact whatever the machine's load."""

    def __init__(self):
        self.now, self.sleeps = 0.0, 0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds


def test_wait_for_version_times_out_and_calls_on_wait(monkeypatch):
    clock = _PollClock()
    monkeypatch.setattr(weights, "time", clock)
    store = make_store()
    store.publish(filled(4).items(), 4)
    calls = []
    with pytest.raises(TimeoutError, match="v5"):
        # Polls of 1/8 s (exact in binary): on_wait is due at the first poll 0.2 s or more after the previous call.
        store.wait_for_version(5, timeout=1.0, on_wait=lambda: calls.append(clock.now), poll_s=0.125)
    assert calls == [0.25, 0.5, 0.75]
    assert clock.now == 1.0 and clock.sleeps == 8  # it gave up at the timeout, not a poll earlier or later


def test_wait_for_version_is_aborted_by_on_wait(monkeypatch):
    clock = _PollClock()
    monkeypatch.setattr(weights, "time", clock)
    store = make_store()

    class Stop(Exception):
        pass

    calls = []

    def stop_after_two_calls():
        calls.append(clock.now)
        if len(calls) == 2:
            raise Stop

    with pytest.raises(Stop):
        store.wait_for_version(1, on_wait=stop_after_two_calls, poll_s=0.125)  # no timeout: only on_wait ends it
    assert calls == [0.25, 0.5] and clock.sleeps == 4  # it ended at the second call, without another poll


# ------------------------------------------------------------------------------------------------ dying processes
BIG = {"big.weight": ((4096, 2048), torch.float32)}  # 32 MiB: a read takes milliseconds, kills land mid-read


def _read_forever(store: SharedWeightStore, reads) -> None:
    destination = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in BIG.items()}
    while True:
        store.read_into(destination, timeout=30)
        reads.value += 1


def test_a_reader_killed_mid_read_never_blocks_the_next_publish():
    ctx = torch_mp.get_context("fork")
    store = make_store(BIG, ctx)
    store.publish(filled(0, BIG).items(), 0)
    rng = random.Random(1)
    version = 0
    for _ in range(6):
        reads = ctx.RawValue("q", 0)
        reader = ctx.Process(target=_read_forever, args=(store, reads), daemon=True)
        reader.start()
        while reads.value < 2:  # reading for real
            time.sleep(0.001)
        time.sleep(rng.random() * 0.05)
        os.kill(reader.pid, signal.SIGKILL)
        reader.join(10)
        assert reader.exitcode == -signal.SIGKILL
        version += 1
        # The publish completes (a copy of 32 MiB) whatever the reader was doing: nothing waits for a reader.
        publisher = threading.Thread(target=store.publish, args=(filled(version, BIG).items(), version))
        publisher.start()
        publisher.join(120)  # a bound on a hang only: a blocked writer would never finish
        assert not publisher.is_alive(), "the writer is blocked by the killed reader"
        assert store.version == version
    copy, read_version = read_copy(store, timeout=5)
    assert read_version == version and snapshot_values(copy) == {float(version)}


def _publish_forever(store: SharedWeightStore, published) -> None:
    version = store.version
    tensors = filled(0, BIG)
    while True:
        version += 1
        for t in tensors.values():
            t.fill_(version)
        store.publish(tensors.items(), version)
        published.value = version


def test_a_writer_killed_mid_publish_yields_an_error_or_a_consistent_snapshot_never_a_torn_one():
    """If the publisher dies mid-copy the buffers hold a mix of two versions; a reader must refuse them (time out with
    an error), never return them."""
    ctx = torch_mp.get_context("fork")
    store = make_store(BIG, ctx)
    store.publish(filled(0, BIG).items(), 0)
    rng = random.Random(2)
    refused = 0
    for _ in range(30):  # about half of the writer's time is spent copying: the first kills nearly always land
        published = ctx.RawValue("q", 0)
        writer = ctx.Process(target=_publish_forever, args=(store, published), daemon=True)
        writer.start()
        start_version = published.value
        while published.value < start_version + 2:
            time.sleep(0.001)
        time.sleep(rng.random() * 0.05)
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(10)
        try:
            copy, version = read_copy(store, timeout=0.5)
        except RuntimeError as error:
            assert "consistent" in str(error)
            refused += 1
        else:
            assert snapshot_values(copy) == {float(version)}
        if refused:
            break
    assert refused >= 1, "no kill landed mid-publish: the case was not exercised"


def test_a_failed_publish_does_not_break_later_publishes():
    store = make_store()
    store.publish(filled(1).items(), 1)
    wrong = filled(2)
    wrong["layer.1.weight"] = torch.zeros(3, 3, dtype=torch.int32)  # cannot be copied into a (128, 512) buffer
    with pytest.raises(RuntimeError):
        store.publish(wrong.items(), 2)
    store.publish(filled(3).items(), 3)  # the trainer carries on and publishes the next version correctly
    copy, version = read_copy(store, timeout=0.5)
    assert version == 3 and snapshot_values(copy) == {3.0}


def _read_one(store, queue):
    """In a fork-server child: the sum of every tensor of the store it was handed (at module level: picklable)."""
    queue.put(sum(float(t.sum()) for t in store.buffers.values()))


def test_a_store_of_hundreds_of_tensors_reaches_a_fork_server_child():
    """A fork server passes each shared buffer as a file descriptor and refuses more than 256 ('too many fds'):
    Qwen2.5-0.5B's frozen base has 290 tensors. The store must reach the generation process whatever its tensor count,
    with every value in place, and with the dtypes it was given."""
    named = [(f"layer{i}.weight", torch.full((3, 2), float(i))) for i in range(400)]
    named += [("mask", torch.ones(5, dtype=torch.int64)), ("half", torch.full((2,), 0.5, dtype=torch.bfloat16))]
    store = SharedWeightStore(named)
    store.publish(named, version=1)
    assert {name: store.buffers[name].dtype for name in ("mask", "half")} == {
        "mask": torch.int64,
        "half": torch.bfloat16,
    }
    ctx = multiprocessing.get_context("forkserver")
    queue = ctx.Queue()
    child = ctx.Process(target=_read_one, args=(store, queue))
    child.start()
    total = queue.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert total == pytest.approx(6 * sum(range(400)) + 5 + 1.0)
