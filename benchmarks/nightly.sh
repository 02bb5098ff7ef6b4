#!/usr/bin/env bash
# The nightly tests: the longest end-to-end runs, marked `nightly` as well as `slow`. CI's slow suite leaves them out
# (`-m "slow and not nightly"`) so that `.ci/run` stays within its hour; run them here, nightly or before a release,
# on a quiet machine, in the project's environment. Each still passes or fails as a test does.
#
#   bash benchmarks/nightly.sh              # every nightly test, with each one's time (pytest --durations=0)
#   bash benchmarks/nightly.sh -k memory    # any further pytest arguments, e.g. -k to pick among them
#   bash benchmarks/nightly.sh --help       # this text
#
# They are (`python -m pytest -m nightly --collect-only -q` lists them), with their time on the 2-core machine:
#   tests/test_long_runs.py::test_the_main_job_runs_300_steps_on_two_processes          ~150 s
#   tests/test_backends.py::test_behaviour_logprobs_memory_at_64_rows_and_64_tokens     ~120 s
#   tests/test_faults.py::test_interrupts_at_random_moments[last_four]                   ~65 s
#   tests/test_resume_and_failures.py::test_killed_generator_twenty_times_at_random_moments[rest]   ~45 s
# CI keeps a shorter test of each guarantee: the TRL-docs-style script over 300 steps on two processes
# (tests/test_long_runs.py, with the collective check on), the memory check at 4 rows x 32 tokens
# (tests/test_backends.py), the first four of the eight random interrupts (tests/test_faults.py) and the first eight
# of the twenty-one generator kills (tests/test_resume_and_failures.py).
set -euo pipefail
case "${1:-}" in
-h | --help)
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    echo "usage: bash benchmarks/nightly.sh [pytest arguments, e.g. -k NAME]"
    exit 0
    ;;
esac
cd "$(dirname "$0")/.."
exec env OMP_NUM_THREADS=1 python -m pytest -m nightly --durations=0 "$@"
