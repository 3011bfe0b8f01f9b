"""The distributed target (``target``) and the per-rank entry point torchrun runs (``launch``)."""
