"""M2PO (Zheng et al. 2025, arXiv:2510.01161): the module `trl_async.algorithms.m2po`, now in `fast.py`."""

from .fast import *  # noqa: F403
from .fast import __all__  # noqa: F401
