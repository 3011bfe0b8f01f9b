"""mlcomp's passes (``mlcomp.passes``), one module per family.

* ``cleanup`` — dce, cse, simplify and the ``cleanup`` fixed point; ``folding`` — fold-constants;
* ``fusion_patterns`` — fold-batchnorm, fold-bias; ``attention`` — fuse-attention; ``recompose`` — recompose;
* ``fusion`` — fuse-elementwise / fuse-epilogue (FuseOps-style groups) and ``fuse``;
* ``patterns`` (op constants and matching helpers) and ``builder`` (writing IR) are shared by all.

Passes are found by name through :mod:`mlcomp.pipeline.pass_base`; ``mlcomp passes`` lists them.
"""
