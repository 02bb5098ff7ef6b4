"""Complete and partial checkpoints: an interrupted save is never mistaken for a complete checkpoint.

transformers' `Trainer._save_checkpoint` (5.x) writes straight into `checkpoint-N`: the model, the optimizer, scheduler
and RNG states (each rank its own), then `trainer_state.json`, then deletes older checkpoints beyond
`save_total_limit`; `get_last_checkpoint`, which `resume_from_checkpoint=True` uses, returns the highest N whether or
not its save finished. A run stopped mid-save (Ctrl-C, SIGTERM, SIGKILL, a full disk) thus leaves a folder that looks
like the newest checkpoint, and a `save_total_limit` of 1 may already have deleted the complete one before it.

What the trainers' `_save_checkpoint` (`trainers.engine.AsyncRolloutMixin`) does instead:

1. `begin_save`: before the first file, the main process writes a marker file *beside* the folder,
   `checkpoint-N.incomplete` (beside, not inside: a checkpoint pushed to the Hub mid-save must not carry it, and
   transformers' own globbing only looks at folders).
2. Trainer's save, with its rotation of older checkpoints held back; then trl_async's files (the prompt stream's
   position; the critic is written with the model), then a barrier: every rank has written its files.
3. `finish_save`: the marker is removed (one atomic unlink). Only then are older checkpoints rotated away.

A checkpoint is complete when it has `trainer_state.json` and no marker. Checkpoints written by TRL, transformers or
earlier versions of trl_async have no marker and count as complete. `resume_from_checkpoint=True` resumes from the
newest complete checkpoint (`last_complete_checkpoint`); an explicit path to a partial one is an error that names the
newest complete one (`check_resumable`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

logger = logging.getLogger(__name__)

TRAINER_STATE_FILE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME: the last file Trainer writes
INCOMPLETE_SUFFIX = ".incomplete"
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed (a full disk, a read-only folder): the message names the folder."""


def incomplete_marker(folder: str) -> str:
    return os.path.normpath(folder) + INCOMPLETE_SUFFIX


def begin_save(folder: str) -> None:
    """Mark `folder` as being written (main process, before any file of it is written)."""
    os.makedirs(os.path.dirname(os.path.normpath(folder)) or ".", exist_ok=True)
    with open(incomplete_marker(folder), "w") as f:
        f.write(
            f"The save of {os.path.basename(os.path.normpath(folder))} did not finish (interrupted, or a write "
            "failed): trl_async does not resume from it. Delete both when you no longer need them.\n"
        )


def finish_save(folder: str) -> None:
    """Mark `folder` complete (main process, after every rank wrote its files)."""
    os.unlink(incomplete_marker(folder))


def rotate(output_dir: str, save_total_limit: int | None, best_model_checkpoint: str | None) -> None:
    """Trainer's rotation (its `_save_checkpoint` call, deferred to after `finish_save`), then the markers of partial
    checkpoints it deleted."""
    rotate_checkpoints(
        output_dir=output_dir,
        save_total_limit=save_total_limit,
        best_model_checkpoint=best_model_checkpoint,
        use_mtime=True,
    )
    for name in os.listdir(output_dir):
        if name.endswith(INCOMPLETE_SUFFIX) and _CHECKPOINT.match(name[: -len(INCOMPLETE_SUFFIX)]):
            if not os.path.isdir(os.path.join(output_dir, name[: -len(INCOMPLETE_SUFFIX)])):
                os.unlink(os.path.join(output_dir, name))


def is_complete_checkpoint(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, TRAINER_STATE_FILE)) and not os.path.lexists(incomplete_marker(folder))


def checkpoints_by_step(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of the `checkpoint-N` folders in `output_dir`, oldest first (as `get_last_checkpoint` orders)."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT.match(name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(match.group(1)), os.path.join(output_dir, name)))
    return sorted(found)


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest complete checkpoint in `output_dir` (None if there is none); partial ones are skipped, with a
    warning."""
    for _, path in reversed(checkpoints_by_step(output_dir)):
        if is_complete_checkpoint(path):
            return path
        logger.warning("trl_async: skipping %s: its save did not finish (interrupted, or a write failed).", path)
    return None


def check_resumable(checkpoint: str) -> None:
    """Raise if `checkpoint` (a path given as `resume_from_checkpoint`) is a partial checkpoint."""
    if not os.path.isdir(checkpoint) or is_complete_checkpoint(checkpoint):
        return  # a missing folder is transformers' error to report
    newest = last_complete_checkpoint(os.path.dirname(os.path.normpath(checkpoint)))
    reason = (
        f"{incomplete_marker(checkpoint)} says its save did not finish"
        if os.path.lexists(incomplete_marker(checkpoint))
        else f"it has no {TRAINER_STATE_FILE}, the last file a save writes"
    )
    raise ValueError(
        f"resume_from_checkpoint={checkpoint!r} is a partial checkpoint: {reason} (the run was interrupted or a write "
        f"failed while saving it). Resume from "
        + (f"{newest!r}, the newest complete checkpoint" if newest else "a complete checkpoint")
        + ", or pass resume_from_checkpoint=True to pick the newest complete one."
    )


@contextlib.contextmanager
def naming_failed_writes(folder: str, run_dir: str):
    """Re-raise an error from writing checkpoint `folder` as `CheckpointSaveError`, naming the folder (torch's and
    safetensors' write errors name no file) and what is left."""
    try:
        yield
    except Exception as error:
        previous = last_complete_checkpoint(run_dir)
        try:
            free = f" ({shutil.disk_usage(run_dir).free / 2**20:.1f} MiB free on its disk)"
        except OSError:
            free = ""
        intact = (
            f"the previous complete checkpoint, {previous}, is intact." if previous else "there is no earlier one."
        )
        raise CheckpointSaveError(
            f"Saving the checkpoint {folder} failed: {type(error).__name__}: {error}. If the disk is full{free} or the "
            f"folder is not writable, free space or choose another output_dir. {folder} stays marked incomplete and is "
            f"never resumed from; {intact}"
        ) from error
