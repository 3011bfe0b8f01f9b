"""The public API layer: ``mlcomp.compile``, ``mlcomp.load``, ``mlcomp.export``; the auto target; the compile cache.

::

    import mlcomp
    art = mlcomp.compile("mlp", target="onnxruntime")               # one target
    art = mlcomp.compile("mlp", target="auto", cache="/tmp/mlc")    # fastest verified target, cached
    art.manifest["auto"]["picked"], art.manifest["cache"]["status"]
    ('onnxruntime', 'stored')

One module per concern:

* :mod:`~mlcomp.api.inputs`: checks made before anything is loaded, loading a model source;
* :mod:`~mlcomp.api.lowering`: one compile for one target (pipeline, lowering, verification);
* :mod:`~mlcomp.api.auto.search`: ``target="auto"`` (compile, verify and time every candidate);
* :mod:`~mlcomp.api.cache_key` and :mod:`~mlcomp.api.cache`: the compile cache;
* :mod:`~mlcomp.api.compiler`: ``compile``, ``compile_model`` (cache + auto + one target), ``load``, ``export``.
"""
from __future__ import annotations

from mlcomp.api.auto.search import AUTO, AutoReport, AutoTargetError, Candidate, compile_auto
from mlcomp.api.cache import CacheOutcome, CacheStatus, CompileCache, default_cache_dir
from mlcomp.api.cache_key import CacheKey, cache_key, graph_digest
from mlcomp.api.compiler import compile, compile_model, compile_training_source, export, is_auto, load, open_cache
from mlcomp.api.inputs import check_model_inputs
from mlcomp.api.lowering import CompileResult, compile_source

__all__ = ["compile", "load", "export", "CompileResult", "check_model_inputs", "compile_source", "compile_model",
           "compile_training_source", "compile_auto", "AUTO", "AutoReport", "AutoTargetError", "Candidate",
           "CompileCache", "CacheOutcome", "CacheStatus", "CacheKey", "cache_key", "graph_digest",
           "default_cache_dir", "open_cache", "is_auto"]
