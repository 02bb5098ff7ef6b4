"""CPU core lending (`trl_async/rollout/cores.py`): a process that waits lends its share of the cores to the other."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading

import pytest
import torch

from tests.support.trainer_utils import answer_reward, load_tokenizer, make_args
from trl_async import AsyncGRPOTrainer
from trl_async.rollout.cores import GENERATOR, TRAINER, CoreLending
from trl_async.rollout.placement import choose_placement, thread_budget
from trl_async.rollout.queue import StalenessBoundedQueue
from trl_async.toy import make_arithmetic_dataset, tiny_model_path


class _ThreadsSeen(torch.autograd.Function):
    """Identity that records the torch thread count in forward and in backward."""

    @staticmethod
    def forward(ctx, x, record):
        ctx.record = record
        record.append(("forward", torch.get_num_threads()))
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.record.append(("backward", torch.get_num_threads()))
        return grad, None


class _Layer(torch.nn.Module):
    def __init__(self, record):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.record = record

    def forward(self, x):
        return _ThreadsSeen.apply(self.linear(x), self.record)


class _Stack(torch.nn.Module):
    def __init__(self, record):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer(record) for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _set_flag(lending, side, waiting):
    lending.set_waiting(side, waiting)


def _flag_from_another_process(lending, side, waiting):
    child = multiprocessing.get_context("spawn").Process(target=_set_flag, args=(lending, side, waiting))
    child.start()
    child.join(60)
    assert child.exitcode == 0


def test_the_trainer_computes_on_every_core_exactly_while_the_generator_waits():
    """The generator's flag, written by a real second process through shared memory, decides the trainer's thread
    count before every layer's forward and before every layer's backward."""
    threads_before = torch.get_num_threads()
    record = []
    model = _Stack(record)
    lending = CoreLending(multiprocessing.get_context("spawn"), cores=2, trainer_threads=1, generator_threads=1)
    handles = lending.attach(model, TRAINER)
    try:
        # The flag changes between the forward and the backward: each phase follows the flag of its time.
        for waiting_in_forward, waiting_in_backward in ((True, False), (False, True), (True, True), (False, False)):
            _flag_from_another_process(lending, GENERATOR, waiting_in_forward)
            record.clear()
            loss = model(torch.randn(4, 8, requires_grad=True)).sum()
            _flag_from_another_process(lending, GENERATOR, waiting_in_backward)
            loss.backward()
            expected = [("forward", 2 if waiting_in_forward else 1)] * 3
            expected += [("backward", 2 if waiting_in_backward else 1)] * 3
            assert record == expected, (waiting_in_forward, waiting_in_backward)
        # The trainer waiting does not give the trainer more threads.
        _flag_from_another_process(lending, GENERATOR, False)
        lending.set_waiting(TRAINER, True)
        record.clear()
        model(torch.randn(4, 8, requires_grad=True)).sum().backward()
        assert all(threads == 1 for _, threads in record)
        assert lending.threads_for(GENERATOR) == 2  # but the generator may use every core
    finally:
        for handle in handles:
            handle.remove()
        torch.set_num_threads(threads_before)
    assert lending.lent_calls > 0 and lending.calls > lending.lent_calls


def test_the_queue_reports_idleness_only_while_a_side_blocks():
    """`on_idle(True)` when the consumer starts to block on an empty queue, `on_idle(False)` before it reads the
    item; a consumer served at once is never idle. Same for a producer held at the gate."""
    queue = StalenessBoundedQueue(max_staleness=0, capacity=1, start_index=0)
    try:
        queue.publish(0)
        calls = []
        index, _ = queue.reserve(timeout=30, on_idle=calls.append)
        assert calls == []  # the gate was open
        threading.Timer(0.3, queue.put, args=(index, 0, "item")).start()
        item = queue.get(0, timeout=30, on_idle=calls.append)
        assert item.payload == "item" and calls == [True, False]
        calls.clear()
        # The producer may generate item 1 only with weights of version 1 (max_staleness 0): it blocks until then.
        threading.Timer(0.3, queue.publish, args=(1,)).start()
        index, min_version = queue.reserve(timeout=30, on_idle=calls.append)
        assert (index, min_version) == (1, 1) and calls == [True, False]
    finally:
        queue.close()
        queue.cleanup()


# ----------------------------------------------------------------------------------------------- thread budget
def test_the_thread_budget_comes_from_omp_then_an_explicit_torch_count_then_the_cores():
    assert thread_budget("2", torch_threads=2, cores=2) == (2, "OMP_NUM_THREADS=2")
    assert thread_budget(" 3 ", torch_threads=8, cores=2) == (3, "OMP_NUM_THREADS=3")  # the user's, even above cores
    assert thread_budget("1", torch_threads=1, cores=4) == (1, "OMP_NUM_THREADS=1")
    # torch.set_num_threads(n) below the rank's cores (torch's own default never is).
    assert thread_budget(None, torch_threads=3, cores=8) == (3, "torch.set_num_threads(3)")
    assert thread_budget("", torch_threads=1, cores=2) == (1, "torch.set_num_threads(1)")
    assert thread_budget("0", torch_threads=2, cores=4) == (2, "torch.set_num_threads(2)")  # not a budget: ignored
    assert thread_budget("two", torch_threads=4, cores=4) == (4, "4 cores for this rank")
    assert thread_budget(None, torch_threads=16, cores=16) == (16, "16 cores for this rank")


@pytest.mark.parametrize(
    "omp, torch_threads, cores, generation_num_threads, expected",
    [
        # (generator, trainer): the two add up to the budget, the generator taking half (at least 1)
        ("2", 2, 2, None, (1, 2 - 1)),
        ("3", 3, 2, None, (1, 3 - 1)),
        ("4", 4, 2, None, (2, 4 - 2)),
        ("8", 8, 16, None, (4, 8 - 4)),
        (None, 2, 2, None, (1, 2 - 1)),  # no settings: the rank's cores, as before
        (None, 16, 16, None, (8, 16 - 8)),
        (None, 3, 8, None, (1, 3 - 1)),  # torch.set_num_threads(3) on 8 cores
        ("6", 6, 8, 4, (4, 6 - 4)),  # generation_num_threads overrides the generator's share
    ],
)
def test_the_generator_and_the_trainer_split_the_budget(omp, torch_threads, cores, generation_num_threads, expected):
    placement = choose_placement(
        None,
        torch.device("cpu"),
        generation_num_threads,
        cores,
        omp,
        lend_idle_cores=True,
        torch_threads=torch_threads,
    )
    assert (placement.generator_threads, placement.trainer_threads) == expected
    budget = sum(expected)
    assert placement.budget == budget and placement.note is None
    assert placement.lend_cores and placement.cores == budget  # a waiting process lends its share: never more in all


def test_a_budget_of_one_runs_one_thread_each_and_says_so():
    on_two_cores = choose_placement(None, torch.device("cpu"), None, 2, "1", lend_idle_cores=True, torch_threads=1)
    assert (on_two_cores.generator_threads, on_two_cores.trainer_threads) == (1, 1)
    assert not on_two_cores.lend_cores
    assert "thread budget is 1 (OMP_NUM_THREADS=1)" in on_two_cores.note and "in parallel" in on_two_cores.note
    on_one_core = choose_placement(None, torch.device("cpu"), None, 1, None, lend_idle_cores=True, torch_threads=1)
    assert (on_one_core.generator_threads, on_one_core.trainer_threads) == (1, 1)
    assert "time-share this rank's one core" in on_one_core.note


def test_generation_num_threads_beyond_the_budget_leaves_the_trainer_one_thread_and_says_so():
    placement = choose_placement(None, torch.device("cpu"), 3, 2, "2", lend_idle_cores=True, torch_threads=2)
    assert (placement.generator_threads, placement.trainer_threads) == (3, 1)
    assert "generation_num_threads=3 leaves no thread of this rank's budget of 2" in placement.note
    assert not placement.lend_cores


def test_a_generator_on_an_accelerator_leaves_the_trainers_threads_alone():
    placement = choose_placement("cuda:1", torch.device("cpu"), None, 8, "4", torch_threads=4)
    assert (placement.generator_threads, placement.trainer_threads) == (1, None)
    on_cpu_beside_a_gpu_trainer = choose_placement("cpu", torch.device("cuda:0"), None, 8, "2", torch_threads=2)
    assert on_cpu_beside_a_gpu_trainer.trainer_threads is None


@pytest.mark.parametrize("budget", [3, 1])
def test_the_generation_process_and_the_trainer_share_omp_num_threads(tmp_path, budget):
    """Real runs with OMP_NUM_THREADS=3: the generation process scores rewards on 1 thread and the trainer computes its
    loss on 2, not 1 + 3 as when the generator's threads were added to the user's budget. With OMP_NUM_THREADS=1, one
    thread each, and a log line that says so."""
    script = os.path.join(os.path.dirname(__file__), "scripts", "thread_budget_run.py")
    out = tmp_path / "threads.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(budget), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, script, str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(out.read_text())
    generator = {tuple(r) for r in seen["rewards"]}
    assert len(generator) == 1 and next(iter(generator))[0] != seen["trainer_pid"]  # all from one other process
    generator_threads = next(iter(generator))[1]
    if budget == 3:
        assert set(seen["trainer_threads"]) == {2} and generator_threads == 1
        assert "thread budget is 1" not in proc.stderr
    else:
        assert set(seen["trainer_threads"]) == {1} and generator_threads == 1
        assert "this rank's thread budget is 1 (OMP_NUM_THREADS=1)" in proc.stderr


def test_placement_lends_only_where_the_cores_are_split():
    cpu = torch.device("cpu")
    assert choose_placement(None, cpu, None, 2, None, lend_idle_cores=True).lend_cores
    assert not choose_placement(None, cpu, None, 2, None, lend_idle_cores=False).lend_cores
    assert not choose_placement(None, cpu, None, 2, "1", lend_idle_cores=True).lend_cores  # the user's OMP_NUM_THREADS
    assert not choose_placement(None, cpu, None, 1, None, lend_idle_cores=True).lend_cores  # one core: nothing to lend
    assert not choose_placement("cuda:1", cpu, None, 2, None, lend_idle_cores=True).lend_cores


class _ThreadCountObserver(AsyncGRPOTrainer):
    """Reads torch's thread count where the trainer's layers run: before the model's forward and each decoder layer's
    forward and backward, right after core lending's own hooks (attached when the rollout starts; hooks run in the
    order they were registered). Records (optimizer step, threads) per pass."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.passes: list[tuple[int, int]] = []
        self._observing = False

    def _record(self, *args):
        self.passes.append((self.state.global_step, torch.get_num_threads()))

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)  # the rollout (and lending) starts in the first call
        if not self._observing:
            self._observing = True
            model = self._unwrap(self.model)

            def after_layer(module, args, output):
                tensor = output[0] if isinstance(output, (tuple, list)) else output
                if tensor.requires_grad:
                    tensor.register_hook(self._record)

            model.register_forward_pre_hook(self._record)
            for layer in model.model.layers:
                layer.register_forward_pre_hook(self._record)
                layer.register_forward_hook(after_layer)
        return output


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="lending needs two cores")
def test_async_training_lends_cores_and_restores_the_thread_count(tmp_path, monkeypatch, request):
    """No thread settings (as a user runs it): the trainer and its generation process lend each other the cores. The
    logged share of the trainer's layer passes that ran on every core equals, step by step, the share of passes this
    test saw run on every core (torch's own thread count, read at each pass); the trainer otherwise ran on its share
    of the split. `train()` leaves torch's thread count as it found it."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    threads_at_start = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)))  # torch's default without settings: every core
    request.addfinalizer(lambda: torch.set_num_threads(threads_at_start))
    cores = len(os.sched_getaffinity(0))
    trainer_share = cores - max(1, cores // 2)  # the generator gets half the cores by default, the trainer the rest
    dataset = make_arithmetic_dataset(num_train=256, num_test=4, seed=0)["train"]
    # max_staleness=0: the generator may make batch n+1 only with the weights the step on batch n publishes, so it
    # waits at the gate through every training step (it sets its flag as it blocks, just after queueing batch n).
    args = make_args(tmp_path, max_steps=12, max_staleness=0, trainer_generates_while_starting=False)
    trainer = _ThreadCountObserver(
        model=tiny_model_path(), reward_funcs=answer_reward, args=args, train_dataset=dataset,
        processing_class=load_tokenizer(),
    )  # fmt: skip
    threads_before = torch.get_num_threads()
    trainer.train()
    logged = {
        h["step"]: h["async/trainer_lent_cores_fraction"]
        for h in trainer.state.log_history
        if "async/staleness_mean" in h
    }
    assert sorted(logged) == list(range(1, 13))
    assert {threads for _, threads in trainer.passes} <= {trainer_share, cores}
    for step, fraction in logged.items():
        seen = [threads for version, threads in trainer.passes if version == step - 1]
        assert seen, step
        assert fraction == pytest.approx(sum(t == cores for t in seen) / len(seen), abs=1e-12), step
    assert any(threads == cores for _, threads in trainer.passes), "the generator never waited: nothing was lent"
    assert torch.get_num_threads() == threads_before
