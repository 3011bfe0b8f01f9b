"""The torch targets: ``cpu`` (TorchScript trace + freeze) and ``cuda`` (CUDA graphs)."""
