"""The generation process: a real OS process per training rank, started, placed and stopped by the trainer.

`RolloutProducer` makes one generation batch: it takes that batch's rows from the prompt stream, tokenizes the prompts
as TRL does, samples completions with behaviour log-probs, scores them with the reward callables (tensor-native ones
on the ids, without decoding; text ones after one decode) and returns the payload the trainer consumes. The generation
process runs it in a loop (`_generator_main`); the trainer runs the very same code on its own model for the first
batches of a run, while the generation process is still starting (see `trl_async.rollout.pipeline`).

The generation process is seeded per batch from (`seed`, its process index, the batch's position in the stream), as
TRL seeds ranks: a batch is a function of the weights, the prompts and that seed, wherever it is generated.

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
import hashlib
import multiprocessing
import multiprocessing.spawn as mp_spawn
import os
import signal
import sys
import threading
import time
import traceback
from collections import defaultdict
from typing import Any

import cloudpickle
import torch
import torch.multiprocessing as torch_mp

from ..timeline import current as timeline
from ..timeline import generator_recorder, set_current
from ..timeline import names as span
from ..timeline.setup import TimelineSpec
from .backends import BackendContext, GenerationOutput, ModelSpec, make_backend
from .cores import GENERATOR, CoreLending
from .payload import RolloutPayload
from .prompts import STREAM_SETTINGS, PromptStream, check_prompt_ids, check_prompt_values, context_length
from .queue import QueueClosed, StalenessBoundedQueue
from .weights import SharedWeightStore

_DISTRIBUTED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


class GeneratorError(RuntimeError):
    """The generation process failed; the message carries its traceback or exit status."""


def batch_seed(seed: int, process_index: int, stream_index: int) -> int:
    """The sampling seed of one generation batch: distinct per rank and per batch, reproducible from `seed`."""
    digest = hashlib.blake2b(f"{seed}/{process_index}/{stream_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclasses.dataclass
class GeneratorSpec:
    """Everything a producer needs besides the model and the shared-memory objects. Serialized with cloudpickle, so
    reward functions defined in the user's script travel by value, whether it runs as `__main__` or, in a spawned
    worker, as `__mp_main__` (`_script_pickled_by_value`)."""

    process_index: int
    num_processes: int
    device: str
    num_threads: int
    backend: str
    model_spec: ModelSpec
    generation_config: Any
    temperature: float
    eos_token_ids: list[int]
    pad_token_id: int
    processing_class: Any
    chat_template: str | None
    chat_template_kwargs: dict
    dataset: Any
    num_generations: int
    generation_batch_size: int
    shuffle: bool
    seed: int
    reward_funcs: list  # reward callables; `None` where the trainer scores the function (reward models)
    reward_func_names: list[str]
    decode: bool  # decode even when no text reward needs it (completion logging, reward models)
    parent_pid: int
    stream_offset: int = 0  # position of queue item 0 in the prompt stream (a resumed run starts later)
    inflight_weight_updates: bool = False  # load newer weights between decoding steps (`_produce_inflight`)
    timeline: TimelineSpec | None = None  # where this process records its timeline (None: `timeline=False`)
    columns: list[str] | None = None  # dataset columns to keep (None: all)
    backend_options: dict = dataclasses.field(default_factory=dict)


def is_conversational_prompt(prompt) -> bool:
    """`trl.data_utils.is_conversational({"prompt": prompt})` (a list of messages with roles), without importing TRL
    in the generation process; `tests/test_prompts.py` checks that both agree."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


class RolloutProducer:
    """Makes generation batches: prompts from the stream → completions, μ, rewards (the child and the trainer)."""

    def __init__(self, spec: GeneratorSpec, generate, trainer_state=None):
        self.spec = spec
        self.generate = generate  # (prompt_ids, seed) -> GenerationOutput
        self.tokenizer = spec.processing_class
        self.trainer_state = trainer_state  # () -> TrainerState snapshot or None
        self.stream = PromptStream(spec.dataset, **{name: getattr(spec, name) for name in STREAM_SETTINGS})

    def _tokenize(self, prompts: list) -> list[list[int]]:
        # TRL's `GRPOTrainer._tokenize_prompts`, text-only path (no tools: tools are refused with async generation).
        if is_conversational_prompt(prompts[0]):
            return list(
                self.tokenizer.apply_chat_template(
                    conversation=prompts,
                    chat_template=self.spec.chat_template,
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=True,
                    **self.spec.chat_template_kwargs,
                )["input_ids"]
            )
        return list(self.tokenizer(text=prompts)["input_ids"])

    def _decode(self, prompt_ids: list[list[int]], completion_ids: list[list[int]], conversational: bool) -> list:
        # TRL's `GRPOTrainer._generate` decoding: `parse_response` where the tokenizer defines a response format.
        if conversational:
            if getattr(self.tokenizer, "response_template", None) is not None or (
                getattr(self.tokenizer, "response_schema", None) is not None
            ):
                from trl.chat_template_utils import parse_response

                return [
                    [parse_response(self.tokenizer, ids, prefix=prompt_ids[i], tools=None)]
                    for i, ids in enumerate(completion_ids)
                ]
            texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
            return [[{"role": "assistant", "content": text}] for text in texts]
        return self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)

    def prepare_rewards_for_dataset(self, max_rows: int = 50_000) -> None:
        """Prepare the tensor-native rewards' tokenizer-dependent tables (gold answers' token spellings) for the whole
        dataset at start-up, so that no tokenizer runs at reward time; datasets that are large or iterable are
        prepared batch by batch instead (see `produce`)."""
        import datasets

        from trl_async.rewards import prepare_rewards

        dataset = self.spec.dataset
        if isinstance(dataset, datasets.Dataset) and len(dataset) <= max_rows:
            names = [c for c in dataset.column_names if c not in ("prompt", "completion", "completion_ids")]
            if names:
                prepare_rewards([f for f in self.spec.reward_funcs if f is not None], {c: dataset[c] for c in names})

    def produce(self, queue_index: int, ready=None) -> RolloutPayload:
        """The payload of queue item `queue_index` (stream position `stream_offset + queue_index`). `ready()`, if
        given, runs once the batch is prepared, before its first token is sampled (`GenerationBackend.generate`)."""
        from trl_async.rewards import prepare_rewards, score_completions

        spec = self.spec
        stream_index = spec.stream_offset + queue_index
        rows = self.stream.rows(stream_index)
        prompts = [row["prompt"] for row in rows]
        check_prompt_values(prompts, first_row=None)
        conversational = is_conversational_prompt(prompts[0])
        columns = {k: [row[k] for row in rows] for k in rows[0] if k not in ("prompt", "completion", "completion_ids")}
        callables = [f for f in spec.reward_funcs if f is not None]
        t0 = time.perf_counter()
        recorder, prepared = timeline(), timeline().begin()
        # Gold answers not prepared at start-up are prepared now, before sampling: the tokenizer never runs at reward
        # time (a no-op for rows already prepared).
        prepare_rewards(callables, columns)
        prompt_ids = [list(p) for p in self._tokenize(prompts)]
        check_prompt_ids(prompt_ids, context_length(spec.model_spec.config), prompts=prompts)
        seed = batch_seed(spec.seed, spec.process_index, stream_index)
        recorder.end(span.TOKENIZE, prepared)
        generated: GenerationOutput = (
            self.generate(prompt_ids, seed) if ready is None else self.generate(prompt_ids, seed, ready)
        )
        completion_ids, logprobs = generated.to_lists()
        t1 = time.perf_counter()
        scoring = recorder.begin()
        decode = _DecodeOnce(lambda: self._decode(prompt_ids, completion_ids, conversational))
        extra_logs: dict[str, list] = defaultdict(list)
        logged_metrics: dict[str, list] = defaultdict(list)
        rewards = torch.full((len(rows), len(spec.reward_funcs)), float("nan"))
        if callables:
            scored = score_completions(
                callables,
                generated.completion_ids,
                generated.completion_mask,
                columns,
                prompts=prompts,
                decode=decode,
                reward_func_names=[n for f, n in zip(spec.reward_funcs, spec.reward_func_names, strict=True) if f],
                extra_kwargs={
                    "trainer_state": self.trainer_state() if self.trainer_state is not None else None,
                    "log_extra": lambda column, values: extra_logs[column].extend(values),
                    "log_metric": lambda name, value: logged_metrics[name].append(value),
                },
            ).cpu()
            positions = [i for i, f in enumerate(spec.reward_funcs) if f is not None]
            rewards[:, positions] = scored
        if spec.decode:
            decode()
        t2 = time.perf_counter()
        recorder.end(span.REWARDS, scoring)
        return RolloutPayload(
            rows=rows,
            stream_index=stream_index,
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            logprobs=logprobs,
            rewards_per_func=rewards,
            completions=decode.result,
            extra_logs=dict(extra_logs),
            logged_metrics=dict(logged_metrics),
            generate_s=t1 - t0,
            reward_s=t2 - t1,
            token_versions=generated.token_version_lists(),
        )


class _DecodeOnce:
    """Decodes a batch on first call only; text rewards share the result, tensor rewards never trigger it."""

    def __init__(self, decode):
        self._decode, self.result = decode, None

    def __call__(self):
        if self.result is None:
            self.result = self._decode()
        return self.result


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


def _produce_gated(rollout_queue, trainable_store, backend, producer, beat_or_stop, on_idle) -> None:
    """One batch, gated before it starts: weights recent enough for the queue's bound, loaded, then the whole batch
    sampled with them (its version)."""
    recorder = timeline()
    waited = recorder.begin()
    index, min_version = rollout_queue.reserve(on_wait=beat_or_stop, on_idle=on_idle)
    _wait_for_weights(trainable_store, min_version, beat_or_stop, on_idle)
    recorder.end(span.GATE_WAIT, waited, span.WAIT)
    version = backend.update_weights()
    recorder.set_step(version)  # this batch is generated with the weights of step `version`
    rollout_queue.mark_loaded(index)
    payload = producer.produce(index)
    with recorder.span(span.WRITE_BATCH):
        rollout_queue.put(index, version, payload, num_rows=payload.num_rows)


def _produce_inflight(rollout_queue, trainable_store, backend, producer, beat_or_stop, on_idle) -> None:
    """One batch with in-flight weight updates: reserved as soon as the queue has room (its prompts drawn, tokenized
    and its rewards prepared meanwhile), gated before the model first runs on it (the oldest token defines the
    batch's staleness), then decoded on the newest published weights, which the backend loads between decoding
    steps."""
    recorder = timeline()
    waited = recorder.begin()
    index, min_version = rollout_queue.reserve(on_wait=beat_or_stop, on_idle=on_idle, wait_for_weights=False)
    recorder.end(span.GATE_WAIT, waited, span.WAIT)

    def ready():
        waited = recorder.begin()
        _wait_for_weights(trainable_store, min_version, beat_or_stop, on_idle)
        recorder.end(span.GATE_WAIT, waited, span.WAIT)
        recorder.set_step(backend.update_weights())

    payload = producer.produce(index, ready=ready)
    version = payload.oldest_version
    with recorder.span(span.WRITE_BATCH):
        rollout_queue.put(index, backend.version if version is None else version, payload, num_rows=payload.num_rows)


def _generator_main(
    spec_blob: bytes, rollout_queue, frozen_store, trainable_store, control: _Control, lending: CoreLending | None
) -> None:
    backend = None
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
        producer = RolloutProducer(spec, backend.generate, trainer_state=_trainer_state_reader(state_path))
        producer.prepare_rewards_for_dataset()  # while the trainer produces the first batches itself
        control.beat()
        control.set_ready()
        recorder.instant(span.READY)
        if spec.timeline is not None and spec.timeline.spawn_ns is not None:
            recorder.add(span.STARTUP_SPAN, spec.timeline.spawn_ns, recorder.begin(), span.STARTUP)
        produce = _produce_inflight if spec.inflight_weight_updates else _produce_gated
        first = True
        while not control.stop_requested:
            produce(rollout_queue, trainable_store, backend, producer, beat_or_stop, on_idle)
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


def warm_up_generator_start(start_method: str | None = None) -> None:
    """Start the fork server now, with `PRELOAD_MODULES` imported in it, so that the generation process, forked from
    it later (at the first training batch), starts with its imports done: its cold start drops from seconds to the
    model build. Called when the trainer is constructed, where the trainer's own set-up leaves a core idle. A clean
    interpreter, never the trainer's, is what gets forked (no OpenMP or CUDA state in it). No-op for 'spawn'."""
    if (start_method or default_start_method()) != "forkserver":
        return
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload(list(PRELOAD_MODULES))
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
