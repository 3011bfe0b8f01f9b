"""Which Relax ops of a TVM build run in torch kernels (``rewrite``), and the rewrites per op family."""
