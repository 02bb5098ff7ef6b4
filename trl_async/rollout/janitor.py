"""The owner of a rank's spool directory when the trainer cannot clean up: a tiny process that removes it once the
trainer is gone.

The trainer removes its spool (the queue's folder in `/dev/shm`) itself on every exit it sees: a return, an exception,
Ctrl-C, SIGTERM (`RolloutPipeline.close`, `termination.exit_on_sigterm`). A trainer killed outright (SIGKILL, the OOM
killer, a launcher's escalation after its grace period) runs no code at all, and its generation process dies with it
(PR_SET_PDEATHSIG: the kernel SIGKILLs it), so neither can remove the spool. Nor should the generation process be
trusted with it: it may be the process that was killed.

The janitor can. It is a stdlib-only interpreter (`python -I -S`: no site-packages, a few MB, no torch) that

* runs in its own session, so that signals sent to the trainer's process group (Ctrl-C in a terminal; torchrun and
  accelerate stopping every rank of a failed job with `killpg`) do not reach it, and ignores SIGINT, SIGTERM and SIGHUP
  anyway;
* blocks reading a pipe whose only writer is the trainer. The read returns when the trainer closes the pipe (after its
  own cleanup: nothing is left to do) or dies, however it dies: the kernel closes a dead process's descriptors;
* then removes the spool, retrying while a dying generation process may still drop a file into it, and exits.

So no `/dev/shm` entry outlives a trainer killed by any signal, and the janitor itself lives no longer than the trainer
plus the removal. One janitor per spool (per rank).
"""

from __future__ import annotations

import logging
import subprocess
import sys

logger = logging.getLogger(__name__)

# Run by `python -I -S -c`: the standard library only, nothing that could fail to import.
_JANITOR_SOURCE = """
import os, shutil, signal, sys, time
for name in ("SIGINT", "SIGTERM", "SIGHUP"):
    signal.signal(getattr(signal, name), signal.SIG_IGN)
path = sys.argv[1]
sys.stdin.buffer.read()  # returns at end of file: the trainer closed the pipe, or died
deadline = time.monotonic() + 60.0
while os.path.lexists(path) and time.monotonic() < deadline:
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):
        time.sleep(0.05)  # a file appeared while the folder was emptied: its writer is still exiting
"""


class SpoolJanitor:
    """Removes `path` when the trainer process that created this object is gone (see the module docstring)."""

    def __init__(self, path: str):
        self.path = path
        self.process: subprocess.Popen | None = None
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _JANITOR_SOURCE, path],
                stdin=subprocess.PIPE,  # non-inheritable: only this process holds the write end
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as error:
            logger.warning(
                "trl_async: could not start the spool janitor (%s): if this process is killed with SIGKILL, remove %s "
                "by hand.", error, path
            )  # fmt: skip

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def release(self, timeout: float = 10.0) -> None:
        """Call after removing the spool yourself: the janitor finds nothing left and exits; waits for it."""
        if self.process is None:
            return
        process, self.process = self.process, None
        try:
            process.stdin.close()
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
