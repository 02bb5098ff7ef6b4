"""A TRL-documentation-style GRPO script runs unchanged except for the trainer's class name."""

import json
import os
import subprocess
import sys
import time
import uuid

from trl_async.toy import make_arithmetic_dataset, tiny_model_path

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "trl_docs_grpo.py")


def children_of(pid: int) -> set[int]:
    found = set()
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.update(int(child) for child in f.read().split())
    except OSError:
        pass
    return found


def processes_with_token(token: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if token.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


def test_trl_docs_script_with_swapped_class_name(tmp_path):
    source = open(SCRIPT).read()
    swapped = source.replace(
        "from trl import GRPOConfig, GRPOTrainer", "from trl import GRPOConfig\nfrom trl_async import AsyncGRPOTrainer"
    ).replace("trainer = GRPOTrainer(", "trainer = AsyncGRPOTrainer(")
    assert swapped.count("AsyncGRPOTrainer") == 2  # the import and the constructor: nothing else changed
    script = tmp_path / "script.py"
    script.write_text(swapped)
    data_file = tmp_path / "prompts.jsonl"
    make_arithmetic_dataset(num_train=64, num_test=8)["train"].to_json(str(data_file))
    out = tmp_path / "out"
    token = f"trl-async-test-{uuid.uuid4()}"  # inherited by every process the script starts
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRL_ASYNC_TEST_TOKEN": token}
    proc = subprocess.Popen(
        [sys.executable, str(script), tiny_model_path(), str(data_file), str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    children, deadline = set(), time.time() + 600
    while proc.poll() is None and time.time() < deadline:
        children |= children_of(proc.pid)
        time.sleep(0.2)
    output = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, output[-4000:]
    result = json.loads((out / "result.json").read_text())
    assert result["trainer"] == "AsyncGRPOTrainer"
    logged = [h for h in result["log_history"] if "reward" in h]
    assert len(logged) == 3
    assert all("async/staleness_mean" in h for h in logged)
    # The generation process was a real child OS process, and nothing the script started outlives it.
    assert children, "the script started no child process"
    assert processes_with_token(token) == []
