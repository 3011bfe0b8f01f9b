"""One seed for every run compared with another: eager and the artifact draw the same random numbers.

:func:`seeded` runs a block from a fixed seed and restores the generators after it: the
graph's random ops (dropout, ``rand_like``) draw the same numbers in the eager reference,
in each pass's check and in every run of the artifact compared with them (after a compile,
after a save, in ``mlcomp.load(verify=True)`` and ``mlcomp run --verify``)::

    >>> with seeded():
    ...     a = torch.rand(3)
    >>> with seeded():
    ...     b = torch.rand(3)
    >>> bool(torch.equal(a, b))
    True

:func:`seed_everything` seeds the global generators for good (a deterministic compile).
"""
from __future__ import annotations

import contextlib
import random
from typing import Iterator

import torch

__all__ = ["DETERMINISTIC_SEED", "VERIFY_SEED", "seed_everything", "seeded"]

DETERMINISTIC_SEED = 0
VERIFY_SEED = 0          # the seed eager's reference and every artifact run compared with it start from


@contextlib.contextmanager
def seeded(seed: int = VERIFY_SEED) -> Iterator[None]:
    """torch's CPU generator and, once CUDA is initialised, every CUDA device's at ``seed``; each restored after.

    CUDA's generators are seeded and forked only when CUDA is initialised (touching them would
    initialise it), and nothing is queued for a later initialisation: a process that starts CUDA
    after the block keeps whatever seed it set itself.  A CUDA artifact or model has initialised
    CUDA before it runs here (its weights are on the device).
    """
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.random.default_generator.manual_seed(seed)
        for device in devices:
            torch.cuda.default_generators[device].manual_seed(seed)
        yield


def seed_everything(seed: int) -> None:
    """Seed torch's, Python's and NumPy's global generators (a deterministic compile draws nothing unseeded)."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
