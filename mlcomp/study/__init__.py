"""The chapter's experiments as ``mlcomp study NAME``: measured figures beside the chapter's.

Each study is a module with ``run(StudyConfig) -> StudyResult`` and
``plot(StudyResult, path)``; they are imported only when asked for (a
:class:`~mlcomp.base.registry.LazyRegistry` of modules)::

    from mlcomp.study import run_study, StudyConfig
    print(run_study("hybridize", StudyConfig(quick=True)).format())
"""
from __future__ import annotations

from types import ModuleType

from mlcomp.base.errors import MlcompError
from mlcomp.base.registry import LazyRegistry
from mlcomp.study.common import Figure, StudyConfig, StudyResult, Table

# name -> (module, one-line summary)
STUDIES: dict[str, tuple[str, str]] = {
    "hybridize": ("mlcomp.study.hybridize", "the MLP called 1000/10000 times, eager vs each compiled target"),
    "asynchrony": ("mlcomp.study.asynchrony", "the same work timed without and with a barrier"),
    "memory": ("mlcomp.study.loop_memory", "a training loop's memory with and without a barrier per batch"),
    "parallelism": ("mlcomp.study.parallelism", "concurrent branches; compute overlapped with copies"),
    "roofline": ("mlcomp.study.roofline", "this machine's peaks and every op of a model on its roofline"),
}


class UnknownStudyError(MlcompError):
    """``mlcomp study NAME`` names no study."""


def _unknown(name: str, close: str | None) -> UnknownStudyError:
    return UnknownStudyError(f"there is no study named {name!r}" + (f" (did you mean {close!r}?)" if close else ""),
                             hint=f"choose one of: {', '.join(STUDIES)}")


# the module of each study, imported when the study is first asked for
_MODULES: LazyRegistry[ModuleType] = LazyRegistry(
    "study", {name: module for name, (module, _) in STUDIES.items()}, on_unknown=_unknown)


def study_module(name: str) -> ModuleType:
    return _MODULES.get(name)


def run_study(name: str, config: StudyConfig = StudyConfig()) -> StudyResult:
    return study_module(name).run(config)


def plot_study(result: StudyResult, path: str) -> None:
    study_module(result.name).plot(result, path)


__all__ = ["STUDIES", "StudyConfig", "StudyResult", "Figure", "Table", "run_study", "plot_study",
           "study_module", "UnknownStudyError"]
