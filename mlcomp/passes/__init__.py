"""mlcomp's passes (``mlcomp.passes``), one subpackage per family.

* ``cleanup/`` — ``cleanup``: dce, cse, simplify and the ``cleanup`` fixed point; ``folding``: fold-constants;
* ``fusion/`` — ``fusion``: fuse-elementwise / fuse-epilogue (FuseOps-style groups) and ``fuse``;
  ``folds``: fold-batchnorm, fold-bias; ``recompose``: recompose;
* ``precision/`` — ``mixed``: mixed-precision; ``policy``: its per-op rules;
* ``quantize/`` — ``quantize``: int8 Q/DQ pairs; ``policy``: the int8 ops; ``observe``: calibration ranges;
* ``prune/`` — ``prune``, its ``rewrite``, and the channel analyses only it uses (``channel_*``);
* ``remat/`` — ``remat``, its ``problem`` and ``solvers``;
* ``placement/`` — ``place`` and ``partition``;
* ``patterns`` (op constants and matching helpers), ``builder`` (writing IR), ``attention`` (fuse-attention)
  and ``projections`` (split-projections; ``rows``: a linear's rows reordered once; ``layouts``: a
  reshape/permute run composed), which ``quantize`` runs first, are shared by all.

Passes are found by name through :mod:`mlcomp.pipeline.pass_base`; ``mlcomp passes`` lists them.
"""
