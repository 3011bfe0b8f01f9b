"""The ``quantize`` pass family: int8 post-training quantization (``quantize``) and its op policy (``policy``)."""
