"""Precision passes: mixed-precision (``mixed``) and the per-op rules it follows (``policy``)."""
