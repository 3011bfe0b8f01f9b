"""One lazy registry for every "name → implementation" table, and one did-you-mean.

Passes, targets, artifact runtimes, CLI commands and studies are all found by
name; their modules are imported only when a name is first asked for, so
``mlcomp --help`` or parsing a pipeline never imports tvm or onnxruntime::

    >>> reg = LazyRegistry("study", {"roofline": "mlcomp.study.roofline:run"})
    >>> reg.names()
    ['roofline']
    >>> reg.get("roofline")            # imports mlcomp.study.roofline now
    <function run ...>
    >>> reg.get("rofline")
    Traceback (most recent call last):
    KeyError: "unknown study 'rofline'; did you mean 'roofline'? (known: roofline)"

Callers that need their own error type pass ``on_unknown``, which receives the
name and the closest known name (or ``None``) and returns the exception to raise;
the suggestion itself always comes from :func:`did_you_mean`.
"""
from __future__ import annotations

import difflib
import importlib
from typing import Callable, Generic, Iterable, Iterator, Mapping, TypeVar

__all__ = ["LazyRegistry", "did_you_mean", "resolve_ref"]

T = TypeVar("T")


def did_you_mean(name: str, known: Iterable[str], *, cutoff: float = 0.6) -> str | None:
    """The known name closest to ``name`` (``difflib`` ratio ≥ ``cutoff``), or ``None``.

    >>> did_you_mean("fuse-elemntwise", ["fuse", "fuse-elementwise"])
    'fuse-elementwise'
    """
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=cutoff)
    return close[0] if close else None


def resolve_ref(ref: str) -> object:
    """Import ``"package.module:attr"`` (``attr`` may be dotted) and return the attribute.

    A reference without ``:attr`` (``"package.module"``) names the module itself.
    """
    module, sep, attr = ref.partition(":")
    if not module or (sep and not attr):
        raise ValueError(f"reference {ref!r} is not of the form 'package.module[:attribute]'")
    value: object = importlib.import_module(module)
    for part in attr.split(".") if attr else ():
        value = getattr(value, part)
    return value


class LazyRegistry(Generic[T]):
    """Name → object, each given as the object or a ``"module:attr"`` (or ``"module"``) string imported on first use.

    ``kind`` names what is registered (``"pass"``, ``"target"``) for the default
    error text.  Loaded objects are cached; :meth:`register` replaces the cache
    entry of the name it (re)defines.
    """

    def __init__(self, kind: str, entries: Mapping[str, "str | T"] | None = None, *,
                 on_unknown: Callable[[str, str | None], Exception] | None = None,
                 cutoff: float = 0.6) -> None:
        self.kind = kind
        self._refs: dict[str, str | T] = dict(entries or {})
        self._loaded: dict[str, T] = {}
        self._on_unknown = on_unknown
        self._cutoff = cutoff

    # -- contents ---------------------------------------------------------
    def register(self, name: str, value: "str | T", *, replace: bool = False) -> None:
        """Add ``name`` (an object or a ``"module:attr"`` reference); ``ValueError`` if taken."""
        if not name:
            raise ValueError(f"a {self.kind} needs a non-empty name")
        if name in self._refs and not replace:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._refs[name] = value
        self._loaded.pop(name, None)

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._refs)

    def ref(self, name: str) -> "str | T":
        """What ``name`` was registered as (the reference text, or the object), without importing."""
        self._check(name)
        return self._refs[name]

    def __contains__(self, name: object) -> bool:
        return name in self._refs

    def __iter__(self) -> Iterator[str]:
        return iter(self._refs)

    def __len__(self) -> int:
        return len(self._refs)

    # -- lookup -------------------------------------------------------------
    def get(self, name: str) -> T:
        """The object called ``name``, imported now if it was given as a reference."""
        self._check(name)
        if name not in self._loaded:
            ref = self._refs[name]
            self._loaded[name] = resolve_ref(ref) if isinstance(ref, str) else ref  # type: ignore[assignment]
        return self._loaded[name]

    def suggest(self, name: str) -> str | None:
        """The registered name closest to ``name`` (see :func:`did_you_mean`)."""
        return did_you_mean(name, self._refs, cutoff=self._cutoff)

    def _check(self, name: str) -> None:
        if name in self._refs:
            return
        close = self.suggest(name)
        if self._on_unknown is not None:
            raise self._on_unknown(name, close)
        raise KeyError(f"unknown {self.kind} {name!r}" + (f"; did you mean {close!r}?" if close else "")
                       + f" (known: {', '.join(self.names())})")
