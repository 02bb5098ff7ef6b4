"""SIGTERM ends training the way Ctrl-C does: through the `finally` blocks that stop the generation process.

Python's default action for SIGTERM is to die at once, running no cleanup, and SIGTERM is how jobs are stopped:
`kill`, schedulers (SLURM, Kubernetes) and launchers (torchrun and `accelerate launch` stop every rank with it when one
rank fails). While `train()` runs, `exit_on_sigterm` turns SIGTERM into `SystemExit(143)` (128 + 15, what a shell
reports for a process killed by SIGTERM) raised in the main thread, so that the trainer stops its generation process,
removes its spool and exits non-zero, saying why.

SIGINT (Ctrl-C) needs nothing of this: Python raises `KeyboardInterrupt`, which ends `train()` through the same
`finally` blocks, and the process then exits by SIGINT. trl_async installs no SIGINT handler, so a process that
inherited SIGINT ignored (started with `&` by a non-interactive shell, e.g. a batch script) keeps ignoring it, as
POSIX intends for background jobs: `kill -INT` does nothing there, while SIGTERM still stops it.

It stays out of the way of anyone else's handling: it is installed only from the main thread (the only one Python
delivers signals to) and only where SIGTERM has its default action, so a handler set by the user (say, one that saves a
checkpoint on preemption) keeps working; the previous action is restored when `train()` returns. A second SIGTERM
during the cleanup is ignored, so that the cleanup finishes (a launcher that does not wait sends SIGKILL next; then the
spool janitor removes what is left, see `janitor`).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

logger = logging.getLogger(__name__)

SIGTERM_EXIT_CODE = 128 + signal.SIGTERM


@contextlib.contextmanager
def exit_on_sigterm(who: str):
    """Within the block, SIGTERM raises `SystemExit(SIGTERM_EXIT_CODE)` in the main thread. `who` names the process in
    the log line (e.g. "rank 1")."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    received = []

    def handler(signum, frame):
        if received:  # already stopping: let the cleanup finish
            return
        received.append(signum)
        logger.error(
            "trl_async: %s received SIGTERM: stopping its generation process and exiting with code %d (a launcher "
            "sends SIGTERM to every rank when one fails: the failing rank's error is above or below).",
            who, SIGTERM_EXIT_CODE,
        )  # fmt: skip
        raise SystemExit(SIGTERM_EXIT_CODE)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
