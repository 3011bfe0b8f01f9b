"""Device placement (``place``) and pipeline partitioning (``partition``)."""
