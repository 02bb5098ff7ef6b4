"""Soak, the short version of benchmarks/bench_soak.py (its docstring says what is sampled and why): the tiny job,
asynchronous, as a full fine-tune and with LoRA, each in a fresh process. After the warm-up, the RSS of the trainer and
of its generation process stays within 10% of the reference sample, and nothing else grows: file descriptors, OS
threads (beyond the one-time growth of an OpenMP pool to lent cores), processes, spool files, /dev/shm entries.

The lead's full run, 1,000 steps a mode on a quiet machine: `python benchmarks/bench_soak.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "bench_soak.py")
STEPS, EVERY, WARMUP = 80, 8, 24
COUNTS = ("trainer_fds", "generator_fds", "trainer_threads", "generator_threads", "processes", "spool_files", "shm_entries")  # fmt: skip


@pytest.mark.slow
def test_a_short_soak_stays_flat(tmp_path):
    out = tmp_path / "bench_soak.json"
    cmd = [sys.executable, BENCH, "--steps", str(STEPS), "--sample-every", str(EVERY), "--warmup-steps", str(WARMUP),
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    assert out.exists(), proc.stderr[-5000:]
    runs = json.loads(out.read_text())["runs"]
    assert sorted(runs) == ["full", "lora"]
    for mode, run in runs.items():
        samples = run["samples"]
        assert [s["step"] for s in samples] == list(range(EVERY, STEPS + 1, EVERY)), mode
        # The end of the warm-up: its last three samples (one sample may sit at a dip or a transient).
        window = [s for s in samples if WARMUP - 2 * EVERY <= s["step"] <= WARMUP]
        after = [s for s in samples if s["step"] > WARMUP]
        assert len(window) == 3 and len(after) == (STEPS - WARMUP) // EVERY
        for key in ("trainer_rss_mib", "generator_rss_mib"):
            reference = sum(s[key] for s in window) / 3
            assert max(s[key] for s in after) <= 1.10 * reference, (mode, key, [s[key] for s in samples])
        last_quarter = after[-max(2, len(after) // 4) :]
        for key in COUNTS:
            pool = window[-1][key.replace("threads", "pool_growth")] if key.endswith("_threads") else 0
            allowed = max(s[key] for s in window) + pool
            assert min(s[key] for s in last_quarter) <= allowed, (mode, key, [s[key] for s in samples])
        # What the run owns in /dev/shm: its spool folder, nothing else.
        assert {s["shm_entries"] for s in samples} == {1}, mode
    assert proc.returncode == 0, proc.stdout[-3000:]  # and the benchmark's own verdict agrees
