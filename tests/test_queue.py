"""The staleness-bounded queue on its own: gate, eviction, counters, and real producer/consumer processes."""

import threading
import time

import pytest
import torch.multiprocessing as torch_mp

from trl_async.rollout import QueueClosed, StalenessBoundedQueue, last_use_version


def test_last_use_version_schedule():
    # One item per optimizer step.
    assert [last_use_version(n) for n in range(4)] == [0, 1, 2, 3]
    # One item feeds 4 micro-steps, 2 micro-steps per optimizer step: item n is used at versions 2n and 2n+1.
    assert [last_use_version(n, 4, 2) for n in range(3)] == [1, 3, 5]
    # Two items per optimizer step.
    assert [last_use_version(n, 1, 2, base=10) for n in range(4)] == [10, 10, 11, 11]


def test_gate_blocks_until_weights_are_recent_enough():
    q = StalenessBoundedQueue(max_staleness=1, capacity=10)
    q.publish(0)
    assert q.reserve(timeout=1) == (0, -1)
    assert q.reserve(timeout=1) == (1, 0)
    with pytest.raises(TimeoutError, match="needs weights >= v1"):
        q.reserve(timeout=0.3)  # item 2 is used at v2, so it needs weights >= v1
    q.publish(1)
    assert q.reserve(timeout=1) == (2, 1)


def test_gate_respects_capacity():
    q = StalenessBoundedQueue(max_staleness=5, capacity=2)
    q.publish(0)
    q.reserve(timeout=1)
    q.reserve(timeout=1)
    with pytest.raises(TimeoutError, match="2/2 outstanding"):
        q.reserve(timeout=0.3)
    q.put(0, 0, "a")
    assert q.get(last_use_version=0, timeout=1).payload == "a"
    assert q.reserve(timeout=1)[0] == 2


def test_eviction_drops_and_counts_old_rows():
    q = StalenessBoundedQueue(max_staleness=1, capacity=10)
    q.publish(3)
    for index, version in enumerate([0, 0, 3]):
        q.reserve(timeout=1)
        q.put(index, version, payload=f"item{index}", num_rows=8)
    item = q.get(last_use_version=3, timeout=1)  # items 0 and 1 have staleness 3 > 1: evicted
    assert (item.payload, item.staleness) == ("item2", 0)
    stats = q.stats()
    assert stats["evicted_items"] == 2 and stats["evicted_rows"] == 16
    assert stats["used_rows"] == 8 and stats["produced_rows"] == 24
    assert stats["staleness_max"] == 0


def test_staleness_is_measured_at_last_use():
    q = StalenessBoundedQueue(max_staleness=2, capacity=10)
    q.publish(0)
    q.reserve(timeout=1)
    q.put(0, 5, "x", num_rows=4)
    assert q.get(last_use_version=7, timeout=1).staleness == 2
    assert q.stats()["staleness_mean"] == 2.0


def test_close_wakes_both_sides():
    q = StalenessBoundedQueue(max_staleness=0, capacity=1)
    q.close()
    with pytest.raises(QueueClosed):
        q.reserve(timeout=1)
    with pytest.raises(QueueClosed):
        q.get(last_use_version=0, timeout=1)


def test_invalid_arguments_are_rejected():
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessBoundedQueue(max_staleness=-1)
    with pytest.raises(ValueError, match="capacity"):
        StalenessBoundedQueue(max_staleness=1, capacity=0)


def _gated_producer(q, num_items, generate_s):
    """A generator-like producer: waits at the gate, 'generates' with the newest published weights, enqueues."""
    for _ in range(num_items):
        index, min_version = q.reserve(timeout=120)
        version = q.published_version()
        assert version >= min_version
        time.sleep(generate_s)
        q.put(index, version, payload=index, num_rows=4)


def _stale_producer(q, num_items):
    """A producer that ignores the gate and always claims version 0."""
    for index in range(num_items):
        q.put(index, 0, payload=index, num_rows=4)


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_concurrent_processes_never_exceed_bound_and_waste_nothing(max_staleness):
    ctx = torch_mp.get_context("spawn")
    q = StalenessBoundedQueue(max_staleness=max_staleness, mp_context=ctx)
    q.publish(0)
    # Many items and a producer that never sleeps: it polls the gate while the consumer is between taking an item
    # and publishing the next version, the window in which a stale gate once let it generate with old weights.
    num_items = 40
    producer = ctx.Process(target=_gated_producer, args=(q, num_items, 0.0), daemon=True)
    producer.start()
    try:
        seen = []
        for step in range(num_items):
            item = q.get(last_use_version=step, timeout=120)
            assert item.staleness <= max_staleness
            seen.append(item.payload)
            time.sleep(0.005)  # 'train'
            q.publish(step + 1)  # optimizer step done, weights published
        producer.join(10)
        assert producer.exitcode == 0
        assert seen == list(range(num_items))
        stats = q.stats()
        assert stats["evicted_rows"] == 0
        assert stats["staleness_max"] <= max_staleness
        if max_staleness > 0:
            # The producer ran ahead, so rows really were stale (the bound is exercised, not trivially met).
            assert stats["staleness_max"] >= 1
    finally:
        if producer.is_alive():
            producer.kill()


def test_concurrent_stale_producer_is_fully_evicted():
    ctx = torch_mp.get_context("spawn")
    q = StalenessBoundedQueue(max_staleness=1, capacity=100, mp_context=ctx)
    producer = ctx.Process(target=_stale_producer, args=(q, 5), daemon=True)
    producer.start()
    producer.join(30)
    with pytest.raises(TimeoutError):
        q.get(last_use_version=2, timeout=2)  # everything is 2 versions old
    stats = q.stats()
    assert stats["evicted_items"] == 5 and stats["evicted_rows"] == 20 and stats["used_rows"] == 0


def test_waiting_consumer_overrides_a_mispredicted_schedule():
    # If the consumer reaches an item at an earlier version than the schedule predicted, the gate must follow the
    # consumer's real version rather than wait for weights that will never come.
    q = StalenessBoundedQueue(max_staleness=0, capacity=10, micro_steps_per_version=1)
    q.publish(0)
    q.reserve(timeout=1)
    q.put(0, 0, "a")
    assert q.get(last_use_version=0, timeout=1).payload == "a"
    # The schedule predicts item 1 at v1; the consumer wants it at v0 and says so by waiting.
    got = {}
    consumer = threading.Thread(target=lambda: got.setdefault("item", q.get(last_use_version=0, timeout=5)))
    consumer.start()
    index, min_version = q.reserve(timeout=3)  # would time out without the waiting-consumer rule
    assert (index, min_version) == (1, 0)
    q.put(index, 0, "b")
    consumer.join(5)
    assert got["item"].payload == "b" and got["item"].staleness == 0
