"""The Hub repository of a push: the check on the push arguments, and what counts as a Hub id."""

from __future__ import annotations

import os


def validate_push_args(args) -> None:
    """`push_to_hub=True` needs `hub_model_id` (transformers would otherwise invent one from output_dir)."""
    if getattr(args, "push_to_hub", False) and not getattr(args, "hub_model_id", None):
        raise ValueError(
            "push_to_hub=True needs hub_model_id: the Hub repository to push to, e.g. "
            "--hub_model_id your-name/qwen2.5-0.5b-gsm8k-lora."
        )


def looks_like_hub_id(name: str | None) -> bool:
    """`name` or `org/name`, not an existing local path: what TRL's card treats as a Hub id."""
    if not name or os.path.exists(name) or name.startswith((".", "/", "~")):
        return False
    return name.count("/") <= 1 and " " not in name
