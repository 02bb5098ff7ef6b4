"""Source of the module the harness drops next to the swapped copy of TRL's test file, as `_trl_compat_swap.py`.

The swapped test file imports `GRPOTrainer` from it instead of from `trl`. It is a thin subclass of
`trl_async.AsyncGRPOTrainer` that changes nothing but records, after every `train()` (returned or raised), which
`async/*` metrics reached `trainer.state.log_history`. `AsyncGRPOTrainer` logs them only for batches that came from
its background generation process, so a `train()` that logged none ran TRL's synchronous fallback (or never
generated).
"""

SWAP_MODULE_SOURCE = '''\
"""Written by trl_async's benchmarks/trl_compat harness: GRPOTrainer swapped for trl_async.AsyncGRPOTrainer."""

import json
import os

from trl_async import AsyncGRPOTrainer


def _current_test():
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]


class GRPOTrainer(AsyncGRPOTrainer):
    """`AsyncGRPOTrainer`, plus a record of whether each `train()` generated asynchronously."""

    def train(self, *args, **kwargs):
        error = None
        try:
            return super().train(*args, **kwargs)
        except BaseException as exc:
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            raise
        finally:
            state = getattr(self, "state", None)
            history = list(getattr(state, "log_history", None) or [])
            async_keys = sorted({key for entry in history for key in entry if key.startswith("async/")})
            record = {
                "nodeid": _current_test(),
                "async_keys": async_keys,
                "log_entries": len(history),
                "global_step": getattr(state, "global_step", None),
                "async_generation": getattr(getattr(self, "args", None), "async_generation", None),
                "error": error,
            }
            path = os.environ.get("TRL_COMPAT_TRAIN_LOG")
            if path:
                with open(path, "a", encoding="utf-8") as handle:
                    handle.write(json.dumps(record) + "\\n")
'''
