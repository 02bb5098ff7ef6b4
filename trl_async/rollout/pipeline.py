"""The trainer's end of the rollout pipeline, shared by `AsyncGRPOTrainer` and `AsyncPPOTrainer`.

One `RolloutPipeline` per rank owns everything asynchronous generation needs on the trainer side: the shared-memory
weight stores, the staleness-bounded queue, the generation process, weight publishing, the next batch to train on,
the `async/*` figures, and the prompt stream's position for checkpoints (`trainers.checkpoints` writes and reads the
file). The trainers only call:

* `start(spec, model)` at the first training batch (the generation process boots in the background);
* `next_batch(last_use_version, model)` for each generation batch (→ `RolloutBatch`);
* `publish(model, version, state)` after optimizer steps;
* `window_metrics()` when they log; `checkpoint_state()` / `restore(state)` around checkpoints; `close()`.

**Start-up off the critical path.** Spawning the generation process, importing torch/transformers and building its
model takes seconds. Until it reports ready, the trainer produces the batches itself, with the same producer code on
its own model (so the batches are the same: same prompts, same per-batch seed), then opens the queue at the next index
and switches to it. The run never waits for a cold generator.

**Eviction across ranks.** Rows of one global batch are spread over the data-parallel ranks (TRL gathers rewards to
normalize groups across them), so the ranks must keep or drop the same items. Each rank's candidate staleness is
reduced to its maximum over ranks (one all-reduce of one integer per generation batch) and every rank acts on that.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable

import torch

from ..schedule import items_first_used_before
from ..timeline import current as timeline
from ..timeline import names as span
from .backends import generate_with_behaviour_logprobs, generation_config_for_rollouts
from .cores import TRAINER, CoreLending
from .gather import clean_parameter_name, full_placeholders, iter_full_parameters, model_sharding
from .generator import GenerationProcess, GeneratorError, GeneratorSpec, RolloutProducer, default_start_method
from .janitor import SpoolJanitor
from .payload import RolloutPayload
from .placement import Placement
from .queue import StalenessBoundedQueue
from .weights import SharedWeightStore

logger = logging.getLogger(__name__)

# `RolloutPipeline.window_metrics`'s keys: this rank's sums over a logging window (`staleness_max` its maximum).
ASYNC_WINDOW_KEYS = (
    "batches",
    "trainer_batches",
    "rows",
    "staleness_row_sum",
    "staleness_max",
    "evicted_rows",
    "generator_wait_s",
    "trainer_wait_s",
    "generate_s",
    "reward_s",
    "tool_s",
    "queue_size",
    "lending_calls",
    "lent_calls",
    "decode_rows_sum",
    "decode_fallbacks",
)


@dataclasses.dataclass
class RolloutBatch:
    """One generation batch ready to train on."""

    payload: RolloutPayload
    version: int  # policy version of the weights that generated it
    staleness: int  # this rank's staleness at the batch's last use
    from_trainer: bool  # produced by the trainer itself while the generation process was starting


@dataclasses.dataclass
class RolloutSettings:
    max_staleness: int
    micro_steps_per_item: int  # micro-steps fed by one generation batch
    micro_steps_per_version: int  # micro-steps per optimizer step (gradient accumulation)
    queue_capacity: int | None = None
    weight_sync_steps: int = 1
    trainer_generates_while_starting: bool = True
    startup_timeout: float = 600.0
    heartbeat_timeout: float = 300.0
    # Hold the generator's weights back: item n is generated with exactly the oldest weights the bound allows (its
    # last-use version minus max_staleness), for staleness studies (`AsyncGRPOConfig.fixed_staleness`).
    fixed_staleness: bool = False


def publishable_parameters(model: torch.nn.Module) -> tuple[list, list]:
    """(frozen, trainable) named parameters the generator's copy needs. For PEFT models, adapters other than the
    active one (TRL's frozen `ref` copy for the KL term) stay on the trainer: the generator samples from the policy.

    Names are the generator's (module wrappers' path components removed, `gather.clean_parameter_name`). Under FSDP2
    or ZeRO-3 the tensors are this rank's shards: `gather.iter_full_parameters` turns them into whole tensors."""
    others = ()
    if hasattr(model, "peft_config") and hasattr(model, "active_adapter"):
        others = tuple(f".{name}." for name in model.peft_config if name != model.active_adapter)
    named = [(clean_parameter_name(n), p) for n, p in model.named_parameters() if not any(tag in n for tag in others)]
    return [(n, p) for n, p in named if not p.requires_grad], [(n, p) for n, p in named if p.requires_grad]


class RolloutPipeline:
    def __init__(self, settings: RolloutSettings, all_reduce_max: Callable[[int], int] | None = None):
        self.settings = settings
        self.all_reduce_max = all_reduce_max  # None with one process
        self.process: GenerationProcess | None = None
        self.queue: StalenessBoundedQueue | None = None
        self._janitor: SpoolJanitor | None = None  # removes the queue's spool if this process is killed
        self.frozen_store = self.trainable_store = None
        self._trainable_names: list[str] = []
        self._local: RolloutProducer | None = None
        self._next_index = 0  # next queue index to consume (the queue's own counter once it is open)
        self._stream_offset = 0
        self._restored: dict | None = None
        self._window = self._empty_window()
        self._last_stats = None
        self._local_trainer_state = None
        self._trainer_threads = None
        self._threads_before = torch.get_num_threads()
        self._lending: CoreLending | None = None
        self._lending_hooks: list = []
        self._lending_counts = (0, 0)
        self._fallbacks_seen = self._fallbacks_logged = 0  # the generation process's eager-decoding fallbacks
        # Where the trainer stands while it makes batches itself, read by the thread that opens the queue as soon as
        # the generation process is ready (`_open_queue_when_ready`): both under `_switch`.
        self._switch = threading.Lock()
        self._making_batch = False
        self._opener: threading.Thread | None = None
        self._frozen_publisher: threading.Thread | None = None
        self._frozen_error: BaseException | None = None

    @property
    def started(self) -> bool:
        return self.process is not None

    # ------------------------------------------------------------------------------------------------ lifecycle
    def restore(self, state: dict | None) -> None:
        """Resume the prompt stream where a checkpoint left it (call before `start`)."""
        self._restored = state

    def start(
        self,
        spec: GeneratorSpec,
        model: torch.nn.Module,
        version: int,
        trainer_state=None,
        placement: Placement | None = None,
        final_version: int | None = None,
    ) -> None:
        """Publish the start-up weights and spawn the generation process (returns at once).

        `final_version`: the version training ends at (the trainer's `max_steps`): the generation process makes no
        batch beyond the last one the schedule needs (`StalenessBoundedQueue.set_end`).

        `placement`: the trainer's torch threads from the generator's start, and whether the two processes lend each
        other their cores while they wait (see `placement`, `cores`); the thread count is restored on close. Under
        FSDP2 / ZeRO-3, every rank must call it at the same point: the weights are gathered (collectives).
        """
        settings = self.settings
        self._trainer_threads = None if placement is None else placement.trainer_threads
        self._threads_before = torch.get_num_threads()
        if placement is not None and placement.lend_cores and spec.backend == "hf":
            self._lending = CoreLending(
                multiprocessing.get_context("spawn"),
                placement.cores,
                placement.trainer_threads,
                placement.generator_threads,
            )
            self._lending_hooks = self._lending.attach(model, TRAINER)
            self._lending_counts = (0, 0)
        if self._restored is not None:
            spec = dataclasses.replace(spec, stream_offset=int(self._restored["stream_position"]))
        self._stream_offset = spec.stream_offset
        sharding = model_sharding(model)  # FSDP2 / ZeRO-3: whole tensors are gathered on every rank to publish
        frozen, trainable = publishable_parameters(model)
        if not trainable:
            raise ValueError("The model has no trainable parameters to publish to the generator.")
        self.frozen_store = SharedWeightStore(full_placeholders(frozen)) if frozen else None
        if self.frozen_store is not None:
            self._publish_frozen(frozen, version, in_background=sharding is None)
        self.trainable_store = SharedWeightStore(full_placeholders(trainable))
        self.trainable_store.publish(iter_full_parameters(trainable), version)
        self._trainable_names = [name for name, _ in trainable]
        # A sharded model cannot `generate` on its own: every decoding step would all-gather the parameters, in
        # lockstep across ranks whose completions end at different lengths (and gathering the whole model for it
        # defeats the sharding). So under sharding the trainer waits for the generation process instead.
        # With fixed staleness every batch comes from the generation process, so that its weights are the held-back ones.
        generates_while_starting = (
            settings.trainer_generates_while_starting and sharding is None and not settings.fixed_staleness
        )
        if sharding is not None:
            logger.info(
                "trl_async: %s: parameters are gathered on every rank for each publish; the trainer waits for the "
                "generation process at start-up instead of generating on its sharded model.", sharding
            )  # fmt: skip
        self.queue = StalenessBoundedQueue(
            max_staleness=settings.max_staleness,
            capacity=settings.queue_capacity,  # None: derived from the staleness bound and the schedule
            micro_steps_per_item=settings.micro_steps_per_item,
            micro_steps_per_version=settings.micro_steps_per_version,
            base_version=version,
            # Opened once the generation process is ready, unless the trainer waits for it from the start.
            start_index=None if generates_while_starting else 0,
        )
        self._janitor = SpoolJanitor(self.queue.spool_dir)
        self.queue.publish(version)
        if final_version is not None and final_version > version:
            g, a = settings.micro_steps_per_item, settings.micro_steps_per_version
            self.queue.set_end(items_first_used_before(final_version, g, a, base=version) - 1)
        # The split applies from the spawn on, not from when the queue opens: the child's start-up (imports, model
        # build) keeps one core busy, and a trainer that kept every core would oversubscribe them, which costs far
        # more than the thread it gives up (OpenMP regions wait for their slowest thread; measured on 2 cores, a
        # trainer with 2 threads beside a busy 1-thread generator ran 0.35 s/step against 0.24 s/step with 1 thread).
        self._split_cores()
        self._write_trainer_state(trainer_state)
        self._next_index = 0
        self._local_evicted_items = 0
        self._last_stats = self.queue.stats()
        self.process = GenerationProcess(
            spec,
            self.queue,
            self.frozen_store,
            self.trainable_store,
            startup_timeout=settings.startup_timeout,
            heartbeat_timeout=settings.heartbeat_timeout,
            lending=self._lending,
            # A fork server's child starts with its imports done (`warm_up_generator_start`); vLLM's engine start-up
            # dwarfs them and manages processes of its own, so its generation process is spawned as before.
            mp_context=default_start_method() if spec.backend == "hf" else "spawn",
        )
        self._spec = spec
        self._local = None
        self.process.start()
        if generates_while_starting:
            self._opener = threading.Thread(target=self._open_when_ready, daemon=True, name="trl-async-queue-opener")
            self._opener.start()
        logger.info(
            "trl_async: generation process starting (%s) on %s (%d threads%s); %d trainable tensors (%.1f MiB) sync "
            "every %d step(s); %d generation batch(es) per decode",
            self.process.ctx.get_start_method(), spec.device, spec.num_threads,
            ", cores lent while waiting" if self._lending is not None else "", len(trainable),
            self.trainable_store.num_bytes / 2**20, settings.weight_sync_steps, spec.items_per_decode,
        )  # fmt: skip

    def _split_cores(self) -> None:
        if self._trainer_threads is not None:
            torch.set_num_threads(self._trainer_threads)

    def close(self) -> None:
        """Stop the generation process and free the queue's spool and the stores (idempotent)."""
        if self._frozen_publisher is not None:
            self._frozen_publisher.join()  # seconds at most; it reads the stores closed below
            self._frozen_publisher = None
        for handle in self._lending_hooks:
            handle.remove()
        self._lending_hooks, self._lending = [], None
        if self.process is not None:
            self.process.stop()
            if self._trainer_threads is not None:
                torch.set_num_threads(self._threads_before)
        if self.queue is not None:
            self.queue.cleanup()  # (also ends the opener thread: it stops once the queue is closed)
        if self._opener is not None:
            self._opener.join()
            self._opener = None
        if self._janitor is not None:
            self._janitor.release()
        self.process = self.queue = self._janitor = self.frozen_store = self.trainable_store = self._local = None
        self._restored = None

    def check_health(self) -> None:
        if self._frozen_error is not None:
            raise RuntimeError("Publishing the start-up weights to the generation process failed.") from (
                self._frozen_error
            )
        if self.process is not None:
            self.process.check_health()

    def _publish_frozen(self, frozen: list, version: int, in_background: bool) -> None:
        """The weights the trainer never changes (a LoRA model's base: 2 GB at 0.5B in fp32) into their store: on
        a thread, beside the trainer's first steps, unless gathering them takes collectives (FSDP2, ZeRO-3: every rank
        in the same order, on the main thread). The generation process waits for them before building its model.
        Touching the shared memory's pages for the first time is most of the cost (seconds per GB on the development
        VM), and it was on the trainer's critical path before its first step."""
        if not in_background:
            self.frozen_store.publish(iter_full_parameters(frozen), version)
            return
        store, recorder = self.frozen_store, timeline()

        def publish():
            started = recorder.begin()
            try:
                store.publish(iter_full_parameters(frozen), version)
            except BaseException as error:  # raised by `check_health` on the trainer's thread
                self._frozen_error = error
            recorder.add(span.PUBLISH_START_WEIGHTS, started, recorder.begin())

        self._frozen_publisher = threading.Thread(target=publish, daemon=True, name="trl-async-publish-frozen")
        self._frozen_publisher.start()

    def _open_when_ready(self) -> None:
        """The opener thread: opens the queue as soon as the generation process is ready, whatever the trainer is
        doing (a training step at 0.5B on a CPU takes half a minute, in which a ready process would otherwise wait)."""
        while self.queue is not None and not self.queue.closed and not self.queue.is_open:
            self._open_queue_when_ready()
            time.sleep(0.05)

    # ------------------------------------------------------------------------------------------------ batches
    def next_batch(self, last_use_version: int, model: torch.nn.Module, current_version: int) -> RolloutBatch:
        """The next generation batch whose staleness at `last_use_version` is within bound on every rank.

        `model` is the trainer's (unwrapped) policy at `current_version`, used to produce a batch in-process while
        the generation process is still starting.
        """
        self.check_health()
        while True:
            with self._switch:  # the decision and `_making_batch` at once: the opener thread reads both
                if not self.queue.is_open and self.process.ready:
                    self._open_queue_locked()
                self._making_batch = not self.queue.is_open
            if not self._making_batch:
                waited = timeline().begin()
                item = self.queue.get(
                    last_use_version,
                    on_wait=self.check_health,
                    agree=self._agree,  # evicts (and counts) stale items itself, agreeing with the other ranks
                    on_idle=None if self._lending is None else functools.partial(self._lending.set_waiting, TRAINER),
                )
                timeline().end(span.WAIT_FOR_BATCH, waited, span.WAIT)
                batch = RolloutBatch(item.payload, item.version, item.staleness, from_trainer=False)
                self._next_index = item.index + 1
                break
            try:
                with timeline().span(span.MAKE_BATCH):
                    batch = self._produce_locally(last_use_version, model, current_version)
            finally:
                with self._switch:
                    self._next_index += 1
                    self._making_batch = False
            staleness = self._agree(batch.staleness)
            if staleness <= self.settings.max_staleness:
                break
            self._window["evicted_rows"] += batch.payload.num_rows
            with self._switch:
                if self.queue.is_open:
                    # A batch before the queue's first: it shifts the gate's schedule as one of its own would.
                    self.queue.count_evicted_before_start()
                else:
                    self._local_evicted_items += 1
        self._record(batch)
        return batch

    def _open_queue_when_ready(self) -> None:
        """Once the generation process is ready, open the queue (`_open_queue_locked`); a no-op before and after."""
        if self.queue.is_open or self.process is None or not self.process.ready:
            return
        with self._switch:
            self._open_queue_locked()

    def _open_queue_locked(self) -> None:
        """Open the queue at the first batch the trainer has not started: the next one it would make, or, while it
        makes one itself, the one after (the process makes that while the trainer makes and trains on its own, so the
        switch never waits for the process's first batch). Called under `_switch`, by the opener thread as soon as the
        process is ready and by `next_batch` before each batch."""
        if self.queue.is_open:
            return
        start = self._next_index + (1 if self._making_batch else 0)
        self.queue.open(start, evicted_before=self._local_evicted_items)
        logger.info("trl_async: generator (pid %s) ready after %.1fs; it starts at batch %d",
                    self.process.pid, time.time() - self.process.started_at, start)  # fmt: skip

    def _agree(self, staleness: int) -> int:
        return staleness if self.all_reduce_max is None else self.all_reduce_max(staleness)

    def _produce_locally(self, last_use_version: int, model: torch.nn.Module, version: int) -> RolloutBatch:
        spec = self._spec
        if self._local is None:
            config = generation_config_for_rollouts(spec.generation_config)
            device = next(model.parameters()).device

            def generate_batches(batches, ready=None):  # one batch at a time here: `produce`
                was_training = model.training
                model.eval()  # no dropout, and transformers keeps the KV cache on (gradient checkpointing is train-only)
                try:
                    out = generate_with_behaviour_logprobs(
                        model, [ids for b in batches for ids in b.prompt_ids], config, spec.eos_token_ids,
                        spec.pad_token_id, device, ready=ready,
                        segments=[(len(b.prompt_ids), b.seed) for b in batches],
                    )  # fmt: skip
                    return out.split([len(b.prompt_ids) for b in batches])
                finally:
                    model.train(was_training)

            self._local = RolloutProducer(spec, generate_batches, trainer_state=lambda: self._local_trainer_state)
        payload = self._local.produce(self._next_index)
        return RolloutBatch(payload, version, last_use_version - version, from_trainer=True)

    # ------------------------------------------------------------------------------------------------ weights
    def publish(self, model: torch.nn.Module, version: int, trainer_state=None) -> float:
        """Publish the policy's trainable weights as `version` (every `weight_sync_steps`); returns seconds spent.

        Under FSDP2 / ZeRO-3, every rank must call it for every version (all ranks publish at the same steps)."""
        if self.process is None:
            return 0.0
        self.check_health()
        self._local_trainer_state = trainer_state
        if version % self.settings.weight_sync_steps:
            return 0.0
        if self.settings.fixed_staleness:
            # Nothing newer than what the next batch must be generated with, until the generator has loaded it.
            waited = timeline().begin()
            self.queue.wait_for_loads(
                version,
                on_wait=self.check_health,
                on_idle=None if self._lending is None else functools.partial(self._lending.set_waiting, TRAINER),
            )  # counted in async/trainer_wait_s
            timeline().end(span.WAIT_FOR_LOADS, waited, span.WAIT)
        started = time.perf_counter_ns()
        trainable = dict(publishable_parameters(model)[1])
        self.trainable_store.publish(iter_full_parameters([(n, trainable[n]) for n in self._trainable_names]), version)
        self._write_trainer_state(trainer_state)
        self.queue.publish(version)
        timeline().end(span.PUBLISH_WEIGHTS, started)
        return (time.perf_counter_ns() - started) / 1e9

    def _write_trainer_state(self, trainer_state) -> None:
        """A snapshot for reward functions' `trainer_state` (without `log_history`, which grows with the run)."""
        self._local_trainer_state = trainer_state
        if trainer_state is None:
            return
        snapshot = dataclasses.replace(trainer_state, log_history=[])
        path = os.path.join(self.queue.spool_dir, "trainer_state.json")
        snapshot.save_to_json(path + ".tmp")
        os.replace(path + ".tmp", path)

    # ------------------------------------------------------------------------------------------------ state
    def checkpoint_state(self, version: int) -> dict:
        """Where the prompt stream of this rank stands: the next batch a resumed run must train on."""
        return {
            "stream_position": self._stream_offset + self._next_index,
            "version": version,
        }

    # ------------------------------------------------------------------------------------------------ metrics
    @staticmethod
    def _empty_window() -> dict:
        return {
            "batches": 0,
            "trainer_batches": 0,
            "rows": 0,
            "staleness_row_sum": 0.0,
            "staleness_max": 0,
            "evicted_rows": 0,
            "generate_s": 0.0,
            "reward_s": 0.0,
            "tool_s": 0.0,
            "decode_rows_sum": 0,
        }

    def _record(self, batch: RolloutBatch) -> None:
        rows = batch.payload.num_rows
        window = self._window
        window["batches"] += 1
        window["trainer_batches"] += int(batch.from_trainer)
        window["rows"] += rows
        window["staleness_row_sum"] += max(batch.staleness, 0) * rows
        window["staleness_max"] = max(window["staleness_max"], batch.staleness)
        window["generate_s"] += batch.payload.generate_s
        window["reward_s"] += batch.payload.reward_s
        window["tool_s"] += batch.payload.tool_s
        window["decode_rows_sum"] += batch.payload.decode_rows or rows
        self._fallbacks_seen = max(self._fallbacks_seen, batch.payload.decode_fallbacks)

    def window_metrics(self) -> dict[str, float]:
        """This rank's `async/*` figures since the previous call (the logging window), as sums and maxima."""
        window, self._window = self._window, self._empty_window()
        stats = self.queue.stats() if self.queue is not None else None
        previous = self._last_stats
        self._last_stats = stats
        lending_calls = lent_calls = 0
        fallbacks_logged, self._fallbacks_logged = self._fallbacks_logged, self._fallbacks_seen
        if self._lending is not None:  # hook calls since the last window, and those that found the generator waiting
            lending_calls = self._lending.calls - self._lending_counts[0]
            lent_calls = self._lending.lent_calls - self._lending_counts[1]
            self._lending_counts = (self._lending.calls, self._lending.lent_calls)
        delta = {}
        if stats is not None and previous is not None:
            for key in ("evicted_rows", "generator_wait_s", "trainer_wait_s"):
                delta[key] = stats[key] - previous[key]
        return {
            "batches": window["batches"],
            "trainer_batches": window["trainer_batches"],
            "rows": window["rows"],
            "staleness_row_sum": window["staleness_row_sum"],
            "staleness_max": window["staleness_max"],
            "evicted_rows": window["evicted_rows"] + delta.get("evicted_rows", 0),
            "generator_wait_s": delta.get("generator_wait_s", 0.0),
            "trainer_wait_s": delta.get("trainer_wait_s", 0.0),
            "generate_s": window["generate_s"],
            "reward_s": window["reward_s"],
            "tool_s": window["tool_s"],
            "queue_size": self.queue.qsize() if self.queue is not None else 0,
            "lending_calls": lending_calls,
            "lent_calls": lent_calls,
            "decode_rows_sum": window["decode_rows_sum"],
            "decode_fallbacks": self._fallbacks_seen - fallbacks_logged,
        }


__all__ = [
    "ASYNC_WINDOW_KEYS",
    "GeneratorError",
    "RolloutBatch",
    "RolloutPipeline",
    "RolloutSettings",
    "publishable_parameters",
]
