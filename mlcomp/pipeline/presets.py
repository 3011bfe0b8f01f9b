"""Presets (``-O0`` … ``-O3``) as data, and how a preset adapts to the target it compiles for.

Each pass of a preset says what kind of rewrite it is (:class:`Rewrite`); each
target says which kinds help it (``Target.rewrites``).  Expanding a preset for
a target keeps the passes whose kind the target wants and records the others,
with the reason, so the pipeline report can say what was dropped::

    >>> preset_text("O2")                                   # every kind: torch targets
    'cleanup,fuse,cleanup'
    >>> adapted = adapt_preset("-O2", "onnxruntime", frozenset({Rewrite.CLEANUP}))
    >>> adapted.text                            # fusion and weight folding dropped; cleanup once
    'cleanup{fold_params=false}'
    >>> adapted.dropped[0].reason
    "onnxruntime fuses kernels itself; mlcomp's fusion measured no gain there (benchmarks/presets.py)"
    >>> adapt_preset("-O1", "onnxruntime", frozenset({Rewrite.CLEANUP})).text   # no weight folding
    'cleanup{fold_params=false}'
    >>> adapt_preset("-O2", "openvino", frozenset({Rewrite.CLEANUP, Rewrite.WEIGHT_FOLDING, Rewrite.RECOMPOSE})).text
    'cleanup,recompose,fuse-attention,cleanup'
    >>> adapt_preset("-O2", "openvino", frozenset({Rewrite.CLEANUP, Rewrite.RECOMPOSE, Rewrite.PROJECTIONS})).text
    'cleanup{fold_params=false},split-projections,recompose,fuse-attention,cleanup{fold_params=false}'

A kind in :data:`OPT_IN` (``split-projections``) runs only for a target that names it in its
``rewrites``: whether it pays is measured per target.

A target that fuses kernels itself but only from whole layer norms, GELUs and
attentions (OpenVINO) wants :attr:`Rewrite.RECOMPOSE`: a preset's ``fuse`` becomes
``recompose,fuse-attention`` for it.

Two equal passes left next to each other by a drop run once (both run to a
fixed point).  Only presets adapt: a pipeline the user wrote out (inline text, TOML) runs as
written, whatever the target.  A preset inside a pass list adapts as it would alone, and the
passes written next to it run as written; when ``quantize`` follows it, the preset's dropped
fusion leaves its batch-norm folding in place (an int8 convolution needs its batch norm in its
weights: the runtime would fold it only after quantization, in float)::

    >>> adapt_preset("-O2,quantize", "onnxruntime", frozenset({Rewrite.CLEANUP})).text
    'cleanup{fold_params=false},fold-batchnorm,cleanup{fold_params=false},quantize'
    >>> adapt_preset("-O1,prune{amount=0.5}", "onnxruntime", frozenset({Rewrite.CLEANUP})).text
    'cleanup{fold_params=false},prune{amount=0.5}'
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "ALL_REWRITES",
    "OPT_IN",
    "PRESET_TABLE",
    "AdaptedPreset",
    "Dropped",
    "Rewrite",
    "adapt_preset",
    "split_items",
    "preset_key",
    "preset_text",
]


class Rewrite(enum.Enum):
    """What a preset's pass is for."""

    CLEANUP = "cleanup"          # dead code, CSE, no-ops, constant folding: less work for any backend
    FUSION = "fusion"            # mlcomp's own fused kernels and recompositions (fuse, fuse-*)
    WEIGHT_FOLDING = "weight-folding"  # cleanup also folds what reads only weights (a Linear's transpose)
    RECOMPOSE = "recompose"      # the part of fusion that puts decomposed layer norm, GELU, attention back
    PROJECTIONS = "projections"  # a packed projection read only in parts (q/k/v) as one product per part

    def unwanted_reason(self, target: str) -> str:
        return _UNWANTED[self].format(target=target)


_UNWANTED = {
    Rewrite.CLEANUP: "{target} does not benefit from graph cleanup",
    Rewrite.FUSION: "{target} fuses kernels itself; mlcomp's fusion measured no gain there (benchmarks/presets.py)",
    Rewrite.RECOMPOSE: "{target} runs ATen's decompositions of layer norm, GELU and attention as written",
    Rewrite.PROJECTIONS: "{target} runs a packed projection as written",
    Rewrite.WEIGHT_FOLDING: "{target} folds weight subgraphs itself when it loads the model; folded here they no "
                            "longer read the layer's own weights, which its exporter needs to put layers such as "
                            "GRU back (benchmarks/ort_parity.py)",
}

# what of a FUSION pass a target that wants only RECOMPOSE keeps: the recompositions, no fused kernels
_RECOMPOSE_ONLY = "recompose,fuse-attention"

# the option that turns weight folding off in a cleanup pass (``cleanup{fold_params=false}``)
_NO_WEIGHT_FOLDING = "fold_params=false"

# kinds a preset runs only for a target that names them (measured per target; never recorded as dropped)
OPT_IN: frozenset[Rewrite] = frozenset({Rewrite.PROJECTIONS})
# what a target wants unless it says otherwise (the torch targets)
ALL_REWRITES: frozenset[Rewrite] = frozenset(Rewrite) - OPT_IN

# preset name -> its passes in order, each (what it is for, pass spec text)
PRESET_TABLE: dict[str, tuple[tuple[Rewrite, str], ...]] = {
    "O0": (),
    "O1": ((Rewrite.CLEANUP, "cleanup"),),
    "O2": ((Rewrite.CLEANUP, "cleanup"), (Rewrite.PROJECTIONS, "split-projections"), (Rewrite.FUSION, "fuse"),
           (Rewrite.CLEANUP, "cleanup")),
    "O3": ((Rewrite.CLEANUP, "cleanup{fold_max_bytes=16777216}"), (Rewrite.PROJECTIONS, "split-projections"),
           (Rewrite.FUSION, "fuse{max_group_size=128,peak_slack=0.5,tile_min_elements=262144}"),
           (Rewrite.CLEANUP, "cleanup{fold_max_bytes=16777216}")),
}


@dataclass(frozen=True)
class Dropped:
    """One pass of a preset left out for a target, and why."""

    spec: str
    rewrite: Rewrite
    reason: str

    def __str__(self) -> str:
        return f"{self.spec} ({self.rewrite.value}): {self.reason}"


@dataclass(frozen=True)
class AdaptedPreset:
    """A preset expanded for one target: the pipeline text to run and what was left out."""

    preset: str
    target: str
    text: str
    dropped: tuple[Dropped, ...] = ()


def preset_key(text: object) -> str | None:
    """``"-O2"`` / ``"O2"`` → ``"O2"``; anything else (a pass list, a path, a Pipeline) → None."""
    if not isinstance(text, str):
        return None
    key = text.strip().lstrip("-")
    return key if key in PRESET_TABLE else None


def preset_text(name: str) -> str:
    """The preset with every pass (what ``Pipeline.parse("-O2")`` runs when no target is given)."""
    key = preset_key(name)
    if key is None:
        raise KeyError(name)
    return ",".join(spec for rewrite, spec in PRESET_TABLE[key] if rewrite not in OPT_IN)


def adapt_preset(pipeline: object, target: str, wanted: frozenset[Rewrite]) -> AdaptedPreset | None:
    """The preset ``pipeline`` names (alone or in a pass list), without the passes ``target`` does not want;
    None if it names no preset."""
    key = preset_key(pipeline)
    if key is None:
        return _adapt_list(pipeline, target, wanted)
    return _adapt_one(key, target, wanted, keep_batchnorm=False)


# what a preset's dropped fusion leaves when quantize follows it, and the pass that asks for it
_BEFORE_QUANTIZE, _QUANTIZE = "fold-batchnorm", "quantize"


def _adapt_list(pipeline: object, target: str, wanted: frozenset[Rewrite]) -> AdaptedPreset | None:
    items = split_items(pipeline) if isinstance(pipeline, str) and not pipeline.strip().endswith(".toml") else []
    keys = [preset_key(i) for i in items]
    if not any(keys):
        return None
    texts: list[str] = []
    dropped: list[Dropped] = []
    for i, (item, key) in enumerate(zip(items, keys)):
        if key is None:
            texts.append(item.strip())
            continue
        later = any(_item_name(x) == _QUANTIZE for x in items[i + 1:])
        one = _adapt_one(key, target, wanted, keep_batchnorm=later)
        texts += [one.text] if one.text else []
        dropped += one.dropped
    first = next(k for k in keys if k)
    return AdaptedPreset(f"-{first}", target, ",".join(texts), tuple(dropped))


def _item_name(item: str) -> str:
    return item.strip().split("{", 1)[0].strip()


def split_items(text: str) -> list[str]:
    """``text`` split at the commas outside braces, brackets and quotes (one pass spec per item)::

        >>> split_items('-O2, quantize{exclude=[fc,"a,b"]}')
        ['-O2', ' quantize{exclude=[fc,"a,b"]}']
    """
    items, depth, quote, start = [], 0, "", 0
    for i, c in enumerate(text):
        if quote:
            quote = "" if c == quote else quote
        elif c in "\"'":
            quote = c
        elif c in "{[(":
            depth += 1
        elif c in "}])":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return items + [text[start:]]


def _adapt_one(key: str, target: str, wanted: frozenset[Rewrite], *, keep_batchnorm: bool) -> AdaptedPreset:
    kept: list[str] = []
    dropped: list[Dropped] = []
    no_folding = False
    for rewrite, spec in PRESET_TABLE[key]:
        if rewrite is Rewrite.CLEANUP and rewrite in wanted and Rewrite.WEIGHT_FOLDING not in wanted:
            spec = _with_option(spec, _NO_WEIGHT_FOLDING)
            no_folding = True
        if rewrite in wanted:
            if not kept or kept[-1] != spec:
                kept.append(spec)
            continue
        if rewrite in OPT_IN:
            continue
        dropped.append(Dropped(spec, rewrite, rewrite.unwanted_reason(target)))
        if rewrite is Rewrite.FUSION and Rewrite.RECOMPOSE in wanted:
            kept.append(_RECOMPOSE_ONLY)
        if rewrite is Rewrite.FUSION and keep_batchnorm:
            kept.append(_BEFORE_QUANTIZE)
    if no_folding:
        dropped.append(Dropped(_with_option("cleanup", "fold_params=true"), Rewrite.WEIGHT_FOLDING,
                               Rewrite.WEIGHT_FOLDING.unwanted_reason(target)))
    return AdaptedPreset(f"-{key}", target, ",".join(kept), tuple(dropped))


def _with_option(spec: str, option: str) -> str:
    """``cleanup`` → ``cleanup{opt}``; ``cleanup{a=1}`` → ``cleanup{a=1 opt}``."""
    return f"{spec[:-1]} {option}}}" if spec.endswith("}") else f"{spec}{{{option}}}"
