"""Sharded training (FSDP2, DeepSpeed ZeRO-3): the policy's whole weights reach every rank's generation process.

Two training processes on CPU (gloo) under a real `accelerate launch`, each with its own generation process
(`tests/scripts/sharded_ranks.py` says what each rank checks and how FSDP2 is run on CPU). On each rank the behaviour
log-probs μ of every trained batch are recomputed from the trainer's whole weights of the batch's tagged version, taken
by a route independent of `trl_async.rollout.gather`, in a plain unsharded model; the stores' final contents are
compared with the final whole weights, and across ranks.
"""

import importlib.util
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from trl_async.rollout.gather import FSDP1_MESSAGE, clean_parameter_name, model_sharding

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "sharded_ranks.py")
CONFIGS = os.path.join(os.path.dirname(__file__), os.pardir, "recipes", "accelerate_configs")
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
NEEDS_DEEPSPEED = pytest.mark.skipif(
    not HAS_DEEPSPEED,
    reason="DeepSpeed is not installed (`pip install deepspeed`: its CPU accelerator runs ZeRO-3 with gloo)",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    config: str, sharding: str, variant: str, out, *, settings_from="launcher", flags=(), steps: int = 3, env=None
) -> list[dict]:
    """`accelerate launch` with one of the shipped configs (recipes/accelerate_configs), on 2 CPU processes in float32."""
    overrides = ["--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(free_port()), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    if sharding == "fsdp2" and not torch.cuda.is_available():
        env["FORCE_FSDP2_ON_CPU"] = "1"  # see the script's header: accelerate never takes its FSDP path on CPU
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", os.path.join(CONFIGS, config),
         *overrides, SCRIPT, str(out), sharding, variant, settings_from, str(steps)],
        capture_output=True, text=True, timeout=1800, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{k}.json").read_text()) for k in range(2)]


def check_ranks(ranks: list[dict], sharding: str, variant: str, backend: str = "gloo", steps: int = 3) -> None:
    """What every rank of a `sharded_ranks.py` run must have seen (also used by benchmarks/gpu_check.sh on GPUs)."""
    expected_type = {"fsdp2": "DistributedType.FSDP", "zero3": "DistributedType.DEEPSPEED"}[sharding]
    assert [r["process_index"] for r in ranks] == list(range(len(ranks)))
    for r in ranks:
        assert r["num_processes"] == len(ranks) and r["backend"] == backend
        assert r["distributed_type"] == expected_type
        assert r["sharding"] == {"fsdp2": "FSDP2", "zero3": "DeepSpeed ZeRO-3"}[sharding]
        if len(ranks) > 1:  # really sharded: each rank holds about its share of the parameters' elements
            assert r["shard_numel"] < 1.2 * r["whole_numel"] / len(ranks)
        # Every batch came from the generation process (the trainer cannot generate on a sharded model).
        assert r["trainer_generated_batches"] and not any(r["trainer_generated_batches"])
        # Training moved the policy, so the check below can tell versions apart ...
        assert r["global_step"] == steps and r["initial_vs_final_max_diff"] > 1e-3
        assert len(r["mu_gaps"]) == steps and max(r["tagged_versions"]) >= 1
        # ... and it does: another version's weights are far from μ, the tagged version's reproduce it. Every batch
        # has its control, on a version other than its tagged one whose weights differ from the tagged weights
        # (`control_version`: on one rank a step can leave the weights as they were, so "the next version" may not).
        assert len(r["control_gaps"]) == len(r["mu_gaps"]) == len(r["control_versions"])
        assert all(c != t for c, t in zip(r["control_versions"], r["tagged_versions"], strict=True))
        assert min(r["control_weight_gaps"]) > 1e-3, r["control_weight_gaps"]
        assert min(r["control_gaps"]) > 1e-2, (r["control_gaps"], r["control_versions"], r["tagged_versions"])
        assert max(r["mu_gaps"]) < 1e-3, r["mu_gaps"]
        # The stores hold the whole final weights under the generator's names (a plain model's).
        stores = r["store_vs_final"]
        assert stores["trainable"]["version"] == steps
        for store in stores.values():
            assert store["missing_from_final"] == [] and store["max_abs_diff"] == 0.0
        published = set(r["store_names"]["trainable"]) | set(r["store_names"].get("frozen", []))
        assert published == set(r["plain_names"])
        if variant == "lora":  # adapters only travel each sync; the base travelled once, at start-up
            assert r["store_names"]["trainable"] and all(".lora_" in n for n in r["store_names"]["trainable"])
            assert stores["frozen"]["version"] == 0
            assert len(r["store_names"]["trainable"]) == r["num_trainable"]
        else:
            assert "frozen" not in stores
    # Every rank's generator got the same weights.
    assert all(r["store_checksum"] == ranks[0]["store_checksum"] for r in ranks)


def test_the_control_compares_with_weights_other_than_the_tagged_ones():
    """The μ check's control (`control_version`): for each tagged version, the kept version whose weights differ most
    from it, never the tagged version itself, nor a version that kept the same weights. The case one GPU rank met:
    the first step left the policy as it was (version 1 = version 0), then training moved it."""
    from tests.support.weights import control_candidates, control_version

    def weights(value: float) -> dict[str, torch.Tensor]:
        return {"a.weight": torch.full((2, 3), value), "b.bias": torch.zeros(3)}

    kept = {0: weights(1.0), 1: weights(1.0), 2: weights(1.5), 3: weights(0.25)}
    assert control_version(0, kept) == (3, 0.75)  # not 1 (the same weights as 0)
    assert control_version(1, kept) == (3, 0.75)
    assert control_version(2, kept) == (3, 1.25)
    assert control_version(3, kept) == (2, 1.25)
    # two versions of equal weights and nothing else: the difference is 0, which check_ranks refuses
    assert control_version(1, {0: weights(1.0), 1: weights(1.0)}) == (0, 0.0)
    # The candidates the control measures μ under (keeping the one that moves it most): the farthest in weights, then
    # the first and the last other versions, each once, with their weight differences.
    assert control_candidates(2, kept) == [(3, 1.25), (0, 0.5)]
    assert control_candidates(0, kept) == [(3, 0.75), (1, 0.0)]
    assert control_candidates(1, kept) == [(3, 0.75), (0, 0.0)]
    with pytest.raises(ValueError, match="no other version"):
        control_version(0, {0: weights(1.0)})


def test_fsdp2_full_fine_tune_with_checkpoint_wrappers(tmp_path):
    # fsdp2.yaml as shipped (rank 0 loads the checkpoint, the others receive their shards), plus FSDP's activation
    # checkpointing.
    ranks = launch("fsdp2.yaml", "fsdp2", "full", tmp_path, flags=["--fsdp_activation_checkpointing", "true"])
    # FSDP's activation checkpointing renamed the trainer's parameters; the stores use the plain names (checked above).
    assert all(r["wrapped_names"] for r in ranks)
    check_ranks(ranks, "fsdp2", "full")


@pytest.mark.slow
def test_fsdp2_lora_publishes_adapters_only(tmp_path):
    # FSDP2 set in the training arguments (`fsdp_config`), launched with the plain data-parallel config.
    check_ranks(launch("ddp.yaml", "fsdp2", "lora", tmp_path, settings_from="args"), "fsdp2", "lora")


@NEEDS_DEEPSPEED
@pytest.mark.slow
def test_zero3_full_fine_tune(tmp_path):
    check_ranks(launch("zero3.yaml", "zero3", "full", tmp_path), "zero3", "full")


@NEEDS_DEEPSPEED
def test_zero3_lora_publishes_adapters_only(tmp_path):
    check_ranks(launch("zero3.yaml", "zero3", "lora", tmp_path), "zero3", "lora")


# ------------------------------------------------------------------------------------------------ long runs
# 100 steps each, with the project's collective check on (every rank's collectives compared: a rank that skipped,
# added or reshaped one fails the run naming both calls; docs/architecture.md, "Several processes").
@pytest.mark.slow
def test_fsdp2_runs_100_steps_with_every_collective_in_step(tmp_path):
    env = {"TRL_ASYNC_CHECK_COLLECTIVES": "1"}
    check_ranks(launch("fsdp2.yaml", "fsdp2", "lora", tmp_path, steps=100, env=env), "fsdp2", "lora", steps=100)


@NEEDS_DEEPSPEED
@pytest.mark.slow
def test_zero3_runs_100_steps_with_every_collective_in_step(tmp_path):
    env = {"TRL_ASYNC_CHECK_COLLECTIVES": "1"}
    check_ranks(launch("zero3.yaml", "zero3", "full", tmp_path, steps=100, env=env), "zero3", "full", steps=100)


# ------------------------------------------------------------------------------------------------ names, refusals
def test_wrapper_components_are_removed_from_real_wrapped_models():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from transformers import AutoModelForCausalLM

    from trl_async.toy import tiny_model_path

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    plain_names = [n for n, _ in plain.named_parameters()]
    wrapped = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    layer_cls = type(wrapped.model.layers[0])
    apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, layer_cls))
    compiled = torch.compile(wrapped)  # an OptimizedModule wrapper; nothing is compiled until it is called
    raw = [n for n, _ in compiled.named_parameters()]
    assert any("_checkpoint_wrapped_module." in n for n in raw) and all(n.startswith("_orig_mod.") for n in raw)
    assert [clean_parameter_name(n) for n in raw] == plain_names
    assert model_sharding(plain) is None


def test_fsdp1_is_refused_at_publish_time():
    code = textwrap.dedent(f"""
        import os, torch, torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{free_port()}")
        dist.init_process_group("gloo", rank=0, world_size=1)
        from torch.distributed.fsdp import FullyShardedDataParallel
        from transformers import AutoModelForCausalLM
        from trl_async.toy import tiny_model_path
        from trl_async.rollout.gather import model_sharding
        model = FullyShardedDataParallel(AutoModelForCausalLM.from_pretrained(tiny_model_path()),
                                         device_id=torch.device("cpu"), use_orig_params=True)
        try:
            model_sharding(model)
        except ValueError as error:
            print("REFUSED:", error)
        dist.destroy_process_group()
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REFUSED: " + FSDP1_MESSAGE in proc.stdout


@pytest.mark.parametrize(
    "fsdp_config, env, refused",
    [
        ({"version": 1}, {}, True),
        ({"version": 2}, {}, False),
        ({}, {}, False),  # transformers' default is FSDP2
        (None, {"ACCELERATE_USE_FSDP": "true"}, True),  # `accelerate launch --use_fsdp` defaults to FSDP1
        (None, {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, False),
        (None, {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, False),
    ],
)
def test_up_front_check_refuses_fsdp1_only(tmp_path, monkeypatch, fsdp_config, env, refused):
    from transformers import AutoModelForCausalLM

    from trl_async import AsyncGRPOConfig
    from trl_async.config.refusals import check_async_supported
    from trl_async.toy import tiny_model_path

    for name in ("ACCELERATE_USE_FSDP", "FSDP_VERSION", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_ZERO_STAGE"):
        monkeypatch.delenv(name, raising=False)
    fsdp = {} if fsdp_config is None else dict(fsdp=True, fsdp_config=fsdp_config)
    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **fsdp)
    # What `accelerate launch` exports, set after the arguments exist: the check reads it when the trainer is built
    # (and transformers would otherwise set DeepSpeed up process-wide).
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    if refused:
        with pytest.raises(ValueError) as info:
            check_async_supported(args, model)
        assert FSDP1_MESSAGE in str(info.value) and "async_generation=False" in str(info.value)
    else:
        check_async_supported(args, model)
