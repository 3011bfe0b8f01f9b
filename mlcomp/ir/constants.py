"""The tensors a graph owns: parameters and buffers by name, shared between copies until written.

``graph.constants`` is a :class:`Constants` mapping.  Capture fills it with
*copies* of the user's parameters and buffers, so nothing a pass does reaches
the user's module.  ``Graph.copy()`` copies the mapping, not the tensors: both
graphs read the same storage until one of them writes::

    >>> import torch
    >>> from mlcomp.ir.builder import GraphBuilder
    >>> from mlcomp.ir.ops import aten
    >>> b = GraphBuilder("fc")
    >>> w, bias = b.param("fc.weight", torch.ones(10, 4)), b.param("fc.bias", torch.ones(10))
    >>> g = b.output(b.call(aten("addmm"), bias, b.input("x", (2, 4)), b.call(aten("t"), w)))
    >>> g2 = g.copy()
    >>> g2.constants["fc.weight"] is g.constants["fc.weight"]      # shared, no memory spent
    True
    >>> w = g2.writable_constant("fc.weight")                         # g2 gets its own tensor
    >>> _ = w.mul_(0.5)                                               # g is untouched
    >>> float(g.constants["fc.weight"][0, 0]), float(g2.constants["fc.weight"][0, 0])
    (1.0, 0.5)
    >>> g2.constants["fc.bias"] = torch.zeros(10)                     # replacing is always local

A pass that rewrites a weight *in place* (pruning, casting) asks for
:meth:`Constants.writable` (``graph.writable_constant``) first; a pass that
makes a new tensor just assigns it.  Only a tensor that ``writable`` cloned is
known to be private: an assigned tensor may be shared with anyone (a renamed
parameter, a subgraph's copy of its parent's weight), so ``writable`` clones
it once before handing it out.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Mapping, MutableMapping

import torch

__all__ = ["Constants"]


class Constants(MutableMapping[str, torch.Tensor]):
    """Name → tensor with copy-on-write between :meth:`copy` siblings.

    ``_owned`` holds the names whose tensor no other mapping or name can see:
    those cloned by :meth:`writable` since the last :meth:`copy` and not
    replaced since.  Copying clears it on both sides.
    """

    __slots__ = ("_tensors", "_owned")

    def __init__(self, items: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] = ()) -> None:
        self._tensors: dict[str, torch.Tensor] = dict(items)
        self._owned: set[str] = set()

    # -- mapping --------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"constant {name!r} must be a torch.Tensor, got {type(value).__name__}")
        self._tensors[name] = value
        self._owned.discard(name)

    def __delitem__(self, name: str) -> None:
        del self._tensors[name]
        self._owned.discard(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __repr__(self) -> str:
        return f"<Constants {len(self)} tensors, {self.nbytes():,} bytes, {len(self._owned)} owned>"

    # -- copy-on-write --------------------------------------------------------
    def copy(self) -> "Constants":
        """A mapping with the same tensors; the first in-place write on either side clones."""
        out = Constants.__new__(Constants)
        out._tensors = dict(self._tensors)
        out._owned = set()
        self._owned.clear()
        return out

    def writable(self, name: str) -> torch.Tensor:
        """The tensor ``name``, cloned first unless this mapping already has it to itself.

        Write into the returned tensor in place; no other graph sees the change.
        """
        tensor = self._tensors[name]
        if name not in self._owned:
            clone = tensor.detach().clone()
            if tensor.requires_grad:
                clone.requires_grad_(True)
            self._tensors[name] = clone
            self._owned.add(name)
            tensor = clone
        return tensor

    def is_shared(self, name: str) -> bool:
        """Whether an in-place write to ``name`` now would need a clone first."""
        if name not in self._tensors:
            raise KeyError(name)
        return name not in self._owned

    def nbytes(self) -> int:
        """Bytes held, each storage counted once (tied weights share one)."""
        seen: dict[int, int] = {}
        for t in self._tensors.values():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return sum(seen.values())
