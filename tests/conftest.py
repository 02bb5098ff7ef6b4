import os

# Subprocesses (training scripts under `accelerate launch`, `python -c` probes) import `tests.support` and this
# checkout's `trl_async` like the tests do: the repository root first on their path.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])

# Two processes (trainer + generator, or two ranks) share two cores in CI: one thread each avoids them fighting.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import pytest  # noqa: E402  (after the environment above, which the imports below read)


@pytest.fixture(scope="module")
def tokenizer():
    """The bundled tiny model's tokenizer. A test module that needs another one defines its own `tokenizer`."""
    from tests.support.trainer_utils import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def dataset():
    """256 rows of the arithmetic task (seed 1), the training set most trainer tests share. A test module that needs
    another one defines its own `dataset`."""
    from trl_async.toy import make_arithmetic_dataset

    return make_arithmetic_dataset(num_train=256, num_test=8, seed=1)["train"]
