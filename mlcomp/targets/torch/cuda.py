"""The ``cuda`` target: frozen TorchScript on a CUDA device, replayed as a CUDA graph.

::

    art = get_target("cuda").compile(graph, CompileOptions())      # device "cuda:0"
    y = art(x)            # x on cpu or cuda; y stays on the GPU until you read it

Small batches on a GPU are launch-bound: each op is a kernel launch of a few
microseconds.  For static shapes the whole forward is captured once into a
``torch.cuda.CUDAGraph`` (after warm-up on a side stream) and each call is one
``replay()``: the inputs are copied into the graph's static input buffers, the
graph is replayed, and the static outputs are cloned on the same stream.
Nothing synchronises the host; a result is waited for only when it is read
(``.cpu()``, ``.item()``, printing).  Dynamic shapes, ``cuda_graphs=False``, or a
graph the ``place`` pass put partly on the CPU (``place{devices=[cuda:0,cpu]}``:
the generated code copies values between the devices) run the frozen TorchScript
module directly.  fp32 graphs compute in IEEE fp32 (:func:`fp32_math`; the ``tf32``
option opts into TF32 tensor cores at a declared tolerance).

The payload is the same frozen ``model.pt`` as the cpu target's (weights on
the GPU); the CUDA graph is captured again after loading.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, Iterator

import torch
from mlcomp.runtime.artifact import RuntimeKind
from mlcomp.targets.base import CompileOptions, Target
from mlcomp.targets.capabilities import TORCH_CUDA
from mlcomp.targets.torch.cpu import frozen_bytes, trace_frozen

from mlcomp.base.errors import MlcompError
from mlcomp.ir import Graph

__all__ = ["CudaTarget", "CudaRuntime", "TF32_RTOL", "fp32_math"]

PAYLOAD = "model.pt"


# TF32 rounds each product's inputs to a 10-bit mantissa (unit roundoff 2^-11 ~ 4.9e-4); sums stay fp32.
# Measured on an H100, ResNet-18's logits differ from fp32 eager by 2-4e-4 relative; ten unit roundoffs
# leave room for deeper models.
TF32_RTOL = 5e-3


@contextmanager
def fp32_math(tf32: bool = False) -> Iterator[None]:
    """cuBLAS and cuDNN fp32 math while the block runs: IEEE fp32, or TF32 tensor cores when ``tf32``.

    torch lets cuDNN convolutions use TF32 by default on Ampere and later; an fp32 graph then
    differs from fp32 eager on the CPU by ~3e-4 relative on a ResNet-18, which verification at
    fp32's tolerance rightly refuses.  An fp32 artifact computes in IEEE fp32 unless it was compiled
    with ``tf32=True`` (then it declares :data:`TF32_RTOL`).  Scoped: the process's flags are
    restored on exit; a CUDA graph captured inside keeps the kernels chosen here, and a trace records
    the flag in every ``aten::_convolution`` it writes.
    """
    matmul, conv = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, conv


class CudaRuntime:
    """Frozen TorchScript on CUDA, replayed as one CUDA graph for static shapes."""

    kind: ClassVar[RuntimeKind] = RuntimeKind.CUDA_GRAPH

    def __init__(self, payload: bytes, *, device: str, input_shapes: list[tuple[int, ...]] | None,
                 input_dtypes: list[str], use_graph: bool, keep_devices: bool = False,
                 tf32: bool = False) -> None:
        import io

        self.payload = payload
        self.device = torch.device(device)
        self.input_shapes = input_shapes
        self.input_dtypes = input_dtypes
        self.keep_devices = keep_devices   # placed on GPU and CPU: each weight stays where it was traced
        self.tf32 = tf32
        self.declared_rtol = TF32_RTOL if tf32 else None   # Artifact.new: the verification default
        self.module = torch.jit.load(io.BytesIO(payload), map_location=None if keep_devices else self.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        if use_graph and input_shapes is not None:
            self._capture([getattr(torch, d) for d in input_dtypes])

    def _capture(self, dtypes: list[torch.dtype]) -> None:
        """Warm up on a side stream (TorchScript specialises in its first calls), then capture."""
        assert self.input_shapes is not None
        self.static_inputs = [torch.zeros(s, dtype=d, device=self.device)
                              for s, d in zip(self.input_shapes, dtypes)]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.no_grad(), fp32_math(self.tf32):
            for _ in range(3):
                self.module(*self.static_inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.no_grad(), fp32_math(self.tf32):
            outs = self.module(*self.static_inputs)
        self.static_outputs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
        self.graph = graph

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.graph is None:
            with torch.no_grad(), fp32_math(self.tf32):
                return tuple(self.module(*(t.to(self.device, non_blocking=True) for t in inputs)))
        for buf, t in zip(self.static_inputs, inputs):
            buf.copy_(t, non_blocking=True)   # same stream as the replay: ordered, no host sync
        self.graph.replay()
        # the static outputs are overwritten by the next replay: hand out copies (stream-ordered)
        return tuple(o.clone() for o in self.static_outputs)

    def save(self, directory: Path) -> dict[str, Any]:
        (directory / PAYLOAD).write_bytes(self.payload)
        return {"file": PAYLOAD, "device": str(self.device), "cuda_graph": self.graph is not None,
                "input_shapes": [list(s) for s in self.input_shapes] if self.input_shapes else None,
                "input_dtypes": self.input_dtypes, "keep_devices": self.keep_devices, "tf32": self.tf32}

    @classmethod
    def load(cls, directory: Path, info: dict[str, Any]) -> "CudaRuntime":
        if not torch.cuda.is_available():
            raise MlcompError("this artifact runs on CUDA, but torch.cuda.is_available() is False here",
                              hint="load it on a machine with an NVIDIA GPU, or compile for --target cpu")
        shapes = [tuple(s) for s in info["input_shapes"]] if info.get("input_shapes") else None
        return cls((directory / info.get("file", PAYLOAD)).read_bytes(), device=info.get("device", "cuda:0"),
                   input_shapes=shapes, input_dtypes=info.get("input_dtypes", []),
                   use_graph=bool(info.get("cuda_graph")), keep_devices=bool(info.get("keep_devices")),
                   tf32=bool(info.get("tf32")))


class CudaTarget(Target):
    name = "cuda"
    description = "TorchScript trace + freeze on CUDA, static shapes replayed as CUDA graphs"
    default_device = "cuda:0"
    runs_composites_in_torch = True
    # one device: a CUDA graph captures the stream of one GPU
    capabilities = TORCH_CUDA   # training graphs: mlcomp.training.step

    def available(self) -> str | None:
        if not torch.cuda.is_available():
            return "no CUDA device (torch.cuda.is_available() is False)"
        return None

    def build(self, graph: Graph, options: CompileOptions, inputs: tuple[torch.Tensor, ...]) -> CudaRuntime:
        device = self.device(options)   # mode, dtypes and device were checked by compile()
        static = not any(n.tensor_meta.is_dynamic for n in graph.input_nodes)
        # nodes placed on the CPU (the place pass) run on the host: no CUDA graph can capture them
        host = any(n.ann.device and torch.device(n.ann.device).type != "cuda" for n in graph.call_nodes())
        with fp32_math(options.tf32):   # a trace records cuDNN's allow_tf32 in each aten::_convolution
            payload = frozen_bytes(trace_frozen(graph, inputs, device=device))
        return CudaRuntime(payload, device=device, keep_devices=host, tf32=options.tf32,
                           input_shapes=[tuple(t.shape) for t in inputs] if static else None,
                           input_dtypes=[str(t.dtype).replace("torch.", "") for t in inputs],
                           use_graph=options.cuda_graphs and static and not host)
