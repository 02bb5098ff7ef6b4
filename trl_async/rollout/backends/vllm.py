"""The `vllm` backend: a vLLM engine inside the generation process.

Like every backend it keeps the `GenerationBackend` contract of `base.py`: weights come only through the shared-memory
stores, and the returned behaviour log-probs μ are the log-probabilities of the sampled tokens under the *processed*
distribution that sampled them (vLLM's `logprobs_mode="processed_logprobs"`: repetition penalty, then temperature,
then min-p, then top-k and top-p, renormalised), 0 on padding.

* the engine runs in the calling process (vLLM's `UniProcExecutor`, `VLLM_ENABLE_V1_MULTIPROCESSING=0`), because the
  generation process is a daemonic child and may not start processes of its own;
* the model is built from the trainer's config with dummy weights (nothing is read from disk or a hub), then the
  start-up weights are applied from the stores;
* full fine-tune: each update streams the trainable tensors through vLLM's in-place `reload_weights` (the worker API
  that re-runs the kernel-format processing, e.g. the CPU backend's weight prepacking, after loading);
* LoRA: the frozen base goes in once, and each update hands vLLM only the adapter, as a new `LoRARequest`.

The same model served by a running `trl vllm-serve` is `vllm_server.VLLMServerBackend`. What both share lives in
`vllm_sampling` (SamplingParams, seeds, packing) and `vllm_weights` (LoRA names and folders, tied-layer repacking).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable

import torch

from .base import BackendContext, GenerationBackend, GenerationOutput
from .vllm_sampling import pack_completions, row_seeds, sampling_kwargs
from .vllm_weights import (
    adapter_checkpoint_name,
    base_weight_name,
    lora_rank_slot,
    refresh_tied_weight_kernels,
    staging_buffers,
    validate_lora_for_vllm,
    write_adapter,
)

# vLLM's engine core would otherwise run in a child process; the generation process is daemonic and may not have any.
IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

# The CPU backend reserves `gpu_memory_utilization` of the *host* memory unless the KV cache is sized explicitly.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


class VLLMBackend(GenerationBackend):
    """A vLLM engine inside the generation process.

    Options beyond the `BackendContext` (all optional):
        max_model_len: longest prompt + completion, in tokens (TRL's `vllm_max_model_length`); vLLM's default is the
            model's `max_position_embeddings`.
        gpu_memory_utilization: fraction of the GPU for weights + KV cache (TRL's `vllm_gpu_memory_utilization`,
            default 0.3 as in TRL, since the trainer shares the GPU). Not used on CPU.
        kv_cache_memory_bytes: KV-cache size. Default on CPU: 1 GiB (vLLM's CPU default reserves 92% of the host).
        tensor_parallel_size: must be 1 in-process (vLLM's tensor parallelism needs worker processes; use a server).
        enforce_eager: default True on CPU (vLLM's CPU compilation takes minutes), False on GPU.
        enable_prefix_caching: vLLM's prefix cache (GRPO repeats each prompt `num_generations` times); reset after
            every weight update.
        engine_seed: seed of the engine's global sampler RNG (used when `generate` gets no seed).
        sampling_overrides: extra `vllm.SamplingParams` fields (TRL's `generation_kwargs` under `use_vllm=True`).
        engine_kwargs: further `vllm.LLM` arguments, passed through (e.g. `max_num_seqs`, `max_num_batched_tokens`,
            `model_impl`, `enable_sleep_mode`); those the backend sets itself are refused. On CPU chunked prefill is
            off by default (see below); `enable_chunked_prefill=True` here turns it back on, for unseeded use only.
    """

    name = "vllm"

    _OWNED_ENGINE_ARGS = {
        "model",
        "dtype",
        "load_format",
        "skip_tokenizer_init",
        "logprobs_mode",
        "distributed_executor_backend",
        "enable_lora",
        "generation_config",
    }

    def __init__(
        self,
        context: BackendContext,
        *,
        max_model_len: int | None = None,
        gpu_memory_utilization: float | None = None,
        kv_cache_memory_bytes: int | None = None,
        tensor_parallel_size: int = 1,
        enforce_eager: bool | None = None,
        enable_prefix_caching: bool = True,
        engine_seed: int = 0,
        sampling_overrides: dict | None = None,
        engine_kwargs: dict | None = None,
    ):
        super().__init__(context)
        # Validate the sampling settings now, rather than after the engine's start-up (a minute on CPU) in load().
        self.sampling_kwargs = sampling_kwargs(
            context.generation_config, context.temperature, self.eos_token_ids, sampling_overrides
        )
        if tensor_parallel_size != 1:
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size}: vLLM's tensor parallelism runs one worker process per "
                "shard, which the (daemonic) generation process cannot start. Serve the model with `trl vllm-serve "
                "--tensor_parallel_size N` and use vllm_mode='server'."
            )
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"The vllm generation backend runs on 'cpu' or 'cuda' devices, got {self.device}.")
        engine_kwargs = dict(engine_kwargs or {})
        owned = sorted(set(engine_kwargs) & self._OWNED_ENGINE_ARGS)
        if owned:
            raise ValueError(f"These vllm.LLM arguments are set by the vllm generation backend: {owned}.")
        on_cpu = self.device.type == "cpu"
        if on_cpu and gpu_memory_utilization is not None:
            raise ValueError(
                "gpu_memory_utilization has no meaning for the CPU engine (vLLM would reserve that fraction of the "
                "host memory); size the KV cache with kv_cache_memory_bytes instead."
            )
        if on_cpu and kv_cache_memory_bytes is None:
            kv_cache_memory_bytes = DEFAULT_CPU_KV_CACHE_BYTES
        if not on_cpu and gpu_memory_utilization is None and kv_cache_memory_bytes is None:
            gpu_memory_utilization = 0.3
        self.engine_args = {
            "max_model_len": max_model_len,
            "enforce_eager": on_cpu if enforce_eager is None else enforce_eager,
            "enable_prefix_caching": enable_prefix_caching,
            "seed": engine_seed,
            "kv_cache_memory_bytes": kv_cache_memory_bytes,
            "gpu_memory_utilization": gpu_memory_utilization,
            # vLLM 0.32 on CPU: a seeded request whose prefill is split over two steps crashes the engine ("CPU
            # Generator does not use offset": rewinding the discarded sample's RNG needs CUDA generators). Whole
            # prefills avoid the split; it bites as soon as a batch's prompts exceed one step's token budget.
            "enable_chunked_prefill": False if on_cpu else None,
            **engine_kwargs,
        }
        self.engine_args = {k: v for k, v in self.engine_args.items() if v is not None}
        self.is_lora = self.model_spec.peft_config is not None
        self.llm = None
        self.lora_request = None
        self._lora_ids = 0
        self._workdir: str | None = None

    # ------------------------------------------------------------------------------------------------ start-up
    def load(self) -> int:
        os.environ.update(IN_PROCESS_ENV)  # read by vLLM when the engine is built
        self._select_device()
        from vllm import LLM

        spec = self.model_spec
        if not self.is_lora:
            self._check_names_full()
        self._workdir = tempfile.mkdtemp(prefix="trl-async-vllm-")
        # vLLM builds the model from a config directory; the weights come from the stores, never from disk.
        model_dir = os.path.join(self._workdir, "model")
        spec.config.save_pretrained(model_dir)
        lora_args = {}
        if self.is_lora:
            validate_lora_for_vllm(spec.peft_config)  # vLLM's own messages first (DoRA, modules_to_save, ...)
            self._check_names_lora()
            lora_args = {"enable_lora": True, "max_lora_rank": lora_rank_slot(spec.peft_config), "max_loras": 1}
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op (it pins OpenMP threads in its worker
        # processes); in-process there is no pinning, so give the caller its function back.
        set_num_threads = torch.set_num_threads
        try:
            self.llm = LLM(
                model=model_dir,
                dtype=spec.dtype,
                load_format="dummy",
                skip_tokenizer_init=True,
                logprobs_mode="processed_logprobs",
                distributed_executor_backend="uni",
                generation_config="vllm",  # sampling settings come only from us, not from a generation_config.json
                **lora_args,
                **self.engine_args,
            )
        finally:
            torch.set_num_threads = set_num_threads
        self.heartbeat()
        self._staging = staging_buffers(self.trainable_store)
        self._frozen = None
        if self.frozen_store is not None:
            self._frozen = staging_buffers(self.frozen_store)
            self.frozen_store.read_into(self._frozen)
        if self.is_lora:
            # The frozen base goes in once; every update after this one sends only the adapter.
            self._reload_base(self._base_weights(self._frozen or {}))
        return self.update_weights()

    def _select_device(self) -> None:
        if self.device.type != "cuda" or self.device.index is None:
            return
        # vLLM's single-process executor always uses the first visible GPU.
        if torch.cuda.is_initialized():
            if self.device.index != 0:
                raise RuntimeError(
                    f"The vllm backend must be placed on {self.device} before CUDA is initialised in the generation "
                    "process (vLLM's single-process engine uses the first visible GPU)."
                )
            return
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        physical = visible.split(",")[self.device.index] if visible else str(self.device.index)
        os.environ["CUDA_VISIBLE_DEVICES"] = physical

    def _check_names_full(self) -> None:
        names = list(self.trainable_store.names) + (list(self.frozen_store.names) if self.frozen_store else [])
        lora_like = [n for n in names if "lora_" in n or n.startswith("base_model.model.")]
        if lora_like:
            raise RuntimeError(
                f"The stores hold PEFT tensors (e.g. {lora_like[:2]}) but model_spec.peft_config is None."
            )

    def _check_names_lora(self) -> None:
        adapter = self.model_spec.adapter_name
        for name in self.trainable_store.names:
            adapter_checkpoint_name(name, adapter)  # raises for anything that is not a LoRA A/B matrix
        if self.frozen_store is None:
            raise RuntimeError("A LoRA model needs its frozen base weights in frozen_store.")
        stray = [n for n in self.frozen_store.names if ".lora_" in n or "modules_to_save" in n]
        if stray:
            raise RuntimeError(
                f"The frozen store holds adapter tensors (e.g. {stray[:2]}); vLLM serves one plain LoRA adapter "
                "on top of the base model."
            )

    @staticmethod
    def _base_weights(tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        return [(base_weight_name(name), t) for name, t in tensors.items()]

    def _reload_base(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # The worker's in-place reload loads checkpoint-format tensors through the model's `load_weights` (which maps
        # HF names onto vLLM's fused modules) and re-runs the per-layer processing, e.g. the CPU GEMM prepacking,
        # which a plain `load_weights` into the live parameters would silently bypass.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.apply_model(refresh_tied_weight_kernels)
        self.llm.reset_prefix_cache()

    # --------------------------------------------------------------------------------------------------- updates
    def update_weights(self) -> int:
        if self.trainable_store.version == self.version:
            return self.version
        version = self.trainable_store.read_into(self._staging)
        if self.is_lora:
            self._swap_adapter(version)
        else:
            # Layers whose tensors are only partly trainable are reloaded whole: the reload processes a layer once
            # all of its tensors have arrived, so the frozen ones travel too.
            weights = list(self._staging.items()) + list((self._frozen or {}).items())
            self._reload_base(weights)
        self.version = version
        self.heartbeat()
        return version

    def _swap_adapter(self, version: int) -> None:
        from vllm.lora.request import LoRARequest

        self._lora_ids += 1
        directory = os.path.join(self._workdir, f"adapter-{self._lora_ids}")
        write_adapter(directory, self.model_spec.peft_config, self._staging, self.model_spec.adapter_name)
        request = LoRARequest(
            lora_name=f"policy-v{version}-{self._lora_ids}", lora_int_id=self._lora_ids, lora_path=directory
        )
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM refused the adapter of weights v{version}.")
        previous, self.lora_request = self.lora_request, request
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    # ------------------------------------------------------------------------------------------------ generation
    def sampling_params(self, num_rows: int, seed: int | None = None) -> list:
        from vllm import SamplingParams

        return [SamplingParams(**self.sampling_kwargs, seed=s) for s in row_seeds(seed, num_rows)]

    def generate(self, prompt_ids: list[list[int]], seed: int | None = None) -> GenerationOutput:
        return self._generate(prompt_ids, self.sampling_params(len(prompt_ids), seed))

    def generate_batches(self, batches, ready=None) -> list[GenerationOutput]:
        """Every batch's rows in one engine run, each row with its own seed from its batch's (`row_seeds`): the same
        completions as one call per batch, with the engine's continuous batching over all of them."""
        if ready is not None:
            ready()
        prompt_ids = [ids for batch in batches for ids in batch.prompt_ids]
        params = [p for batch in batches for p in self.sampling_params(len(batch.prompt_ids), batch.seed)]
        return self._generate(prompt_ids, params).split([len(batch.prompt_ids) for batch in batches])

    @torch.no_grad()
    def _generate(self, prompt_ids: list[list[int]], sampling_params: list) -> GenerationOutput:
        prompts = [{"prompt_token_ids": list(map(int, ids))} for ids in prompt_ids]
        self.llm.enqueue(prompts, sampling_params, lora_request=self.lora_request, use_tqdm=False)
        # Drive the engine ourselves (as `LLM.wait_for_completion` does) so that every decoding step beats.
        engine, finished = self.llm.llm_engine, []
        while engine.has_unfinished_requests():
            finished.extend(output for output in engine.step() if output.finished)
            self.heartbeat()
        if len(finished) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(finished)} completions for {len(prompts)} prompts.")
        # Request ids count up in submission order; vLLM's own `_run_engine` orders its outputs the same way.
        completions = [output.outputs[0] for output in sorted(finished, key=lambda output: int(output.request_id))]
        token_ids = [list(c.token_ids) for c in completions]
        logprobs = [
            [step[token].logprob for step, token in zip(c.logprobs, c.token_ids, strict=True)] for c in completions
        ]
        return pack_completions(token_ids, logprobs, self.eos_token_ids, self.pad_token_id)

    def close(self) -> None:
        if self.llm is not None:
            with contextlib.suppress(Exception):
                self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None


if __name__ == "__main__":
    # The server launcher's old address (`python -m trl_async.rollout.backends.vllm`), from before the server backend
    # moved to `vllm_server`: commands written against it keep working.
    from .vllm_server import _serve_main

    _serve_main()
