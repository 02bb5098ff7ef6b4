"""Old import paths (`trl_async._compat`): each one still works, warns with its new home and the removal version, and
gives the very objects of the new home."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

from trl_async import _compat


@pytest.mark.parametrize(("old", "new"), sorted((old, (n,) if isinstance(n, str) else n)
                                                 for old, n in _compat.MOVED_MODULES.items()))  # fmt: skip
def test_an_old_module_path_warns_and_gives_the_new_objects(old, new):
    # A fresh interpreter: a path imported once is cached in sys.modules and would not warn again.
    code = (
        "import importlib, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    old = importlib.import_module({old!r})\n"
        f"for home in {list(new)!r}:\n"
        "    new = importlib.import_module(home)\n"
        "    names = [n for n in getattr(new, '__all__', vars(new)) if not n.startswith('_')]\n"
        "    assert names and all(getattr(old, n) is getattr(new, n) for n in names), ('not the same objects', home)\n"
        "messages = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]\n"
        "print('|'.join(messages))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = f"{old} moved to {' and '.join(new)}; the old path is removed in trl_async {_compat.REMOVAL_VERSION}."
    assert expected in proc.stdout.split("|") or expected in proc.stdout, proc.stdout


@pytest.mark.parametrize(("old", "new"), sorted(_compat.MOVED_NAMES.items()))
def test_a_moved_name_warns_and_is_the_new_object(old, new):
    (old_module, old_name), (new_module, new_name) = old, new
    if old_module in _compat.MOVED_MODULES:  # a name renamed with its module: importing the module warns
        with pytest.warns(FutureWarning, match=rf"{old_module} moved to"):
            module = importlib.import_module(old_module)
        assert getattr(module, old_name) is getattr(importlib.import_module(new_module), new_name)
        return
    module = importlib.import_module(old_module)
    with pytest.warns(FutureWarning, match=rf"{old_module}\.{old_name} moved to {new_module}\.{new_name}.*0\.2\.0"):
        value = getattr(module, old_name)
    assert value is getattr(importlib.import_module(new_module), new_name)


def test_unknown_names_are_still_attribute_errors():
    import trl_async.data

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no_such_name"):
            trl_async.data.no_such_name  # noqa: B018


def test_no_module_of_the_package_is_a_shim():
    """The old paths live in `_compat` only: none of them is a file of the package any more."""
    import os

    import trl_async

    root = os.path.dirname(os.path.dirname(trl_async.__file__))
    for old in _compat.MOVED_MODULES:
        path = os.path.join(root, *old.split("."))
        assert not os.path.exists(path + ".py") and not os.path.isdir(path), old


def test_python_dash_m_on_an_old_path_runs_the_new_module(tmp_path):
    """`python -m trl_async.rollout.vllm_backend` (the documented server launcher before the move) still starts the
    launcher, now `trl_async.rollout.backends.vllm_server`: its `--help` (vLLM's own help where vLLM is installed; the
    launcher's refusal naming vLLM where it is not) comes from the new module, after the warning."""
    proc = subprocess.run(
        [sys.executable, "-W", "always::FutureWarning", "-m", "trl_async.rollout.vllm_backend", "--help"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert "trl_async.rollout.vllm_backend moved to trl_async.rollout.backends.vllm_server" in output, output[-2000:]
    new = subprocess.run(
        [sys.executable, "-m", "trl_async.rollout.backends.vllm_server", "--help"], capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == new.returncode
    assert new.stdout.strip() and new.stdout.strip() in proc.stdout
