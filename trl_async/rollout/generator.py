"""The generation process: a real OS process per training rank, started, placed and stopped by the trainer.

Child side (`_generator_main` → `RolloutWorker.run`): for each generation batch it takes a slot from the
staleness-bounded queue (the gate), swaps in the newest published weights, samples completions with behaviour
log-probs, scores them with the reward functions (tensor-native ones on its device without decoding; text ones after
one decode) and enqueues the batch tagged with the weights version.

Trainer side (`GenerationProcess`): starts the child without re-running the user's `__main__` (so scripts with no
`if __name__ == "__main__"` guard still work), waits for it to be ready, checks its health while the trainer waits
on the queue, and stops it on every exit path. The child also watches its parent and exits if the parent is gone,
so it never outlives the trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing.spawn as mp_spawn
import os
import queue as std_queue
import signal
import sys
import threading
import time
import traceback
from typing import Any

import cloudpickle
import torch
import torch.multiprocessing as torch_mp

from .backends import ModelSpec, make_backend
from .prompts import local_generation_batches
from .queue import QueueClosed, StalenessBoundedQueue
from .weights import SharedWeightStore

_DISTRIBUTED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


class GeneratorError(RuntimeError):
    """The generation process failed; the message carries its traceback or exit status."""


@dataclasses.dataclass
class GeneratorSpec:
    """Everything the child needs besides the shared-memory objects. Serialized with cloudpickle, so reward
    functions defined in the user's `__main__` travel by value."""

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
    repeat_count: int
    shuffle: bool
    seed: int
    reward_funcs: list
    reward_func_names: list[str]
    decode_completions: bool  # also decode when no text reward needs it (completion logging)
    parent_pid: int


class _Control:
    """Shared flags between the trainer and its generator."""

    def __init__(self, ctx):
        self.ready = ctx.Event()
        self.stop = ctx.Event()
        self.heartbeat = ctx.RawValue("d", time.time())
        self.errors = ctx.Queue()

    def beat(self):
        self.heartbeat.value = time.time()


# ------------------------------------------------------------------------------------------------------ child side
def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the kernel kills us when the parent dies

    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(0)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True, name="trl-async-parent-watch").start()


class RolloutWorker:
    def __init__(self, spec: GeneratorSpec, rollout_queue, frozen_store, trainable_store, control: _Control):
        from trl.data_utils import is_conversational

        self.spec = spec
        self.queue = rollout_queue
        self.control = control
        self.tokenizer = spec.processing_class
        self._is_conversational = is_conversational
        self.backend = make_backend(
            spec.backend,
            model_spec=spec.model_spec,
            frozen_store=frozen_store,
            trainable_store=trainable_store,
            generation_config=spec.generation_config,
            temperature=spec.temperature,
            eos_token_ids=spec.eos_token_ids,
            pad_token_id=spec.pad_token_id,
            device=spec.device,
            heartbeat=control.beat,
        )

    def _tokenize(self, prompts: list) -> list[list[int]]:
        # The same call as TRL's `GRPOTrainer._tokenize_prompts` (text-only path).
        if self._is_conversational({"prompt": prompts[0]}):
            return self.tokenizer.apply_chat_template(
                conversation=prompts,
                chat_template=self.spec.chat_template,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                **self.spec.chat_template_kwargs,
            )["input_ids"]
        return self.tokenizer(text=prompts)["input_ids"]

    def _decode(self, completion_ids: list[list[int]], conversational: bool) -> list:
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        if conversational:
            return [[{"role": "assistant", "content": text}] for text in texts]
        return texts

    def run(self) -> None:
        from trl_async.rewards import score_completions

        spec = self.spec
        version = self.backend.load()
        self.control.ready.set()
        batches = local_generation_batches(
            num_prompts=len(spec.dataset),
            num_generations=spec.num_generations,
            generation_batch_size=spec.generation_batch_size,
            repeat_count=spec.repeat_count,
            shuffle=spec.shuffle,
            seed=spec.seed,
            process_index=spec.process_index,
            num_processes=spec.num_processes,
        )
        store = self.backend.trainable_store
        while not self.control.stop.is_set():
            index, min_version = self.queue.reserve(on_wait=self._beat_or_stop)
            if store.version < min_version:
                store.wait_for_version(min_version, on_wait=self._beat_or_stop)
            version = self.backend.update_weights()
            rows = next(batches)
            columns = spec.dataset[rows]
            prompts = columns.pop("prompt")
            conversational = self._is_conversational({"prompt": prompts[0]})
            t0 = time.perf_counter()
            prompt_ids = self._tokenize(prompts)
            generated = self.backend.generate(prompt_ids)
            completion_ids, logprobs = generated.to_lists()
            t1 = time.perf_counter()
            decode = _DecodeOnce(self._decode, completion_ids, conversational)
            for key in ("completion", "completion_ids"):
                columns.pop(key, None)
            rewards_per_func = score_completions(
                spec.reward_funcs,
                generated.completion_ids,
                generated.completion_mask,
                columns,
                prompts=prompts,
                decode=decode,
                reward_func_names=spec.reward_func_names,
                extra_kwargs={"trainer_state": None, "log_extra": _ignore, "log_metric": _ignore},
            )
            if spec.decode_completions:
                decode()
            t2 = time.perf_counter()
            payload = {
                "prompts": prompts,
                "prompt_ids": [list(p) for p in prompt_ids],
                "completion_ids": completion_ids,
                "logprobs": logprobs,
                "rewards_per_func": rewards_per_func.detach().float().cpu(),
                "completions": decode.result,
                "generate_s": t1 - t0,
                "reward_s": t2 - t1,
            }
            self.queue.put(index, version, payload, num_rows=len(rows))
            self.control.beat()

    def _beat_or_stop(self) -> None:
        self.control.beat()
        if self.control.stop.is_set():
            raise QueueClosed("stop requested")


class _DecodeOnce:
    """Decodes a batch on first call only; text rewards share the result, tensor rewards never trigger it."""

    def __init__(self, decode, completion_ids, conversational):
        self._decode, self._args, self.result = decode, (completion_ids, conversational), None

    def __call__(self):
        if self.result is None:
            self.result = self._decode(*self._args)
        return self.result


def _ignore(*args, **kwargs) -> None:
    return None


def _generator_main(spec_blob: bytes, rollout_queue, frozen_store, trainable_store, control: _Control) -> None:
    try:
        for name in _DISTRIBUTED_ENV:  # the child is not a member of the trainer's process group
            os.environ.pop(name, None)
        spec: GeneratorSpec = cloudpickle.loads(spec_blob)
        _die_with_parent(spec.parent_pid)
        torch.set_num_threads(spec.num_threads)
        RolloutWorker(spec, rollout_queue, frozen_store, trainable_store, control).run()
    except QueueClosed:
        return
    except BaseException:
        control.errors.put(traceback.format_exc())
        control.errors.close()
        control.errors.join_thread()
        sys.exit(1)


# ---------------------------------------------------------------------------------------------------- trainer side
@contextlib.contextmanager
def _spawn_without_main_module():
    """Spawned children normally re-import the parent's `__main__`, re-running an unguarded training script.
    Our child needs nothing from it (its payload is cloudpickled by value), so leave it out."""
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


class GenerationProcess:
    """Trainer-side handle of one generation process."""

    def __init__(
        self,
        spec: GeneratorSpec,
        rollout_queue: StalenessBoundedQueue,
        frozen_store: SharedWeightStore | None,
        trainable_store: SharedWeightStore,
        startup_timeout: float,
        heartbeat_timeout: float,
        mp_context="spawn",
    ):
        self.ctx = torch_mp.get_context(mp_context) if isinstance(mp_context, str) else mp_context
        self.spec = spec
        self.queue = rollout_queue
        self.frozen_store = frozen_store
        self.trainable_store = trainable_store
        self.startup_timeout = startup_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.control = _Control(self.ctx)
        self.process = None
        self._error: str | None = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self) -> None:
        blob = cloudpickle.dumps(self.spec)
        self.process = self.ctx.Process(
            target=_generator_main,
            args=(blob, self.queue, self.frozen_store, self.trainable_store, self.control),
            name=f"trl-async-generator-{self.spec.process_index}",
            daemon=True,
        )
        with _spawn_without_main_module():
            self.process.start()
        deadline = time.time() + self.startup_timeout
        while not self.control.ready.wait(0.2):
            self.check_health(startup=True)
            if time.time() > deadline:
                self.stop()
                raise GeneratorError(
                    f"The generation process (pid {self.pid}) did not become ready within "
                    f"generator_startup_timeout={self.startup_timeout:.0f}s (loading a large model? raise it)."
                )
        self.control.beat()

    def _child_traceback(self, wait_s: float = 0.0) -> str | None:
        if self._error is None:
            with contextlib.suppress(std_queue.Empty):
                self._error = self.control.errors.get(timeout=wait_s) if wait_s else self.control.errors.get_nowait()
        return self._error

    def check_health(self, startup: bool = False) -> None:
        """Raise `GeneratorError` if the child raised, exited or stopped making progress."""
        error = self._child_traceback()
        if error is None and self.process is not None and not self.process.is_alive():
            error = self._child_traceback(wait_s=2.0)  # its traceback may still be in flight
            if error is None:
                raise GeneratorError(
                    f"The generation process (pid {self.pid}) exited with code {self.process.exitcode} without "
                    "reporting an error (killed by the OS, e.g. out of memory?)."
                )
        if error is not None:
            raise GeneratorError(f"The generation process (pid {self.pid}) failed:\n{error}")
        silent_s = time.time() - self.control.heartbeat.value
        if not startup and silent_s > self.heartbeat_timeout:
            raise GeneratorError(
                f"The generation process (pid {self.pid}) showed no progress for {silent_s:.0f}s "
                f"(generator_heartbeat_timeout={self.heartbeat_timeout:.0f}s); it is presumed hung."
            )

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the child on every path; escalate from a polite stop to SIGTERM to SIGKILL."""
        if self.process is None:
            return
        self.control.stop.set()
        self.queue.close()
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
