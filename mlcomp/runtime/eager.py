"""The runtimes of ``--fallback eager``: generated torch code for a region, and regions run in turn.

:class:`EagerRuntime` runs a graph as the torch code :func:`mlcomp.runtime.codegen.to_fx`
generates; :class:`PartitionedRuntime` runs regions one after another, values flowing
between them by IR node name.  :mod:`mlcomp.targets.fallback` splits a graph into regions
and builds them.  A saved partitioned artifact holds one sub-folder per region (``part0/``…),
each with its own payload; eager regions are saved as ExportedPrograms (``model.pt2``),
loadable with ``torch.export.load``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from mlcomp.base.quiet import quiet_torch
from mlcomp.ir import Graph
from mlcomp.runtime.artifact import RuntimeKind
from mlcomp.runtime.codegen import to_fx

__all__ = ["EagerRuntime", "PartitionedRuntime"]


class EagerRuntime:
    """Runs a graph as generated torch code (the fallback for unsupported regions)."""

    kind: ClassVar[RuntimeKind] = RuntimeKind.EAGER
    FILE = "model.pt2"

    def __init__(self, module: Any, inputs: tuple[torch.Tensor, ...] | None = None) -> None:
        self.module = module
        self.inputs = inputs

    @classmethod
    def of_graph(cls, graph: Graph, inputs: tuple[torch.Tensor, ...]) -> "EagerRuntime":
        return cls(to_fx(graph).eval(), inputs)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            return tuple(self.module(*inputs))

    def save(self, directory: Path) -> dict[str, Any]:
        if self.inputs is None:  # loaded from disk: the ExportedProgram is already there
            raise RuntimeError("an eager region loaded from disk cannot be saved again")
        with quiet_torch():
            ep = torch.export.export(self.module, self.inputs)
            torch.export.save(ep, str(directory / self.FILE))
        return {"file": self.FILE}

    @classmethod
    def load(cls, directory: Path, info: dict[str, Any]) -> "EagerRuntime":
        ep = torch.export.load(str(directory / info.get("file", cls.FILE)))
        return cls(ep.module())


class PartitionedRuntime:
    """Regions run one after another; values flow between them by IR node name."""

    kind: ClassVar[RuntimeKind] = RuntimeKind.PARTITIONED

    def __init__(self, inputs: list[str], outputs: list[str], parts: list[dict[str, Any]]) -> None:
        self.input_names = inputs
        self.output_names = outputs
        self.parts = parts  # {"runtime", "inputs", "outputs", "runs_on"}

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        env: dict[str, Any] = dict(zip(self.input_names, inputs))
        for part in self.parts:
            outs = part["runtime"](*[env[n] for n in part["inputs"]])
            env.update(zip(part["outputs"], outs))
        return tuple(env[n] for n in self.output_names)

    def save(self, directory: Path) -> dict[str, Any]:
        parts = []
        for i, part in enumerate(self.parts):
            sub = directory / f"part{i}"
            sub.mkdir()
            info = part["runtime"].save(sub)
            parts.append({"dir": sub.name, "runtime": part["runtime"].kind.value, "info": info,
                          "inputs": part["inputs"], "outputs": part["outputs"], "runs_on": part["runs_on"]})
        return {"inputs": self.input_names, "outputs": self.output_names, "parts": parts}

    @classmethod
    def load(cls, directory: Path, info: dict[str, Any]) -> "PartitionedRuntime":
        parts = []
        for p in info["parts"]:
            runtime = RuntimeKind(p["runtime"]).runtime_class().load(directory / p["dir"], p["info"])
            parts.append(dict(p, runtime=runtime))
        return cls(info["inputs"], info["outputs"], parts)
