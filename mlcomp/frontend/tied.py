"""Tied parameters in a joint capture: one parameter, one gradient, however many names it has.

A module may reach the same ``nn.Parameter`` under several names: a language model's
output projection is its input embedding (``lm_head.weight is
transformer.wte.weight``), an encoder-decoder shares one embedding between encoder,
decoder and head.  ``model.named_parameters()`` lists such a parameter once, under
the first name met (its *canonical* name); eager autograd gives it one ``.grad``,
the sum of what every use contributes.

``torch.export`` lifts one placeholder per *name* but routes every use to one of
them, so the others read nothing, and the joint (forward + backward) trace then
stops at a parameter without a gradient.  :func:`merge_tied` redirects the readers
of every alias's placeholder to one placeholder per parameter and drops the rest, so
the backward sums all uses into one gradient, as eager does; the joint graph names
that parameter and its gradient by the canonical name::

    >>> from torch import nn
    >>> class Tied(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.embed, self.head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    ...         self.head.weight = self.embed.weight
    >>> tied_parameters(Tied())
    {'head.weight': 'embed.weight'}

The aliases ride on the joint graph's output node (:data:`TIED`, pairs ``(alias,
canonical)``) so that a training step can show the one updated tensor under every
key of the model's ``state_dict``.
"""
from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["TIED", "merge_tied", "tied_parameters"]

TIED = "tied"   # output node attribute of a joint graph: ((alias, canonical), …)


def tied_parameters(model: nn.Module, prefix: str = "") -> dict[str, str]:
    """``{alias: canonical}`` for every parameter reachable under more than one name.

    The canonical name is the one ``model.named_parameters()`` reports (the first met);
    ``prefix`` is put before every name (``"model."`` for a wrapped model).
    """
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        canonical = first.setdefault(id(param), name)
        if canonical != name:
            aliases[prefix + name] = prefix + canonical
    return aliases


def merge_tied(ep: Any, aliases: dict[str, str]) -> Any:
    """``ep`` with one parameter placeholder per tied parameter (``ep`` itself when nothing is tied).

    Within each group of names of one parameter the first placeholder is kept; every
    reader of the others reads it instead, and the others leave the graph and the
    signature.  The kept placeholder may carry an alias's name (the joint graph names
    it by the canonical one).  ``ep``'s graph is edited in place (the joint capture's own export).
    """
    if not aliases:
        return ep
    gm, signature = ep.graph_module, ep.graph_signature
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    kept: dict[str, Any] = {}
    dropped = []
    for spec in signature.input_specs:
        if spec.kind.name != "PARAMETER":
            continue
        group = aliases.get(spec.target, spec.target)
        if group in kept:
            placeholders[spec.arg.name].replace_all_uses_with(kept[group])
            dropped.append(spec)
        else:
            kept[group] = placeholders[spec.arg.name]
    if not dropped:
        return ep
    for spec in dropped:
        gm.graph.erase_node(placeholders[spec.arg.name])
        signature.input_specs.remove(spec)
    gm.recompile()
    return ep._update(gm, signature)

