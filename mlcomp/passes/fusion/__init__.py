"""Fusion passes: fuse-elementwise / fuse-epilogue / fuse (``fusion``), fold-batchnorm / fold-bias (``folds``),
fuse-attention (``attention``), recompose (``recompose``)."""
