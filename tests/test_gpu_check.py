"""`benchmarks/gpu_check.sh`, the prepared check that runs when a GPU is lent, keeps working between such loans: its
`--cpu-smoke` mode runs the same plumbing (every section, the same Python, the summary) at tiny sizes on the CPU, with
the CUDA-only parts skipped, and must finish with every section that can run here passing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_the_gpu_check_script_runs_on_the_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), "--cpu-smoke"], env=env,
                          capture_output=True, text=True, timeout=1500, cwd=ROOT)  # fmt: skip
    log = (tmp_path / "gpu_check.log").read_text() if (tmp_path / "gpu_check.log").exists() else ""
    assert proc.returncode == 0, (proc.stdout + proc.stderr + log)[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    sections = summary["sections"]
    assert set(sections) == {"env", "m2po_cuda", "reward_sync", "throughput", "sharded"}
    assert sections["env"].get("rc") == 0, sections["env"]
    # Every section ran to its end (none timed out or crashed), and those that run on a CPU passed.
    for name, section in sections.items():
        assert section.get("rc") == 0, (name, section, log[-3000:])
    assert summary["ok"]["throughput"] is True, (sections["throughput"], log[-3000:])
    # Without CUDA the CUDA-only sections say why they were skipped, and claim no result (tests/test_sharded.py runs
    # FSDP2 and ZeRO-3 on CPU processes).
    for name in ("m2po_cuda", "reward_sync", "sharded"):
        assert summary["ok"][name] is None and "CUDA" in sections[name].get("skipped", ""), (name, sections[name])
