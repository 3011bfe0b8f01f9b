"""An ONNX Runtime session called with I/O binding over state it updates: a KV cache written in place.

A generator's step takes its cache tensors as inputs and returns them updated
(``ScatterND`` of the input).  :class:`StateBinding` binds each of those outputs to the
memory of the input it updates, and the remaining outputs (the logits) to buffers
allocated once, so a step allocates nothing in Python and ONNX Runtime writes the new
rows into the caller's tensors: its ``ScatterND`` copies its input only when the output
is another buffer.  The step must read each state input only through its update (the
generator checks that on the graph), else a reader after the update would see new rows.

    runner = StateBinding(runtime, {0: 2, 1: 3})        # output 0 updates input 2, output 1 input 3
    logits = runner(ids, k, v)[-1]                      # k and v now hold the step's rows
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

__all__ = ["StateBinding"]

_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: None, torch.int64: np.int64,
          torch.int32: np.int32, torch.bool: np.bool_, torch.float64: np.float64}


def _bind(bind: Any, name: str, tensor: torch.Tensor, output: bool) -> None:
    method = bind.bind_output if output else bind.bind_input
    method(name, "cpu", 0, _NUMPY[tensor.dtype], list(tensor.shape), tensor.data_ptr())


class StateBinding:
    """``(*inputs) -> (*outputs)`` through ``run_with_iobinding``; state outputs are their inputs (see module doc)."""

    how = "in place through onnxruntime's I/O binding"

    def __init__(self, runtime: Any, state: Mapping[int, int], outputs: list[tuple[tuple[int, ...], torch.dtype]]
                 ) -> None:
        self.session, self.state = runtime.session, dict(state)
        self.input_names, self.output_names = runtime.input_names, runtime.output_names
        # outputs that are not state: one buffer each, allocated here, written by every call
        self.buffers = {i: torch.empty(shape, dtype=dtype) for i, (shape, dtype) in enumerate(outputs)
                        if i not in self.state}
        self.binding = self.session.io_binding()
        for i, tensor in self.buffers.items():
            _bind(self.binding, self.output_names[i], tensor, output=True)
        self._bound: list[int] = []
        self._outputs_of: dict[int, list[int]] = {}
        for out, src in self.state.items():
            self._outputs_of.setdefault(src, []).append(out)

    @staticmethod
    def supports(runtime: Any, dtypes: list[torch.dtype]) -> bool:
        return getattr(runtime, "device", "cpu") == "cpu" and all(_NUMPY.get(d) is not None for d in dtypes)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inputs = tuple(t if t.is_contiguous() else t.contiguous() for t in inputs)
        pointers = [t.data_ptr() for t in inputs]
        if len(self._bound) != len(pointers):
            self._bound = [0] * len(pointers)
        for i, (name, tensor) in enumerate(zip(self.input_names, inputs)):
            if pointers[i] != self._bound[i]:        # the cache keeps its storage: only the ids are rebound
                _bind(self.binding, name, tensor, output=False)
                for out in self._outputs_of.get(i, ()):
                    _bind(self.binding, self.output_names[out], tensor, output=True)
                self._bound[i] = pointers[i]
        self.session.run_with_iobinding(self.binding)
        return tuple(inputs[self.state[i]] if i in self.state else self.buffers[i]
                     for i in range(len(self.output_names)))
