"""``loss-scale``: multiply the seed of backward by a scalar graph input ``%loss_scale``.

fp16 flushes magnitudes below 2^-24 to zero, so small gradients of fp16
intermediates vanish.  Scaling the loss by ``S`` before backward scales every
gradient by ``S``; the training step (:mod:`mlcomp.training.loss_scaling`) feeds
``S`` and divides the gradients by it again, in fp32, before the optimizer sees
them.  On a joint graph (:mod:`mlcomp.frontend.joint`) backward starts from one
seed, ``full_like(%loss, 1)``; this pass multiplies that seed by a new last
input ``%loss_scale`` (f32[]) and makes every reader of the seed read the product::

    before:  %full_like: f32[] = aten.full_like.default(%loss, 1, ...)       # {phase=backward}
             %div_1: f32[] = aten.div.Tensor(%full_like, %_to_copy)
    after:   %loss_scale: f32[] = input
             %full_like: f32[] = aten.full_like.default(%loss, 1, ...)       # {phase=backward}
             %scaled_seed: f32[] = aten.mul.Tensor(%full_like, %loss_scale)  # {phase=backward}
             %div_1: f32[] = aten.div.Tensor(%scaled_seed, %_to_copy)

The pass runs on training graphs only: an inference graph has no backward to
seed, and the pass manager refuses it before anything runs.  ``compile_training``
applies it whenever a loss scale is active; a pipeline that names it on a
training compile chooses dynamic scaling unless ``--loss-scale`` says otherwise.
Stats: the seed scaled, the input added and how many readers were rewired.

    >>> LossScale().name, LossScale(loss="loss").loss
    ('loss-scale', 'loss')
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from mlcomp.base.errors import LossScaleError
from mlcomp.ir import Graph, Mode, Node, Ref, TensorMeta
from mlcomp.ir.builder import new_node
from mlcomp.ir.node import Phase
from mlcomp.ir.ops import INPUT, aten
from mlcomp.pipeline.pass_base import Pass, PassContext, PassResult, option

__all__ = ["LOSS_SCALE_INPUT", "SCALED_SEED", "LossScale", "find_backward_seed", "is_loss_scaled"]

LOSS_SCALE_INPUT = "loss_scale"
SCALED_SEED = "scaled_seed"
_SEED_OPS = frozenset({aten("full_like"), aten("ones_like")})


def find_backward_seed(graph: Graph, loss: str | None = None) -> Node:
    """The ``full_like(%loss, 1)`` node autograd starts backward from (``loss``: the first output)."""
    if graph.mode is Mode.TRAINING:
        loss = loss or graph.output_refs[0].name
        for user in graph.users(loss) if loss in graph else ():
            if user.op in _SEED_OPS and user.ann.phase is Phase.BACKWARD:
                return user
    raise LossScaleError(f"graph {graph.name} has no backward seed (full_like(%{loss or 'loss'}, 1)) to scale",
                         where=f"graph {graph.name} ({graph.mode.value})",
                         hint="loss scaling applies to joint training graphs (mode='train'); use loss_scale='none'")


def is_loss_scaled(graph: Graph) -> bool:
    """Whether ``graph`` already has the ``%loss_scale`` input this pass adds."""
    return LOSS_SCALE_INPUT in graph and graph.node(LOSS_SCALE_INPUT).op == INPUT


@dataclass(frozen=True)
class LossScale(Pass):
    """Multiply the backward seed of a joint training graph by a new scalar input %loss_scale."""

    name: ClassVar[str] = "loss-scale"
    modes: ClassVar[frozenset[Mode]] = frozenset({Mode.TRAINING})
    loss: str = option("", "the output whose backward seed is scaled (empty: the first output, the loss)")

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        if LOSS_SCALE_INPUT in graph:
            raise LossScaleError(f"graph {graph.name} already has a node named %{LOSS_SCALE_INPUT}",
                                 hint="the graph is already loss-scaled; compile it with loss_scale='none' "
                                      "or name loss-scale once in the pipeline")
        seed = find_backward_seed(graph, self.loss or None)
        order = graph.order()
        last_input = max(i for i, n in enumerate(order) if graph.node(n).op == INPUT)
        after = order[last_input + 1] if last_input + 1 < len(order) else None
        graph.add(Node(LOSS_SCALE_INPUT, INPUT, meta=TensorMeta((), torch.float32)), before=after)
        users = [u.name for u in graph.users(seed.name)]
        scaled = new_node(graph, aten("mul", "Tensor"), (Ref(seed.name), Ref(LOSS_SCALE_INPUT)), name=SCALED_SEED,
                          origin=seed.origin, before=users[0] if users else None)
        graph.replace(scaled.with_ann(phase=Phase.BACKWARD))
        graph.replace_all_uses(seed.name, scaled.name, only=lambda u: u.name != scaled.name)
        return PassResult(graph, True, {"seed": seed.name, "input": LOSS_SCALE_INPUT, "scaled_seed": scaled.name,
                                        "readers_rewired": len(users)})
