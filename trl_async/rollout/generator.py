"""The generation process: a real OS process per training rank, started, placed and stopped by the trainer.

Child side (`_generator_main`): builds its backend (its own copy of the policy, whose weights come through shared
memory) and a `RolloutProducer` (`rollout.producer`: one generation batch, from the prompt stream to the payload), then
makes batches in a loop, each gated by the queue's staleness bound (`_produce_gated`, `_produce_inflight`).

Trainer side (`GenerationProcess`): starts the child without re-running the user's `__main__` (so scripts without an
`if __name__ == "__main__"` guard still work), and checks its health: a traceback it reported, an exit (SIGKILL
included), or no heartbeat for `heartbeat_timeout`. Nothing is shared with the child that the child could leave held:
control flags and counters are single-writer shared integers, errors travel as files. The child watches its parent
and exits if the parent is gone, so it never outlives the trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import multiprocessing
import multiprocessing.spawn as mp_spawn
import os
import signal
import sys
import threading
import time
import traceback

import cloudpickle
import torch
import torch.multiprocessing as torch_mp

from ..timeline import current as timeline
from ..timeline import generator_recorder, set_current
from ..timeline import names as span
from .backends import BackendContext, make_backend
from .cores import GENERATOR, CoreLending
from .producer import GeneratorSpec, RolloutProducer, batch_seed, is_conversational_prompt
from .queue import QueueClosed, StalenessBoundedQueue
from .weights import SharedWeightStore

_DISTRIBUTED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


class GeneratorError(RuntimeError):
    """The generation process failed; the message carries its traceback or exit status."""


# Defined with the producer (`rollout.producer`); importable from here as before.
__all__ = ["GenerationProcess", "GeneratorError", "GeneratorSpec", "RolloutProducer", "batch_seed",
           "is_conversational_prompt", "warm_up_generator_start"]  # fmt: skip


# ------------------------------------------------------------------------------------------------------ control
_CONTROL_FIELDS = ("ready", "stop", "heartbeat")  # ready, heartbeat: written by the child; stop: by the trainer


class _Control:
    """Single-writer shared flags between the trainer and its generator (no locks: see the module docstring)."""

    def __init__(self, ctx, error_path: str):
        self._array = ctx.RawArray("d", len(_CONTROL_FIELDS))
        self._array[2] = time.time()
        self.error_path = error_path

    ready = property(lambda self: bool(self._array[0]))
    stop_requested = property(lambda self: bool(self._array[1]))
    heartbeat = property(lambda self: self._array[2])

    def set_ready(self):
        self._array[0] = 1.0

    def request_stop(self):
        self._array[1] = 1.0

    def beat(self):
        self._array[2] = time.time()

    def report_error(self, text: str) -> None:
        temporary = f"{self.error_path}.{os.getpid()}.tmp"
        with open(temporary, "w") as f:
            f.write(text)
        os.rename(temporary, self.error_path)

    def read_error(self) -> str | None:
        try:
            with open(self.error_path) as f:
                return f.read()
        except FileNotFoundError:
            return None


# ------------------------------------------------------------------------------------------------------ child side
def error_report(error: BaseException) -> str:
    """What the child reports to the trainer: its exception's first line (`ValueError: ...`, which names the setting
    and says what to do) with its notes (a raising reward function's name), then the traceback.
    `GenerationProcess.check_health` raises it as the first line of `GeneratorError`."""
    lines = str(error).strip().splitlines()
    summary = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    notes = " ".join(str(note) for note in getattr(error, "__notes__", None) or [])
    return f"{summary}{f' ({notes})' if notes else ''}\n{traceback.format_exc()}"


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the kernel kills us when the parent dies

    # Forked from a fork server, the OS parent is that server, not the trainer, and the server outlives the trainer
    # for as long as this process does (it holds the server's "alive" pipe): exit when re-parented, or when the
    # trainer is gone. Dead counts as gone before it is reaped: a killed trainer stays a zombie until its own parent
    # waits for it, and a parent that reads the trainer's output (`subprocess.run(capture_output=True)`) waits for
    # the end of that output first, which this process, holding the same pipes, would otherwise hold back forever.
    os_parent = os.getppid()

    def trainer_gone() -> bool:
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return _is_zombie(parent_pid)

    def watch():
        while True:
            if os.getppid() != os_parent or trainer_gone():
                os._exit(0)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True, name="trl-async-parent-watch").start()


def _is_zombie(pid: int) -> bool:
    """Whether `pid` has exited and waits to be reaped (Linux's /proc; False where it cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def _trainer_state_reader(path: str):
    """Reads the trainer-state snapshot the trainer publishes with each weights version (see RolloutPipeline)."""
    from transformers import TrainerState

    cache = {"mtime": None, "state": None}

    def read():
        try:
            mtime = os.stat(path).st_mtime_ns
        except FileNotFoundError:
            return None
        if mtime != cache["mtime"]:
            cache["state"], cache["mtime"] = TrainerState.load_from_json(path), mtime
        return cache["state"]

    return read


def _wait_for_weights(trainable_store, min_version: int, beat_or_stop, on_idle) -> None:
    """Wait until weights of `min_version` or newer are published, lending this process's cores meanwhile."""
    if trainable_store.version >= min_version:
        return
    if on_idle is not None:
        on_idle(True)
    try:
        trainable_store.wait_for_version(min_version, on_wait=beat_or_stop)
    finally:
        if on_idle is not None:
            on_idle(False)


def _produce_gated(rollout_queue, trainable_store, backend, producer, beat_or_stop, on_idle, items_per_decode=1):
    """One block of up to `items_per_decode` batches, gated before it starts: weights recent enough for the queue's
    bound on every batch of the block, loaded, then the whole block sampled with them in one decode (their version),
    and handed out batch by batch."""
    recorder = timeline()
    waited = recorder.begin()
    first, count, min_version = rollout_queue.reserve_block(items_per_decode, on_wait=beat_or_stop, on_idle=on_idle)
    _wait_for_weights(trainable_store, min_version, beat_or_stop, on_idle)
    recorder.end(span.GATE_WAIT, waited, span.WAIT)
    version = backend.update_weights()
    recorder.set_step(version)  # this block is generated with the weights of step `version`
    rollout_queue.mark_loaded(first + count - 1)
    payloads = producer.produce_block(first, count)
    with recorder.span(span.WRITE_BATCH):
        for offset, payload in enumerate(payloads):
            payload.decode_fallbacks = backend.compile_fallbacks
            rollout_queue.put(first + offset, version, payload, num_rows=payload.num_rows)


def _produce_inflight(rollout_queue, trainable_store, backend, producer, beat_or_stop, on_idle, items_per_decode=1):
    """One block with in-flight weight updates: reserved as soon as the queue has room (its prompts drawn, tokenized
    and its rewards prepared meanwhile), gated before the model first runs on it (the oldest token defines each
    batch's staleness), then decoded on the newest published weights, which the backend loads between decoding
    steps."""
    recorder = timeline()
    waited = recorder.begin()
    first, count, min_version = rollout_queue.reserve_block(
        items_per_decode, on_wait=beat_or_stop, on_idle=on_idle, wait_for_weights=False
    )
    recorder.end(span.GATE_WAIT, waited, span.WAIT)

    def ready():
        waited = recorder.begin()
        _wait_for_weights(trainable_store, min_version, beat_or_stop, on_idle)
        recorder.end(span.GATE_WAIT, waited, span.WAIT)
        recorder.set_step(backend.update_weights())

    payloads = producer.produce_block(first, count, ready=ready)
    with recorder.span(span.WRITE_BATCH):
        for offset, payload in enumerate(payloads):
            payload.decode_fallbacks = backend.compile_fallbacks
            version = payload.oldest_version
            rollout_queue.put(
                first + offset, backend.version if version is None else version, payload, num_rows=payload.num_rows
            )


def _stop_on_late_call(control: _Control, message: str) -> None:
    """A tool or environment call ran past `tool_timeout` (`agentic.CallWatchdog`, on its watch thread): report it as
    the error the trainer raises, then end this process, which ends the call (a hung call cannot be interrupted)."""
    from .agentic import ToolTimeoutError

    control.report_error(f"{ToolTimeoutError.__name__}: {message}\n(the call was still running: no traceback)")
    with contextlib.suppress(Exception):
        timeline().close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _generator_main(
    spec_blob: bytes, rollout_queue, frozen_store, trainable_store, control: _Control, lending: CoreLending | None
) -> None:
    backend = producer = None
    exit_code = 0
    try:
        for name in _DISTRIBUTED_ENV:  # the child is not a member of the trainer's process group
            os.environ.pop(name, None)
        spec: GeneratorSpec = cloudpickle.loads(spec_blob)
        _die_with_parent(spec.parent_pid)
        torch.set_num_threads(spec.num_threads)
        recorder = generator_recorder(spec.timeline, spec.process_index, spec.num_processes, cores=spec.num_threads)
        set_current(recorder)  # the backend and the producer record into it
        recorder.instant(span.IMPORTS_DONE)

        def beat_or_stop():
            control.beat()
            if control.stop_requested:
                raise QueueClosed("stop requested")

        if frozen_store is not None and frozen_store.version < 0:
            # The trainer publishes the frozen weights on a thread beside its first steps (`_publish_frozen`).
            waited = recorder.begin()
            frozen_store.wait_for_version(0, on_wait=beat_or_stop)
            recorder.end(span.WAIT_FOR_START_WEIGHTS, waited, span.WAIT)
        # The spec carries the context's model and sampling fields under the same names; the stores and the heartbeat
        # are this process's.
        shared = {f.name: getattr(spec, f.name) for f in dataclasses.fields(BackendContext) if hasattr(spec, f.name)}
        context = BackendContext(
            frozen_store=frozen_store, trainable_store=trainable_store, heartbeat=control.beat, **shared
        )
        backend = make_backend(spec.backend, context, **spec.backend_options)
        backend.load()
        recorder.instant(span.MODEL_BUILT)
        on_idle = None
        if lending is not None and isinstance(getattr(backend, "model", None), torch.nn.Module):
            lending.attach(backend.model, GENERATOR)  # every decoding step re-reads the trainer's flag
            on_idle = functools.partial(lending.set_waiting, GENERATOR)
        state_path = os.path.join(rollout_queue.spool_dir, "trainer_state.json")
        producer = RolloutProducer(
            spec,
            backend.generate_batches,
            trainer_state=_trainer_state_reader(state_path),
            heartbeat=control.beat,
            on_late=functools.partial(_stop_on_late_call, control),
        )
        producer.prepare_rewards_for_dataset()  # while the trainer produces the first batches itself
        backend.warm_up(producer.sample_prompt_ids)  # CUDA graphs captured before ready (the trainer is not waiting)
        control.beat()
        control.set_ready()
        recorder.instant(span.READY)
        if spec.timeline is not None and spec.timeline.spawn_ns is not None:
            recorder.add(span.STARTUP_SPAN, spec.timeline.spawn_ns, recorder.begin(), span.STARTUP)
        produce = _produce_inflight if spec.inflight_weight_updates else _produce_gated
        first = True
        while not control.stop_requested:
            produce(rollout_queue, trainable_store, backend, producer, beat_or_stop, on_idle, spec.items_per_decode)
            if first:
                recorder.instant(span.FIRST_BATCH_QUEUED)
                first = False
            recorder.maybe_flush()
            control.beat()
    except QueueClosed:
        pass
    except BaseException as error:
        control.report_error(error_report(error))
        exit_code = 1
    finally:
        if producer is not None:
            with contextlib.suppress(Exception):
                producer.close()
        if backend is not None:
            with contextlib.suppress(Exception):
                backend.close()
        with contextlib.suppress(Exception):
            timeline().close()  # this process's spans to its fragment (the trainer merges them)
    # Exit without the interpreter's finalization: tearing down torch and transformers takes about a second that the
    # trainer would spend waiting in `close()` at the end of `train()`. Everything the child owns that must be released
    # was released above; the queue's spool and the weight stores belong to the trainer.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


# ---------------------------------------------------------------------------------------------------- trainer side
# What a generation process imports before it can build a model: about 3.5 s of torch, transformers' modeling and
# generation stacks and this package, measured on the development machine, most of a cold start.
PRELOAD_MODULES = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.generation.utils",
    "datasets",
    "trl_async.rollout.generator",
)


def default_start_method() -> str:
    """'forkserver' where the platform has it (Linux, macOS), else 'spawn'. Never 'fork': the trainer's OpenMP and
    CUDA state does not survive a fork."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


# What an agentic run's generation process imports besides (TRL's multi-turn code, `rollout.agentic`): about 4.5 s.
AGENTIC_PRELOAD_MODULES = ("trl.trainer.grpo_trainer", "trl_async.rollout.agentic")


def warm_up_generator_start(
    start_method: str | None = None, agentic: bool = False, extra_modules: tuple | list = ()
) -> None:
    """Start the fork server now, with `PRELOAD_MODULES` imported in it, so that the generation process, forked from
    it later (at the first training batch), starts with its imports done: its cold start drops from seconds to the
    model build. Called when the trainer is constructed, where the trainer's own set-up leaves a core idle. A clean
    interpreter, never the trainer's, is what gets forked (no OpenMP or CUDA state in it). No-op for 'spawn'."""
    if (start_method or default_start_method()) != "forkserver":
        return
    from multiprocessing import forkserver

    # `extra_modules`: the model's architecture (`config.refusals.modeling_modules`); a fork server skips a preload
    # that does not import.
    forkserver.set_forkserver_preload(
        list(PRELOAD_MODULES) + (list(AGENTIC_PRELOAD_MODULES) if agentic else []) + list(extra_modules)
    )
    forkserver.ensure_running()


@contextlib.contextmanager
def _spawn_without_main_module():
    """Spawned and fork-server children normally re-import the parent's `__main__`, re-running an unguarded training
    script. Our child needs nothing from it (its payload is cloudpickled by value), so leave it out."""
    original = mp_spawn.get_preparation_data

    def preparation_data(name):
        data = original(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    mp_spawn.get_preparation_data = preparation_data
    try:
        yield
    finally:
        mp_spawn.get_preparation_data = original


@contextlib.contextmanager
def _script_pickled_by_value():
    """cloudpickle sends what the user's script defines by value when the script runs as `__main__`, and by reference
    when it runs as `__mp_main__`: the name a script gets in a worker started by 'spawn' or a fork server
    (`torch.multiprocessing.spawn`, accelerate's `notebook_launcher` where it spawns). The generation process never
    imported the script under that name (`_spawn_without_main_module`), so a reference cannot be resolved there.
    Registers that module for pickling by value while the block runs (unless the user registered it already)."""
    script = sys.modules.get("__mp_main__")
    # Where no worker re-ran a script, multiprocessing makes `__mp_main__` another name of `__main__` itself.
    is_script = getattr(script, "__name__", None) == "__mp_main__"
    if not is_script or "__mp_main__" in cloudpickle.list_registry_pickle_by_value():
        yield
        return
    cloudpickle.register_pickle_by_value(script)
    try:
        yield
    finally:
        cloudpickle.unregister_pickle_by_value(script)


class GenerationProcess:
    """Trainer-side handle of one generation process. `start()` returns at once; `ready` tells when it can serve."""

    def __init__(
        self,
        spec: GeneratorSpec,
        rollout_queue: StalenessBoundedQueue,
        frozen_store: SharedWeightStore | None,
        trainable_store: SharedWeightStore,
        startup_timeout: float,
        heartbeat_timeout: float,
        mp_context=None,
        lending: CoreLending | None = None,
    ):
        mp_context = mp_context or default_start_method()
        self.ctx = torch_mp.get_context(mp_context) if isinstance(mp_context, str) else mp_context
        self.spec = spec
        self.queue = rollout_queue
        self.frozen_store = frozen_store
        self.trainable_store = trainable_store
        self.lending = lending  # CPU core lending between this process and the trainer (`cores`), or None
        self.startup_timeout = startup_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.control = _Control(self.ctx, os.path.join(rollout_queue.spool_dir, "generator-error.txt"))
        self.process = None
        self.started_at: float | None = None
        self._launcher: threading.Thread | None = None
        self._launch_error: BaseException | None = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def rank(self) -> str:
        """Which training process this generator serves, for errors (with several ranks, each has its own)."""
        return f"rank {self.spec.process_index}"

    @property
    def launched(self) -> bool:
        """Whether `Process.start` has returned (at once with 'spawn'; with 'forkserver', once the server forked)."""
        return self.process is not None and (self._launcher is None or not self._launcher.is_alive())

    @property
    def ready(self) -> bool:
        return self.control.ready

    def start(self) -> None:
        spec = self.spec
        if spec.timeline is not None:  # the start-up's first mark, on the clock both processes share
            spec = dataclasses.replace(
                spec, timeline=dataclasses.replace(spec.timeline, spawn_ns=time.perf_counter_ns())
            )
        with _script_pickled_by_value():
            blob = cloudpickle.dumps(spec)
        self.process = self.ctx.Process(
            target=_generator_main,
            args=(blob, self.queue, self.frozen_store, self.trainable_store, self.control, self.lending),
            name=f"trl-async-generator-{self.spec.process_index}",
            daemon=True,
        )
        self.started_at = time.time()
        if self.ctx.get_start_method() == "forkserver":
            # A fork server still importing (`warm_up_generator_start`) forks only when done, and `Process.start`
            # blocks until then: launch from a thread, so the trainer produces batches meanwhile.
            self._launcher = threading.Thread(target=self._launch, daemon=True, name="trl-async-generator-launch")
            self._launcher.start()
        else:
            self._launch()

    def _launch(self) -> None:
        try:
            with _spawn_without_main_module():
                self.process.start()
        except BaseException as error:  # reported by check_health
            self._launch_error = error

    def check_health(self) -> None:
        """Raise `GeneratorError` if the child raised, exited, stopped making progress or never became ready."""
        if self.process is None:
            return
        if self._launch_error is not None:
            raise GeneratorError(f"The generation process of {self.rank} could not be started: {self._launch_error!r}")
        if not self.launched:
            if time.time() - self.started_at > self.startup_timeout:
                raise GeneratorError(
                    f"The generation process of {self.rank} was not started within generator_startup_timeout="
                    f"{self.startup_timeout:.0f}s (the fork server did not fork it)."
                )
            return
        error = self.control.read_error()
        if error is None and not self.process.is_alive():
            deadline = time.time() + 2.0  # a traceback may be on its way (the child reports, then exits)
            while error is None and time.time() < deadline:
                time.sleep(0.05)
                error = self.control.read_error()
            if error is None:
                raise GeneratorError(
                    f"The generation process of {self.rank} (pid {self.pid}) exited with code {self.process.exitcode} "
                    "without reporting an error (killed by a signal or by the OS, e.g. out of memory?)."
                )
        if error is not None:  # the child's own message first: it says what to do
            summary, _, details = error.partition("\n")
            raise GeneratorError(
                f"{summary}\n(raised in the generation process of {self.rank}, pid {self.pid})\n{details}"
            )
        now = time.time()
        if not self.ready:
            if now - self.started_at > self.startup_timeout:
                raise GeneratorError(
                    f"The generation process of {self.rank} (pid {self.pid}) did not become ready within "
                    f"generator_startup_timeout={self.startup_timeout:.0f}s (loading a large model? raise it)."
                )
            return
        silent_s = now - self.control.heartbeat
        if silent_s > self.heartbeat_timeout:
            raise GeneratorError(
                f"The generation process of {self.rank} (pid {self.pid}) showed no progress for {silent_s:.0f}s "
                f"(generator_heartbeat_timeout={self.heartbeat_timeout:.0f}s); it is presumed hung."
            )

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the child on every path; escalate from a polite stop to SIGTERM to SIGKILL."""
        if self.process is None:
            return
        self.control.request_stop()
        self.queue.close()
        if self._launcher is not None:
            self._launcher.join(timeout)  # a child being forked right now is stopped like any other
        if self.process._popen is None:  # never started (the launch failed or is still hanging)
            return
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
