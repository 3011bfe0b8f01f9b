"""The ONNX Runtime target: the emitter (``emit*``), the torch.onnx export path, ORT patterns and precision."""
