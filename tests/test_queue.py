"""The staleness-bounded queue on its own: gate, eviction, counters, and real producer/consumer processes."""

import os
import shutil
import signal
import threading
import time

import pytest
import torch.multiprocessing as torch_mp

from trl_async.rollout import QueueClosed, StalenessBoundedQueue, last_use_version


@pytest.fixture(autouse=True)
def _remove_hand_built_spools():
    """The queues these tests build by hand are not always `cleanup()`-ed: remove the spool folders this process made
    during the test (named after its pid), so that the suite leaves nothing in /dev/shm."""
    prefix = f"trl_async-{os.getpid()}-"
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    yield
    if os.path.isdir("/dev/shm"):
        for entry in set(os.listdir("/dev/shm")) - before:
            if entry.startswith(prefix):
                shutil.rmtree(os.path.join("/dev/shm", entry), ignore_errors=True)


def process_context():
    """Real child processes, forked: a spawned child costs seconds of imports per test, and the queue's counters and
    spool directory are shared the same way whichever way the child starts (the trainer's tests spawn)."""
    return torch_mp.get_context("fork")


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
    ctx = process_context()
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
    ctx = process_context()
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


# ------------------------------------------------------------------------------------------------ deferred open
def _produce_items(q, count, payload_size=0, version=None):
    """A producer process: reserve, 'generate' with the newest published weights, put (payload: index bytes)."""
    for _ in range(count):
        index, min_version = q.reserve()
        used = q.published_version() if version is None else version
        assert used >= min_version or version is not None
        q.put(index, used, payload=(index, bytes([index % 251]) * payload_size), num_rows=2)


def test_deferred_open_producer_waits_then_starts_at_the_opened_index():
    ctx = process_context()
    q = StalenessBoundedQueue(max_staleness=1, start_index=None, mp_context=ctx)
    assert not q.is_open
    q.publish(0)
    with pytest.raises(TimeoutError, match="not opened"):
        q.reserve(timeout=0.3)
    with pytest.raises(RuntimeError, match="open"):
        q.get(last_use_version=0, timeout=0.3)
    producer = ctx.Process(target=_produce_items, args=(q, 2), daemon=True)
    producer.start()
    try:
        time.sleep(0.5)
        assert q.stats()["reserved_items"] == 0 and q.qsize() == 0  # the producer waits for `open`
        assert not os.listdir(q.spool_dir)
        # The trainer made items 0..4 itself (versions 0..4); the producer takes over at item 5, used at v5.
        q.publish(5)
        q.open(5)
        assert q.is_open
        with pytest.raises(RuntimeError, match="already open"):
            q.open(7)
        first = q.get(last_use_version=5, timeout=30)
        second = q.get(last_use_version=6, timeout=30)
        assert (first.index, second.index) == (5, 6)
        assert first.payload[0] == 5 and second.payload[0] == 6
        producer.join(10)
        assert producer.exitcode == 0
        stats = q.stats()
        assert stats["consumed_items"] == 7 and stats["used_items"] == 2 and stats["produced_rows"] == 4
    finally:
        if producer.is_alive():
            producer.kill()
        q.cleanup()


def test_deferred_open_gate_uses_the_schedule_from_the_opened_index():
    # Item 5 (one item per version, base 0) is last used at v5: with max_staleness=1 it needs weights >= v4.
    q = StalenessBoundedQueue(max_staleness=1, start_index=None, capacity=10)
    q.publish(3)
    q.open(5)
    with pytest.raises(TimeoutError, match=r"item 5 needs weights >= v4"):
        q.reserve(timeout=0.3)
    q.publish(4)
    assert q.reserve(timeout=1) == (5, 4)
    q.cleanup()


# ------------------------------------------------------------------------------------------------ agree (several ranks)
def test_agree_evicts_an_item_that_is_fresh_here_but_too_old_on_another_rank():
    q = StalenessBoundedQueue(max_staleness=1, capacity=10)
    q.publish(2)
    for index, version in enumerate([2, 2, 1]):
        q.reserve(timeout=1)
        q.put(index, version, payload=f"item{index}", num_rows=3 + index)
    # Another rank's staleness of items 0, 1, 2 (at the same use version): 3, 1, 0.
    other_rank = iter([3, 1, 0])
    seen = []

    def agree(local):
        seen.append(local)
        return max(local, next(other_rank))

    item = q.get(last_use_version=2, timeout=1, agree=agree)
    # Item 0 is fresh here (staleness 0) but 3 versions old on the other rank: evicted; item 1 is kept.
    assert seen == [0, 0]
    assert item.index == 1 and item.payload == "item1"
    assert item.staleness == 0  # this rank's own staleness is what the item carries
    stats = q.stats()
    assert (stats["evicted_items"], stats["evicted_rows"]) == (1, 3)
    assert (stats["used_items"], stats["used_rows"]) == (1, 4)
    assert stats["staleness_max"] == 0
    item = q.get(last_use_version=2, timeout=1, agree=agree)
    assert item.index == 2 and item.staleness == 1 and seen == [0, 0, 1]
    q.cleanup()


def test_agree_is_not_needed_for_an_item_stale_everywhere():
    q = StalenessBoundedQueue(max_staleness=0, capacity=10)
    q.publish(1)
    for index, version in enumerate([0, 1]):
        q.reserve(timeout=1)
        q.put(index, version, payload=index)
    assert q.get(last_use_version=1, timeout=1, agree=lambda local: local).index == 1
    assert q.stats()["evicted_items"] == 1
    q.cleanup()


# ------------------------------------------------------------------------------------------------ schedule after evictions
def brute_force_last_use(used_indices, micro_steps_per_item, micro_steps_per_version, base=0):
    """Walk the consumer's micro-steps: each used item takes `micro_steps_per_item` of them, the version advances every
    `micro_steps_per_version`; an evicted item takes none. Returns {index: version of its last micro-step}."""
    micro_step, last_use = 0, {}
    for index in used_indices:
        micro_step += micro_steps_per_item
        last_use[index] = base + (micro_step - 1) // micro_steps_per_version
    return last_use


@pytest.mark.parametrize("g,a", [(1, 1), (4, 2), (1, 3)])
def test_evictions_shift_the_schedule_of_later_items(g, a):
    max_staleness = 2
    q = StalenessBoundedQueue(max_staleness, capacity=20, micro_steps_per_item=g, micro_steps_per_version=a)
    q.publish(max(brute_force_last_use(range(5), g, a).values()) - max_staleness)  # enough to make items 0..4
    for index in range(5):
        q.reserve(timeout=1)
        q.put(index, 0, payload=index)
    evicted = {1, 3}  # as if another rank found them too old

    def agree(local):  # called while the queue decides on item `consumed_items`
        return 99 if q.stats()["consumed_items"] in evicted else local

    kept = [q.get(0, timeout=1, agree=agree) for _ in range(3)]
    assert [item.index for item in kept] == [0, 2, 4] and q.stats()["evicted_items"] == 2
    expected = brute_force_last_use([i for i in range(12) if i not in evicted], g, a)
    for index in range(5, 12):
        assert q.last_use_version(index) == expected[index], index
        assert q.min_generation_version(index) == expected[index] - max_staleness
    # The gate applies the shifted schedule: it admits exactly the items whose shifted use allows the weights.
    published = q.published_version()
    admitted = [n for n in range(5, 12) if expected[n] - max_staleness <= published]
    assert admitted and len(admitted) < 7
    for index in admitted:
        assert q.reserve(timeout=1) == (index, expected[index] - max_staleness)
    blocked = admitted[-1] + 1
    with pytest.raises(TimeoutError, match=f"item {blocked} needs weights >= v{expected[blocked] - max_staleness}"):
        q.reserve(timeout=0.3)
    q.cleanup()


# ------------------------------------------------------------------------------------------------ misuse and cleanup
def test_put_out_of_order_is_refused():
    q = StalenessBoundedQueue(max_staleness=1, capacity=4)
    q.publish(0)
    q.reserve(timeout=1)
    q.reserve(timeout=1)
    with pytest.raises(ValueError, match="expected item 0, got 1"):
        q.put(1, 0, "early")
    q.put(0, 0, "a")
    with pytest.raises(ValueError, match="expected item 1, got 0"):
        q.put(0, 0, "again")
    q.put(1, 0, "b")
    assert [q.get(0, timeout=1).payload, q.get(0, timeout=1).payload] == ["a", "b"]
    q.cleanup()


def _cleanup_in_child(q):
    q.cleanup()


def test_cleanup_removes_the_spool_dir_only_from_the_consumer():
    ctx = process_context()
    q = StalenessBoundedQueue(max_staleness=1, capacity=4, mp_context=ctx)
    q.publish(0)
    q.reserve(timeout=1)
    q.put(0, 0, "x" * 1000)
    assert os.path.isdir(q.spool_dir) and os.listdir(q.spool_dir)
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        assert q.spool_dir.startswith("/dev/shm/")
    child = ctx.Process(target=_cleanup_in_child, args=(q,))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert os.path.isdir(q.spool_dir)  # a producer's cleanup closes the queue but leaves the consumer's directory
    assert q.closed
    q.cleanup()
    assert not os.path.exists(q.spool_dir)
    q.cleanup()  # idempotent
    with pytest.raises(QueueClosed):
        q.get(0, timeout=1)


# ------------------------------------------------------------------------------------------------ killed producer
class ProducerDead(RuntimeError):
    pass


PAYLOAD_SIZE = 24 * 2**20  # 24 MiB: writing an item takes long enough for kills to land mid-write


def _drain_until_dead(q, producer, next_index):
    """Consume like the trainer does (on_wait = health check) until the check reports the producer dead; every item
    taken must be whole. Returns the indices taken."""

    def check():
        if not producer.is_alive():
            raise ProducerDead

    taken = []
    with pytest.raises(ProducerDead):
        while True:
            # A large use version: nothing counts as too old. The timeout only turns a hang into a failure.
            item = q.get(last_use_version=10**6, on_wait=check, timeout=60)
            assert item.index == next_index + len(taken)
            index, data = item.payload
            assert index == item.index and data == bytes([index % 251]) * PAYLOAD_SIZE, "a partial item was read"
            taken.append(item.index)
    return taken


def _kill(process):
    os.kill(process.pid, signal.SIGKILL)
    process.join(10)
    assert process.exitcode == -signal.SIGKILL


def _killable_queue(ctx, capacity=100):
    q = StalenessBoundedQueue(max_staleness=10**6, capacity=capacity, mp_context=ctx)
    q.publish(0)
    return q


def test_producer_killed_mid_write_never_blocks_the_consumer_and_its_partial_item_is_never_read():
    ctx = process_context()
    landed_mid_write = 0
    for _attempt in range(8):
        q = _killable_queue(ctx)
        producer = ctx.Process(target=_produce_items, args=(q, 6, PAYLOAD_SIZE, 0), daemon=True)
        producer.start()
        try:
            deadline = time.time() + 60
            while time.time() < deadline and not any(n.endswith(".tmp") for n in os.listdir(q.spool_dir)):
                time.sleep(0.0005)
            _kill(producer)
            partial = [n for n in os.listdir(q.spool_dir) if n.endswith(".tmp")]
            started = time.perf_counter()
            taken = _drain_until_dead(q, producer, 0)
            assert time.perf_counter() - started < 10.0  # back in control within seconds (on_wait every 0.2 s)
            assert len(taken) == q.stats()["consumed_items"]
            if partial:
                landed_mid_write += 1
                assert os.path.exists(os.path.join(q.spool_dir, partial[0]))  # left alone, never taken
        finally:
            if producer.is_alive():
                producer.kill()
            q.cleanup()
        if landed_mid_write >= 2:
            break
    assert landed_mid_write >= 2, "no kill landed while an item was being written"


def test_producer_killed_at_the_gate_never_blocks_the_consumer():
    ctx = process_context()
    q = _killable_queue(ctx, capacity=2)
    producer = ctx.Process(target=_produce_items, args=(q, 5, 1024, 0), daemon=True)
    producer.start()
    try:
        deadline = time.time() + 60
        while q.stats()["reserved_items"] < 2 or q.stats()["produced_rows"] < 4:
            assert time.time() < deadline
            time.sleep(0.01)
        time.sleep(0.3)  # the producer now waits in `reserve` for room in the queue
        assert q.stats()["reserved_items"] == 2
        _kill(producer)
        taken = []

        def check():
            if not producer.is_alive():
                raise ProducerDead

        started = time.perf_counter()
        with pytest.raises(ProducerDead):
            while True:
                taken.append(q.get(last_use_version=0, on_wait=check, timeout=60).index)
        assert time.perf_counter() - started < 10.0
        assert taken == [0, 1]
    finally:
        if producer.is_alive():
            producer.kill()
        q.cleanup()


@pytest.mark.parametrize("seed", range(5))
def test_producer_killed_at_a_random_moment_never_blocks_the_consumer(seed):
    import random

    ctx = process_context()
    q = _killable_queue(ctx, capacity=3)
    # Far more items than the consumer can take in 0.4 s, so the producer is alive (running or gated) when killed:
    # a fast machine drained a 50-item producer before the kill.
    producer = ctx.Process(target=_produce_items, args=(q, 10**9, PAYLOAD_SIZE // 4, 0), daemon=True)
    producer.start()
    try:
        rng = random.Random(seed)
        taken = []
        consume_until = time.perf_counter() + rng.uniform(0.0, 0.4)
        while time.perf_counter() < consume_until:  # the consumer trains meanwhile; the producer runs ahead
            try:
                item = q.get(last_use_version=0, timeout=0.05)
            except TimeoutError:
                continue
            assert item.payload[1] == bytes([item.index % 251]) * (PAYLOAD_SIZE // 4)
            taken.append(item.index)
        _kill(producer)

        def check():
            if not producer.is_alive():
                raise ProducerDead

        started = time.perf_counter()
        with pytest.raises(ProducerDead):
            while True:
                item = q.get(last_use_version=0, on_wait=check, timeout=60)
                assert item.payload[1] == bytes([item.index % 251]) * (PAYLOAD_SIZE // 4)
                taken.append(item.index)
        assert time.perf_counter() - started < 10.0
        assert taken == list(range(len(taken)))
    finally:
        if producer.is_alive():
            producer.kill()
        q.cleanup()
