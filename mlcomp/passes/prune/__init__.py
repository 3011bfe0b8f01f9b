"""Channel pruning: the ``prune`` pass, its graph rewrite, and the channel analyses only it uses."""
