"""``prune``: structured channel/head pruning over the IR's dependency groups; magnitude and 2:4 masks.

``prune{method=channel sparsity=0.5}`` finds the channel groups
(:mod:`mlcomp.passes.prune.channel_groups`), ranks each group's channels by the
norm of every weight in the group, keeps the best ``1 - sparsity`` (rounded up
to ``round_to``) and rewrites the graph physically smaller::

    before                                             after prune{sparsity=0.5}
    %stem.0.weight: f32[64, 3, 3, 3] = param           %stem.0.weight: f32[32, 3, 3, 3] = param
    %layer1.0.conv1.weight: f32[64, 64, 3, 3]          %layer1.0.conv1.weight: f32[32, 32, 3, 3]
    %fc.weight: f32[10, 512] = param                   %fc.weight: f32[10, 256] = param

Channels that reach a ``cat``, ``split`` or slice are pruned per part, and the
concat's channels follow (``ChannelGroups.with_concats``); GroupNorm loses whole groups.
Pruning changes the function, so the pass hands the manager a *masked reference*
(``PassResult.reference``): the original graph with the same channels zeroed
where they leave their group; ``--verify`` checks the pruned graph against it
exactly.  How far the output moved from the unpruned model is reported
separately (relative error, cosine similarity, top-1 agreement).

``method=magnitude`` and ``method=2:4`` keep the shapes and write zeros into the
weights: no mlcomp target runs a sparse kernel (on this CPU, CSR matmul beat dense
only above ~80% zeros when measured), so the stats say "dense" and give the compressed size;
2:4 is refused before capture (``check_target``) unless the target is CUDA of compute capability 8.0+.
"""
from __future__ import annotations

import enum
import io
import math
import zlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from mlcomp.passes.prune.channel_groups import ChannelGroup, ChannelGroups, GroupKind, find_channel_groups
from mlcomp.analysis.cost import node_flops
from mlcomp.base.errors import PassFailure, PipelineSpecError
from mlcomp.frontend.loading import graph_random_inputs
from mlcomp.ir import Graph, Mode
from mlcomp.ir.interpreter import Interpreter
from mlcomp.ir.ops import PARAM, Category, category
from mlcomp.passes import patterns as P
from mlcomp.passes.prune.rewrite import magnitude_masks, masked, recalibrate_bn, shrink, two_four_mask
from mlcomp.pipeline.pass_base import Pass, PassContext, PassResult, option

__all__ = ["Prune", "PruneMethod", "Importance", "Scope", "deviation", "semi_structured_device"]


class PruneMethod(enum.Enum):
    CHANNEL = "channel"          # conv/linear channels (and heads when attention is in scope)
    HEAD = "head"                # attention heads only
    MAGNITUDE = "magnitude"      # unstructured: zeros in dense weights
    TWO_FOUR = "2:4"             # semi-structured: 2 of every 4 weights zero


class Importance(enum.Enum):
    L1 = "l1"
    L2 = "l2"
    BN_SCALE = "bn-scale"


class Scope(enum.Enum):
    CONV = "conv"
    LINEAR = "linear"
    ATTENTION = "attention"


class Ranking(enum.Enum):
    GROUP = "group"              # every group loses the same fraction
    GLOBAL = "global"            # one threshold over all groups (normalised importance)


_KINDS = {Scope.CONV: GroupKind.CONV, Scope.LINEAR: GroupKind.LINEAR, Scope.ATTENTION: GroupKind.HEAD}


@dataclass(frozen=True)
class Prune(Pass):
    """Prune channels, attention heads or weights; the graph gets physically smaller for channel/head."""

    name: ClassVar[str] = "prune"
    modes: ClassVar[frozenset[Mode]] = frozenset({Mode.INFERENCE})

    method: PruneMethod = option(PruneMethod.CHANNEL, "channel|head (smaller dense graph), magnitude|2:4 (zeros)")
    sparsity: float = option(0.5, "fraction of channels/heads/weights removed (1 would remove them all)",
                             ge=0, lt=1)
    importance: Importance = option(Importance.L2, "channel score: l1|l2 norm of the group's weights, "
                                                   "or bn-scale (|gamma| of its batch norms)")
    scope: tuple[Scope, ...] = option((Scope.CONV, Scope.LINEAR, Scope.ATTENTION), "what may be pruned")
    exclude: tuple[str, ...] = option((), "node names or module paths left untouched")
    round_to: int = option(8, "keep a multiple of this many channels per group (heads: 1)", ge=1)
    ranking: Ranking = option(Ranking.GROUP, "group: same fraction per group; global: one threshold")
    per_layer: bool = option(False, "magnitude: a threshold per weight instead of one global threshold")
    device: str = option("cpu", "device the pruned model runs on (2:4 needs cuda with capability >= 8.0)")
    recalibrate_bn: bool = option(False, "re-estimate batch-norm statistics on the calibration data")

    def check_target(self, target: str) -> None:
        """2:4 weights pay only through torch's semi-structured kernels: CUDA, capability 8.0+."""
        if self.method is not PruneMethod.TWO_FOUR:
            return
        device = self.device if self.device.startswith("cuda") else "cuda"
        if target != "cuda" or not semi_structured_device(device):
            where = (f"target {target} cannot run them" if target != "cuda"
                     else f"this machine has no such GPU for device {device!r}")
            raise PipelineSpecError(
                f"prune{{method=2:4}} writes weights for torch's semi-structured sparse kernels, which run only "
                f"on CUDA GPUs of compute capability 8.0 or newer; {where}",
                hint="use method=magnitude (dense weights with zeros) or method=channel (a smaller dense model) "
                     "for this target, or --target cuda on an Ampere or newer GPU")

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        if self.recalibrate_bn and ctx.calibration_data is None:
            raise PassFailure("prune{recalibrate_bn=true} needs calibration data and none was given",
                              hint="pass calibration_data= (a few batches of real inputs)")
        if self.method is PruneMethod.TWO_FOUR and not semi_structured_device(self.device):
            raise PassFailure(f"prune{{method=2:4}} needs a CUDA device of compute capability 8.0 or newer for "
                              f"torch's semi-structured kernels; device {self.device!r} is not one",
                              hint="use method=magnitude or method=channel, or device=cuda on an Ampere or newer GPU")
        if self.method in (PruneMethod.MAGNITUDE, PruneMethod.TWO_FOUR):
            return self._weights(graph, ctx)
        groups = find_channel_groups(graph, exclude=self.exclude)
        kinds = {_KINDS[s] for s in self.scope}
        if self.method is PruneMethod.HEAD:
            kinds &= {GroupKind.HEAD}
        chosen = groups.prunable(kinds)
        in_scope = [g for g in groups.groups if g.kind in kinds]
        if not in_scope:
            raise PassFailure(
                f"prune{{method={self.method.value}}} with scope {','.join(s.value for s in self.scope)} matches "
                f"nothing in graph {graph.name}: it has no {' or '.join(sorted(k.value for k in kinds)) or 'such'} "
                f"groups (its {len(groups.groups)} channel groups are of other kinds)",
                hint="scope= names what may shrink (conv, linear, attention); this graph's groups are of kinds "
                     + (", ".join(sorted({g.kind.value for g in groups.groups} - {"other"})) or "none"))
        if not chosen:                 # such layers exist, but every one is tied to an input, output or index
            reasons = sorted({g.fixed or "" for g in in_scope})
            return PassResult(graph, False, {"method": self.method.value, "groups_pruned": 0,
                                             "notes": [f"no {self.method.value} group is free to change: "
                                                       + "; ".join(reasons)]})
        keep, notes = self._select(graph, groups, chosen)
        if not keep:
            return PassResult(graph, False, {"method": self.method.value, "groups_pruned": 0,
                                             "notes": notes + [f"sparsity {self.sparsity} removes no channel"]})
        full = groups.with_concats(keep)          # a concat's (or split's) channels follow its parts
        reference = masked(graph, groups, full)
        before = _model_size(graph)
        flops_before = {n.name: node_flops(graph, n) for n in graph.call_nodes()
                        if n.op.is_composite or category(n.op) is Category.COMPUTE}   # FLOPs live there
        out = graph.copy()
        shrink(out, groups, full)
        if self.recalibrate_bn:
            recalibrate_bn(out, reference, groups, full, ctx.calibration_data)
        after = _model_size(out)
        flops_after = sum(node_flops(out, out.node(n)) for n in flops_before)
        stats: dict[str, Any] = {
            "method": self.method.value, "groups_pruned": len(keep),
            "channels_before": sum(g.size for g in chosen),
            "channels_after": sum(len(keep[g.id]) if g.id in keep else g.size for g in chosen),
            "params_before": before[0], "params_after": after[0],
            "bytes_before": before[1], "bytes_after": after[1],
            "macs_before": sum(flops_before.values()) // 2, "macs_after": flops_after // 2,
            "macs_reduction": round(sum(flops_before.values()) / max(flops_after, 1), 3),
            "groups": _group_stats(graph, groups, chosen, keep, flops_before),
        }
        if notes:
            stats["notes"] = notes
        stats.update(deviation(graph, out, ctx.example_inputs))
        return PassResult(out, True, stats, reference=reference)

    # -- choosing channels ------------------------------------------------------
    def _select(self, graph: Graph, groups: ChannelGroups,
                chosen: list[ChannelGroup]) -> tuple[dict[int, torch.Tensor], list[str]]:
        scores = {g.id: _importance(graph, groups, g, self.importance) for g in chosen}
        counts = {g.id: g.size - int(math.floor(g.size * self.sparsity)) for g in chosen}
        notes: list[str] = []
        if self.ranking is Ranking.GLOBAL and chosen:
            flat = torch.cat([scores[g.id] / scores[g.id].mean().clamp_min(1e-12) for g in chosen])
            drop = int(math.floor(flat.numel() * self.sparsity))
            cut = flat.sort().values[drop - 1] if drop > 0 else -math.inf
            counts = {g.id: int((scores[g.id] / scores[g.id].mean().clamp_min(1e-12) > cut).sum()) for g in chosen}
        keep: dict[int, torch.Tensor] = {}
        for g in chosen:
            n = counts[g.id]
            step = 1 if g.kind is GroupKind.HEAD else self.round_to
            if step > 1 and g.size % step == 0:
                n = int(math.ceil(n / step) * step)
            if n < 1:
                n = min(step, g.size)
                notes.append(f"group {g.id} ({', '.join(g.modules[:3])}): pruning would remove all {g.size} "
                             f"channels; kept {n}")
            n = min(n, g.size)
            if n == g.size:
                continue
            keep[g.id] = scores[g.id].topk(n).indices.sort().values
        return keep, notes

    # -- magnitude and 2:4 ------------------------------------------------------
    def _weights(self, graph: Graph, ctx: PassContext) -> PassResult:
        two_four = self.method is PruneMethod.TWO_FOUR
        groups = find_channel_groups(graph, exclude=self.exclude)
        want = {Scope.CONV: P.CONVOLUTION, Scope.LINEAR: P.ADDMM}
        names = [n for n in groups.weight_ops if groups.weight_ops[n] in {want.get(s) for s in self.scope}
                 and not groups.is_excluded(n)]
        if not names:
            raise PassFailure(f"prune{{method={self.method.value}}} found no weight in scope "
                              f"{','.join(s.value for s in self.scope)} in graph {graph.name}",
                              hint="widen scope= or shorten exclude=")
        out = graph.copy()
        tensors = {n: graph.constants[n] for n in names}
        masks = ({n: m for n in names if (m := two_four_mask(tensors[n])) is not None} if two_four
                 else magnitude_masks(tensors, self.sparsity, per_layer=self.per_layer))
        zeros = 0
        for n, m in masks.items():
            w = out.writable_constant(n)
            with torch.no_grad():
                w.mul_(m.to(w.dtype))
            zeros += int((~m).sum())
            out.replace(out.node(n).with_ann(sparsity=round(float((~m).float().mean()), 4)))
        total = sum(tensors[n].numel() for n in masks)
        stats: dict[str, Any] = {
            "method": self.method.value, "weights_masked": len(masks), "weight_zeros": zeros,
            "weight_sparsity": round(zeros / max(total, 1), 4),
            "kernel": ("dense weights with a 2:4 zero pattern for torch.sparse.to_sparse_semi_structured; "
                       "its speed is not measured by this pass" if two_four else
                       "dense weights with zeros: no sparse kernel is used (no mlcomp target runs CSR weights); "
                       "expect no speedup, only a smaller compressed file"),
            "compressed_bytes_before": _compressed(graph), "compressed_bytes_after": _compressed(out),
        }
        if two_four:
            stats["skipped_weights"] = [n for n in names if n not in masks]
        stats.update(deviation(graph, out, ctx.example_inputs))
        return PassResult(out, zeros > 0, stats, reference=out)


# ---------------------------------------------------------------------------
# helpers


def semi_structured_device(device: str) -> bool:
    """Whether torch's 2:4 kernels (``to_sparse_semi_structured``) run on ``device``."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(torch.device(device)) >= (8, 0)


def _importance(graph: Graph, groups: ChannelGroups, g: ChannelGroup, how: Importance) -> torch.Tensor:
    """One score per channel of the group: each weight's per-channel norm over its mean, summed.

    Weights that read a concat (or split) holding the group count too, on the part it occupies.
    """
    bn = how is Importance.BN_SCALE
    sources = g.bn_scales if bn and g.bn_scales else g.weights
    score = torch.zeros(g.size, dtype=torch.float64)
    for pname, axis in g.params:
        if pname in sources:
            layout = groups.layout(pname, axis)
            pos = next(i for i, (gid, _) in enumerate(layout) if gid == g.id)
            t = _factored(graph.constants[pname], axis, [s for _, s in layout])
            score += _norm(t.movedim(axis + pos, 0).reshape(g.size, -1), how)
    for root, offset, factors, pos in groups.inside(g.id):
        whole = groups.groups[root]
        for pname, axis in whole.params:
            if pname in (whole.bn_scales if bn and whole.bn_scales else whole.weights):
                layout = groups.layout(pname, axis)
                at = axis + next(i for i, (gid, _) in enumerate(layout) if gid == root)
                t = _factored(graph.constants[pname], axis, [s for _, s in layout])
                t = _factored(t.narrow(at, offset, math.prod(factors)), at, factors)
                score += _norm(t.movedim(at + pos, 0).reshape(g.size, -1), how)
    return score


def _factored(t: torch.Tensor, axis: int, sizes: list[int]) -> torch.Tensor:
    return t.detach().double().reshape(*t.shape[:axis], *sizes, *t.shape[axis + 1:])


def _norm(per: torch.Tensor, how: Importance) -> torch.Tensor:
    """Per-row norm of ``per`` (rows: channels), over its mean."""
    s = per.abs().sum(1) if how is Importance.L1 else per.abs().amax(1) if how is Importance.BN_SCALE \
        else per.pow(2).sum(1).sqrt()
    return s / s.mean().clamp_min(1e-12)


def _group_stats(graph: Graph, groups: ChannelGroups, chosen: list[ChannelGroup], keep: dict[int, torch.Tensor],
                 flops: dict[str, int]) -> list[dict[str, Any]]:
    """Per group: channels before/after, and the params and FLOPs its pruning alone removes.

    A tensor or node whose axes carry the group k times (a conv's input and output
    channels, say) keeps ``(kept/size)**k`` of itself.  One pass over the params and
    the compute nodes (O(n)).
    """
    ratio = {g.id: (len(keep[g.id]) if g.id in keep else g.size) / g.size for g in chosen}
    params = dict.fromkeys(ratio, 0)
    for name in dict.fromkeys(p for g in chosen for p, _ in g.params):
        counts = _counts(groups.layout(name, i) for i in range(groups.rank(name)))
        for gid, k in counts.items():
            if gid in params:
                params[gid] += int(graph.constants[name].numel() * (1 - ratio[gid] ** k))
    removed = dict.fromkeys(ratio, 0)
    for name, count in flops.items():
        if count:
            node = graph.node(name)
            layouts = [groups.layout(name, i) for i in range(groups.rank(name))]
            layouts += [groups.layout(node.inputs[pos].name, axis) for pos, axis in groups.contracted.get(name, ())]
            for gid, k in _counts(layouts).items():
                if gid in removed:
                    removed[gid] += int(count * (1 - ratio[gid] ** k))
    return [{"group": g.id, "kind": g.kind.value, "modules": list(g.modules), "channels_before": g.size,
             "channels_after": round(ratio[g.id] * g.size), "params_removed": params[g.id],
             "flops_removed": removed[g.id]} for g in chosen]


def _counts(layouts: Any) -> dict[int, int]:
    out: dict[int, int] = {}
    for layout in layouts:
        for gid, _ in layout:
            if gid is not None:
                out[gid] = out.get(gid, 0) + 1
    return out


def _model_size(graph: Graph) -> tuple[int, int]:
    tensors = [graph.constants[n.name] for n in graph.nodes(PARAM)]
    return sum(t.numel() for t in tensors), sum(t.numel() * t.element_size() for t in tensors)


def _compressed(graph: Graph) -> int:
    """zlib-compressed bytes of the graph's constants as torch.save writes them."""
    buf = io.BytesIO()
    torch.save({n.name: graph.constants[n.name] for n in graph.nodes(PARAM)}, buf)
    return len(zlib.compress(buf.getvalue(), 6))


def deviation(before: Graph, after: Graph, inputs: tuple[Any, ...] | None, *, seed: int = 0) -> dict[str, float]:
    """How far the pruned outputs moved: relative L2 error, cosine similarity and top-1 agreement."""
    xs = inputs if inputs is not None else graph_random_inputs(before, seed)
    with torch.no_grad():
        a = [t for t in Interpreter(before).run(*xs) if isinstance(t, torch.Tensor)]
        b = [t for t in Interpreter(after).run(*xs) if isinstance(t, torch.Tensor)]
    if not a:
        return {}
    x, y = a[0].double().flatten(), b[0].double().flatten()
    out = {"output_rel_error": round(float((x - y).norm() / x.norm().clamp_min(1e-30)), 6),
           "output_cosine": round(float(torch.nn.functional.cosine_similarity(x, y, dim=0)), 6)}
    if a[0].dim() >= 2 and a[0].shape[-1] > 1:
        out["top1_agreement"] = round(float((a[0].argmax(-1) == b[0].argmax(-1)).double().mean()), 4)
    return out
