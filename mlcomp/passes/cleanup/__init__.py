"""Cleanup passes: dce, cse, simplify, the ``cleanup`` fixed point (``cleanup``); fold-constants (``folding``)."""
