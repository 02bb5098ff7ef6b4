"""Old import paths, kept working for a while: every module and name that moved, in one table.

0.x has no published release, so these go in 0.2.0 (`REMOVAL_VERSION`). Importing an old path warns (`FutureWarning`,
naming the new path and the version that removes it) and gives the objects of the new home under the old name, so
`isinstance` and identity hold. `install()` (run by `trl_async/__init__.py`) adds a finder for the old
module paths to `sys.meta_path`; `moved_attribute` serves a moved name of a module that still exists
(`trl_async.data`). `tests/test_compat.py` checks that each old path warns and gives the new object.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

REMOVAL_VERSION = "0.2.0"

# Old module path -> new module path (or paths: the old module's names now live in several; the first is its main
# home, and the one `python -m old.path` runs).
MOVED_MODULES: dict[str, str | tuple[str, ...]] = {
    "trl_async.grpo": "trl_async.trainers.grpo",
    "trl_async.ppo": "trl_async.trainers.ppo",
    "trl_async.losses": "trl_async.algorithms.m2po",
    "trl_async.importance": "trl_async.algorithms.importance",
    "trl_async.ppo_math": "trl_async.algorithms.ppo",
    "trl_async.assets": "trl_async.toy",
    "trl_async.unsupported": "trl_async.config.refusals",
    "trl_async.validation": "trl_async.config.inputs",
    "trl_async.checkpoints": "trl_async.trainers.checkpoints",
    "trl_async.shared_prompt": "trl_async.trainers.forward",
    "trl_async.trainers.trl_contract": "trl_async.trl_contract",
    "trl_async.rollout.client": "trl_async.rollout.pipeline",
    "trl_async.rollout.vllm_backend": (
        "trl_async.rollout.backends.vllm_server",
        "trl_async.rollout.backends.vllm",
        "trl_async.rollout.backends.vllm_sampling",
        "trl_async.rollout.backends.vllm_weights",
        "trl_async.rollout.backends.base",
    ),
}

# (old module, name) -> (new module, new name), for names that left a module that still exists or were renamed.
MOVED_NAMES = {
    ("trl_async.data", "SUPPORTED_OPS"): ("trl_async.toy.arithmetic", "SUPPORTED_OPS"),
    ("trl_async.data", "arithmetic_prompt"): ("trl_async.toy.arithmetic", "arithmetic_prompt"),
    ("trl_async.data", "arithmetic_solution"): ("trl_async.toy.arithmetic", "arithmetic_solution"),
    ("trl_async.data", "make_arithmetic_dataset"): ("trl_async.toy.arithmetic", "make_arithmetic_dataset"),
    ("trl_async.rollout", "RolloutClient"): ("trl_async.rollout.pipeline", "RolloutPipeline"),
    ("trl_async.rollout.client", "RolloutClient"): ("trl_async.rollout.pipeline", "RolloutPipeline"),
}


def _warn(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(
        f"{old} moved to {new}; the old path is removed in trl_async {REMOVAL_VERSION}.",
        FutureWarning,
        stacklevel=stacklevel,
    )


class _MovedModuleLoader(importlib.abc.Loader):
    def __init__(self, old: str, new: str | tuple[str, ...]):
        self.old, self.new = old, (new,) if isinstance(new, str) else new

    def create_module(self, spec):
        return None  # a fresh module object under the old name (the new modules' own specs stay untouched)

    def exec_module(self, module):
        _warn(self.old, " and ".join(self.new), stacklevel=3)  # importlib's frames are skipped by `warnings`
        # The same objects under the old name: identity and `isinstance` hold. The main home last: it wins a clash.
        for new in reversed(self.new):
            names = vars(importlib.import_module(new))
            module.__dict__.update({k: v for k, v in names.items() if not k.startswith("__") or k == "__all__"})
        for (old_module, name), (new_module, new_name) in MOVED_NAMES.items():  # renamed in the move
            if old_module == self.old:
                setattr(module, name, getattr(importlib.import_module(new_module), new_name))
        module.__doc__ = f"Moved to `{self.new[0]}` (removed in trl_async {REMOVAL_VERSION})."

    # `python -m old.path`: runs the main new home as the script, with the warning.
    def is_package(self, fullname) -> bool:
        return False

    def get_code(self, fullname):
        source = (
            "import runpy\n"
            "from trl_async import _compat\n"
            f"_compat._warn({self.old!r}, {self.new[0]!r}, stacklevel=2)\n"
            f"runpy.run_module({self.new[0]!r}, run_name='__main__', alter_sys=True)\n"
        )
        return compile(source, f"<{self.old}: moved to {self.new[0]}>", "exec")


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED_MODULES.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _MovedModuleLoader(fullname, new))


_FINDER = _MovedModuleFinder()


def install() -> None:
    """Serve the old module paths (idempotent). First in `sys.meta_path`: an old path must never resolve to a stale
    file of that name (an editable install's finder maps the package's submodules by name)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def moved_attribute(module: str, name: str):
    """A moved name asked of `module` (its PEP 562 `__getattr__` calls this): the object from its new home, with the
    warning; AttributeError for anything else."""
    target = MOVED_NAMES.get((module, name))
    if target is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    _warn(f"{module}.{name}", f"{target[0]}.{target[1]}", stacklevel=4)
    return getattr(importlib.import_module(target[0]), target[1])


__all__ = ["MOVED_MODULES", "MOVED_NAMES", "REMOVAL_VERSION", "install", "moved_attribute"]
