"""The figures the textbook chapter reports, kept as data so studies can print them beside ours.

Sources (see ``/work/shared/seeds/README.md``): the "Computational Performance"
chapter in its MXNet edition (``MX``, sections 12.1-12.3) and the same chapter
as PyTorch notebooks (``PT``).  These are *their* measurements on *their*
machines; every study prints them in a separate column labelled as the chapter's.
"""
from __future__ import annotations

MX = "MXNet ed."
PT = "PyTorch nb."


def cite(value: str, edition: str, section: str) -> str:
    """``0.5037 s (MXNet ed. §12.1)``."""
    return f"{value} ({edition} §{section})"


# 12.1: an MLP 512-256-128-2 called on one 1x512 sample
HYBRIDIZE = {   # by position: the shorter loop is the chapter's 1000 calls, the longer its 10000
    ("eager", 0): cite("0.5037 s for 1000 calls", MX, "12.1"),       # without hybridization
    ("compiled", 0): cite("0.1873 s for 1000 calls", MX, "12.1"),    # with hybridization
    ("eager", 1): cite("0.7279 s for 10000 calls", PT, "12.1"),      # without TorchScript
    ("compiled", 1): cite("0.6189 s for 10000 calls", PT, "12.1"),   # torch.jit.script
}
HYBRIDIZE_SECONDS = {("eager", 0): 0.5037, ("compiled", 0): 0.1873, ("eager", 1): 0.7279, ("compiled", 1): 0.6189}

# 12.2.1: ten times (1000x1000 normal sample, then a matrix product)
ASYNC_MATMUL = {
    "numpy": cite("0.4711 s", MX, "12.2.1"),
    "no barrier": cite("0.0015 s", MX, "12.2.1"),           # returned before the work ran
    "barrier": cite("0.5186 s", MX, "12.2.1"),              # waitall before the clock stops
}
# 12.2.3: 1000 increments y = x + 1 with a barrier after each vs one at the end
ASYNC_STEPS = {
    "barrier each step": cite("0.0455 s", MX, "12.2.3"),
    "one barrier": cite("0.0420 s", MX, "12.2.3"),
}

# 12.2.4: 150 batches of 1024x512 through an MLP 512-2048-512-1, SGD, L2 loss
MEMORY = {
    "barrier": {"epoch": cite("9.9052 s", MX, "12.2.4"), "growth": cite("+21.576 MB", MX, "12.2.4"),
                "batch50": cite("3.3045 s", MX, "12.2.4")},
    "no barrier": {"epoch": cite("11.0265 s", MX, "12.2.4"), "growth": cite("+3.248 MB", MX, "12.2.4"),
                   "batch50": cite("0.1188 s", MX, "12.2.4")},
}
MEMORY_NOTE = ("The chapter's own memory figures show more growth *with* the barrier (21.6 MB) than "
               "without (3.2 MB), the opposite of what its text argues; its per-batch timestamps "
               "(0.12 s at batch 50 without a barrier vs 3.30 s with) are what show the frontend "
               "running ahead.")

# 12.3.1: ten 2000x2000 matrix products on each device; 12.3.2: then copy the results to the host
PARALLEL = {
    "cpu": cite("0.6551 s", MX, "12.3.1"),
    "gpu": cite("0.1667 s", MX, "12.3.1"),
    "both": cite("0.7408 s", MX, "12.3.1"),
    "compute": cite("0.1657 s", MX, "12.3.2"),
    "copy": cite("0.0961 s", MX, "12.3.2"),
    "compute+copy": cite("0.1936 s", MX, "12.3.2"),
}

# 12.4 (hardware): main memory and per-device numbers quoted in the chapter and the lectures
HARDWARE = {
    "dram_bw": "40-100 GB/s for 2-4 DDR4 channels (MXNet ed. §12.4.2)",
    "dram_latency": "~100 ns first access, ~0.2 ns per burst word (MXNet ed. §12.4.2)",
    "V100": "15.7 TFLOP/s fp32, 125 TFLOP/s fp16 tensor, 900 GB/s HBM2 (HPC lecture; accelerators tutorial)",
    "A100": "19.5 TFLOP/s fp32, 312 TFLOP/s fp16 tensor, 1.6 TB/s (40 GB) (HPC lecture)",
}
