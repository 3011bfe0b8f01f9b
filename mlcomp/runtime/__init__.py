"""What a compiled model is once built: the artifact format, loading, and the runtimes.

* ``artifact`` — :class:`Artifact` (the folder format, manifest, verification) and the
  runtime kinds (``RUNTIMES``: kind → ``"module:Class"`` that loads its payload);
* ``manifest`` — the folder's ``manifest.json``: format and version, validation, payload checksums, decisions;
* ``codegen`` — IR graph → ``torch.fx.GraphModule`` (every target starts from it, and the eager
  runtime runs it);
* ``eager`` — :class:`EagerRuntime` and :class:`PartitionedRuntime` (``--fallback eager``);
* ``timing_worker`` — the process that loads one artifact and times its calls;
* ``optim`` — optimizer specs (``sgd{lr=0.05 momentum=0.9}``), stepped by training artifacts and distributed ranks.

This layer sits below :mod:`mlcomp.targets` and never imports it: payload loaders and the
target lookup are named by ``"module:attr"`` strings and imported when an artifact is loaded.
"""
