"""Precision passes: mixed-precision (``mixed``), the per-op rules it follows (``policy``), loss-scale (``loss_scale``)."""
