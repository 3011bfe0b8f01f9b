"""The typed configuration of one TVM build (:func:`mlcomp.targets.tvm.build.build`).

    >>> BuildConfig(tune_trials=64, work_dir="tvm-db").tuned
    True
    >>> BuildConfig(kernels=False).kernels_for("cpu")     # a pure TVM build
    False
    >>> BuildConfig().kernels_for("cpu"), BuildConfig().kernels_for("cuda")
    (True, False)
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from mlcomp.targets.options import LogLevel
from mlcomp.targets.tvm.offload.policy import ALL_FUSIONS, Fusion, rule

__all__ = ["BuildConfig", "RECORDS"]

RECORDS = "database_tuning_record.json"   # MetaSchedule's JSONDatabase in a tuning folder


@dataclass(frozen=True)
class BuildConfig:
    """What a TVM build does; every field has the default an untuned CPU compile uses.

    ``device``: ``cpu`` (LLVM for this host) or ``cuda``.  ``tune_trials``: the MetaSchedule budget of a
    search (0: untuned); ``work_dir``: its database folder (``None``: a private folder removed after the
    build).  ``build_timeout``/``run_timeout``: seconds per MetaSchedule candidate build/measurement.
    ``log_level``: console verbosity.  ``worker_torch``: let MetaSchedule workers import torch.
    ``kernels``: send float32 conv2d/matmul/linear (and ``fusions``) to torch's kernels (``None``: on
    for CPU only; ``False``: a pure TVM build, loadable by TVM alone).  ``fusions``: the larger rewrites
    the offload also applies; ``view_min_elements``: the smallest layout copy moved into a torch call.
    ``small_gemms``: time the offloaded small GEMMs both ways and keep the faster; ``threads``: torch
    threads for that probe (``None``: torch's current count).  ``deterministic``: neither timing probe
    runs (GEMMs stay torch calls, a tuned build is not raced: the untuned one is kept).
    """

    device: str = "cpu"
    tune_trials: int = 0
    work_dir: str | None = None
    build_timeout: float = 180.0
    run_timeout: float = 60.0
    log_level: LogLevel = LogLevel.WARNING
    worker_torch: bool = False
    kernels: bool | None = None
    fusions: frozenset[Fusion] = ALL_FUSIONS
    view_min_elements: int = rule("views").min_size
    small_gemms: bool = True
    threads: int | None = None
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"unsupported device {self.device!r} (expected 'cpu' or 'cuda')")
        if self.tune_trials < 0:
            raise ValueError(f"tune_trials={self.tune_trials} must be >= 0")

    @property
    def uses_database(self) -> bool:
        """Tuning now, or applying the records of a ``work_dir`` that holds some."""
        return self.tune_trials > 0 or bool(self.work_dir and os.path.exists(os.path.join(self.work_dir, RECORDS)))

    @property
    def tuned(self) -> bool:
        return self.tune_trials > 0

    def kernels_for(self, device: str) -> bool:
        """Whether the build calls torch's kernels (default: on CPU)."""
        return device == "cpu" if self.kernels is None else self.kernels

    def replace(self, **changes: Any) -> "BuildConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_options(cls, options: Any, device: str, work_dir: str | None) -> "BuildConfig":
        """The build a target compile with :class:`~mlcomp.targets.options.CompileOptions` ``options`` asks for."""
        return cls(device=device, tune_trials=options.tune_trials, work_dir=work_dir, threads=options.threads,
                   build_timeout=options.tune_build_timeout, run_timeout=options.tune_run_timeout,
                   log_level=options.log_level, worker_torch=options.tune_worker_torch,
                   deterministic=options.deterministic)
