"""Model cards for trl_async trainers, and the files the recipe leaves beside them for the card to report.

Read in this order:

1. `card.py`: the card itself -- `CardSummary` (everything the card shows), `summarize_trainer` (gathers it from a
   trainer), `build_model_card` / `save_model_card`, and `ModelCardMixin`, which makes every trl_async trainer write
   this card when it pushes or checkpoints.
2. `template.py`: the card's Jinja template and the citations it prints.
3. `results.py`: what a run leaves for the card to report: `eval.json` (`write_eval_results` / `read_eval_results`),
   the plot's file name, and the summaries of the logged rewards and metrics.
4. `push.py`: the push arguments' check (`validate_push_args`) and what counts as a Hub id (`looks_like_hub_id`).
"""

from .card import TRAINER_KINDS, CardSummary, ModelCardMixin, build_model_card, save_model_card, summarize_trainer
from .push import looks_like_hub_id, validate_push_args
from .results import (
    EVAL_RESULTS_FILE,
    PLOT_FILE,
    metric_summaries,
    read_eval_results,
    reward_summary,
    write_eval_results,
)

__all__ = [
    "TRAINER_KINDS",
    "EVAL_RESULTS_FILE",
    "PLOT_FILE",
    "CardSummary",
    "ModelCardMixin",
    "build_model_card",
    "summarize_trainer",
    "save_model_card",
    "reward_summary",
    "metric_summaries",
    "read_eval_results",
    "write_eval_results",
    "validate_push_args",
    "looks_like_hub_id",
]
