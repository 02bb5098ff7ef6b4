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
import json
import logging
import os
import re
import shutil
from typing import Any

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


# ------------------------------------------------------------------------------------------------------- rollout state
# The prompt stream's position of every rank, written beside Trainer's files by `AsyncRolloutMixin._save_checkpoint`
# and read back here only (`read_rollout_state`), by the resume checks and by `_load_optimizer_and_scheduler`.
ROLLOUT_STATE_FILE = "trl_async_rollout.json"
# Settings that decide which rows the prompt stream hands out: a checkpoint's stream position means nothing under others.
RUN_GEOMETRY = ("num_processes", "generation_batch_size", "num_generations", "seed", "shuffle_dataset", "dataset_rows")
# Model config entries that fix the shapes of the weights: a checkpoint written for other values cannot be loaded.
WEIGHT_SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
)


def write_rollout_state(states: list[dict], checkpoint_dir: str) -> None:
    """Every rank's `RolloutPipeline.checkpoint_state()` (gathered, in rank order) into the checkpoint."""
    with open(os.path.join(checkpoint_dir, ROLLOUT_STATE_FILE), "w") as f:
        json.dump({"ranks": states}, f, indent=2)


def rank_rollout_state(checkpoint_dir: str, process_index: int) -> dict | None:
    """This rank's saved stream state, or None when the checkpoint has none (written by a synchronous run)."""
    ranks = read_rollout_state(checkpoint_dir)
    if ranks is None:
        return None
    if process_index >= len(ranks):
        raise ValueError(
            f"The checkpoint {checkpoint_dir} was written by {len(ranks)} process(es); resuming it with more "
            "processes would change every rank's prompt stream. Resume with the same number of processes."
        )
    return ranks[process_index]


def run_geometry(args, num_processes: int, dataset: Any) -> dict:
    """What decides the prompt stream's rows: saved with the stream's position, compared when resuming."""
    return {
        "num_processes": int(num_processes),
        "generation_batch_size": int(args.generation_batch_size),
        "num_generations": int(args.num_generations),
        "seed": int(args.seed),
        "shuffle_dataset": bool(getattr(args, "shuffle_dataset", True)),
        "dataset_rows": len(dataset) if hasattr(dataset, "__len__") else None,
    }


def read_rollout_state(checkpoint_dir: str) -> list[dict] | None:
    """The per-rank states of `trl_async_rollout.json` in `checkpoint_dir` (None when the file is absent), checked:
    a file that is not what the trainer writes is an error that names it."""
    path = os.path.join(checkpoint_dir, ROLLOUT_STATE_FILE)
    if not os.path.exists(path):
        return None
    todo = (
        "Resume from another checkpoint, or delete the file to resume with the prompt stream restarted from its "
        "first batch."
    )
    try:
        with open(path) as f:
            content = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} cannot be read ({type(error).__name__}: {error}). {todo}") from error
    ranks = content.get("ranks") if isinstance(content, dict) else None
    if (
        not isinstance(ranks, list)
        or not ranks
        or not all(isinstance(r, dict) and isinstance(r.get("stream_position"), int) for r in ranks)
    ):
        raise ValueError(
            f"{path} is not a trl_async rollout state (expected {{'ranks': [{{'stream_position': int, ...}}, ...]}}). "
            f"{todo}"
        )
    return ranks


def check_resume_checkpoint(checkpoint_dir: str, model: Any, current_geometry: dict | None) -> None:
    """A checkpoint to resume from was written by a run like this one: its rollout state is readable, its prompt
    stream was laid out by the same settings, and its weights fit the model."""
    ranks = read_rollout_state(checkpoint_dir)
    saved = (ranks[0].get("run") if ranks else None) or None
    if saved and current_geometry:
        differences = [
            f"{key}={saved[key]!r} there, {current_geometry[key]!r} now"
            for key in RUN_GEOMETRY
            if key in saved and saved[key] != current_geometry.get(key)
        ]
        if differences:
            raise ValueError(
                f"{os.path.join(checkpoint_dir, ROLLOUT_STATE_FILE)} was written by a run with other settings "
                f"({'; '.join(differences)}): its prompt stream position means other rows under these. Resume with "
                "the settings of that run, or start a new run (a new output_dir, no resume_from_checkpoint)."
            )
    config_path = os.path.join(checkpoint_dir, "config.json")
    config = getattr(model, "config", None)
    if config is None or not os.path.exists(config_path) or hasattr(model, "peft_config"):
        return
    try:
        with open(config_path) as f:
            saved_config = json.load(f)
    except (OSError, json.JSONDecodeError):
        return  # transformers reports an unreadable checkpoint itself
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    saved_text = saved_config.get("text_config", saved_config)
    differences = [
        f"{key}={saved_text[key]!r} there, {getattr(text, key)!r} in the model"
        for key in WEIGHT_SHAPE_KEYS
        if key in saved_text and hasattr(text, key) and saved_text[key] != getattr(text, key)
    ]
    if differences:
        raise ValueError(
            f"resume_from_checkpoint={checkpoint_dir!r} holds the weights of another model ({'; '.join(differences)}). "
            "Resume with the model that run trained, or point resume_from_checkpoint at a checkpoint of this model."
        )


def resume_checkpoint_dir(resume_from_checkpoint: Any, output_dir: str) -> str | None:
    """The folder `Trainer.train(resume_from_checkpoint=...)` resumes from (`True`: the newest complete one in
    `output_dir`, as `train` resolves it, never transformers' newest folder), or None (no resume, or nothing to resume
    from: transformers reports that itself)."""
    if resume_from_checkpoint is True:
        return last_complete_checkpoint(output_dir)
    if isinstance(resume_from_checkpoint, str) and os.path.isdir(resume_from_checkpoint):
        return resume_from_checkpoint
    return None


def check_resume(trainer, resume_from_checkpoint: Any) -> None:
    """What `AsyncGRPOTrainer.train` checks before resuming (before transformers loads the checkpoint)."""
    checkpoint = resume_checkpoint_dir(resume_from_checkpoint, trainer.args.output_dir)
    if checkpoint is None:
        return
    geometry = run_geometry(trainer.args, trainer.accelerator.num_processes, trainer.train_dataset)
    check_resume_checkpoint(checkpoint, trainer.accelerator.unwrap_model(trainer.model), geometry)
