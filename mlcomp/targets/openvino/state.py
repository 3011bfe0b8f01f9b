"""An OpenVINO infer request over state it updates: each state output copied straight into its input.

OpenVINO returns outputs in the request's own buffers.  :class:`StateCopy` copies each
state output (a generator's updated KV cache tensor) into the caller's tensor it updates,
and the other outputs (the logits) into buffers allocated once: one copy per state tensor
and step, no allocation, where the plain runtime call hands out a fresh copy of every output.

    runner = StateCopy(runtime, {0: 2, 1: 3}, outputs)   # output 0 updates input 2, output 1 input 3
    logits = runner(ids, k, v)[-1]                      # k and v now hold the step's rows
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

__all__ = ["StateCopy"]


class StateCopy:
    """``(*inputs) -> (*outputs)``: state outputs are their inputs, rewritten (see module doc)."""

    how = "by OpenVINO's outputs copied into it after each step (no allocation)"

    def __init__(self, runtime: Any, state: Mapping[int, int], outputs: list[tuple[tuple[int, ...], torch.dtype]]
                 ) -> None:
        self.request, self.state = runtime.request, dict(state)
        self.buffers = {i: torch.empty(shape, dtype=dtype) for i, (shape, dtype) in enumerate(outputs)
                        if i not in self.state}
        self.count = len(outputs)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.request.infer([t.numpy() for t in inputs], share_inputs=True)
        for i in range(self.count):
            target = inputs[self.state[i]] if i in self.state else self.buffers[i]
            np.copyto(target.numpy(), self.request.get_output_tensor(i).data)
        return tuple(inputs[self.state[i]] if i in self.state else self.buffers[i] for i in range(self.count))
