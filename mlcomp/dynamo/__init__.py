"""The torch.compile backend: ``torch.compile(model, backend="mlcomp", options={...})`` (see :mod:`.backend`)."""
