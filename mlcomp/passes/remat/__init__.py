"""Rematerialization: the ``remat`` pass, the problem it poses, and its solvers."""
