"""Untuned TVM against eager, op by op, in one process: which op of the TVM build takes the time.

    .venv/bin/python benchmarks/tvm_vs_eager.py                        # every row, 1 thread
    .venv/bin/python benchmarks/tvm_vs_eager.py --rows unet@1,transformer@1 --profile --threads 2

Rows: the zoo at batch 1, the third-party models at batch 2 and ``unet@1`` (a small UNet defined
here: conv+bias+BatchNorm+relu blocks, max-pool down, ``ConvTranspose2d`` up, skip concats, 64x64); a row
without ``@`` is an architecture of the support matrix on its own example inputs
(:mod:`mlcomp.models.architectures`), and ``--rows matrix`` is every one of them buildable here.
Each row builds the default untuned CPU build (``BuildConfig(deterministic=True)``), then times
eager and TVM interleaved, five rounds, in **process CPU time** (``time.process_time``: on a shared,
loaded machine a process's own CPU time moves far less than the wall clock; ``--clock wall`` where the
process gets the CPU, as at several threads CPU time counts waiting threads too) and prints the median
ratio eager / TVM (above 1: TVM is faster).  ``--profile``: the TVM build's calls one by one (the
Relax VM's instrument hook, CPU time per call, summed per function), heaviest first.  ``--kernels``:
the torch kernels both sides run (``torch.profiler``, self time on the calling thread, wall clock:
run it where the process gets the CPU), side by side per kernel and input shapes, interleaved over
the rounds, and each side's wall time per call outside any torch kernel (Python, the VM, idle).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch import nn

ROWS = ("unet@1", "mlp@1", "lenet@1", "resnet18@1", "gru@1", "mobilenet@1", "transformer@1", "bert@2", "vit@2",
        "gru-tagger@2")


def _block(i: int, o: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(),
                         nn.Conv2d(o, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU())


class SmallUNet(nn.Module):
    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.e1, self.e2, self.e3 = _block(3, c), _block(c, 2 * c), _block(2 * c, 4 * c)
        self.up2, self.d2 = nn.ConvTranspose2d(4 * c, 2 * c, 2, stride=2), _block(4 * c, 2 * c)
        self.up1, self.d1 = nn.ConvTranspose2d(2 * c, c, 2, stride=2), _block(2 * c, c)
        self.out = nn.Conv2d(c, 2, 1)

    def forward(self, x):
        a = self.e1(x)
        b = self.e2(nn.functional.max_pool2d(a, 2))
        m = self.e3(nn.functional.max_pool2d(b, 2))
        y = self.d2(torch.cat([self.up2(m), b], 1))
        return self.out(self.d1(torch.cat([self.up1(y), a], 1)))


def model(row: str):
    from mlcomp.models import ZOO
    from mlcomp.models.third_party import build_third_party

    from mlcomp.models.architectures import build_architecture

    if "@" not in row:
        return build_architecture(row)
    name, batch = row.split("@")
    if name == "unet":
        torch.manual_seed(0)
        return SmallUNet().eval(), (torch.randn(int(batch), 3, 64, 64),)
    if name in ZOO:
        return ZOO[name].build(seed=0).eval(), ZOO[name].example_inputs(int(batch))
    return build_third_party(name, int(batch))


def cpu_ms(fn, n: int, clock=time.process_time) -> float:
    for _ in range(3):
        fn()
    start = clock()
    for _ in range(n):
        fn()
    return (clock() - start) / n * 1e3


def profile(built, inputs, calls: int = 20) -> list[tuple[str, float, int]]:
    """(function, CPU ms per model call, calls per model call) of the build's VM, heaviest first."""
    import tvm
    from tvm import relax

    vm = relax.VirtualMachine(built._ex, tvm.cpu(0))
    total, count, began = defaultdict(float), defaultdict(int), {}

    def hook(func, name, before, ret, *args):
        now = time.process_time()
        if before:
            began[name] = now
        else:
            total[name] += now - began.pop(name, now)
            count[name] += 1
        return 0

    args = [tvm.runtime.tensor(t.numpy()) for t in inputs]
    for _ in range(3):
        vm["main"](*args)
    vm.set_instrument(hook)
    for _ in range(calls):
        vm["main"](*args)
    return sorted(((k, v / calls * 1e3, count[k] // calls) for k, v in total.items()), key=lambda r: -r[1])


def kernel_times(fn, calls: int) -> tuple[dict[str, float], float]:
    """(kernel and shapes -> self ms per call, wall ms per call) of ``calls`` calls under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        wall = (time.perf_counter() - start) / calls * 1e3
    per: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages(group_by_input_shape=True):
        shapes = ",".join("x".join(map(str, s)) for s in ev.input_shapes if s)
        per[f"{ev.key} [{shapes}]"] += ev.self_cpu_time_total / 1e3 / calls
    return per, wall


def kernels(module, built, inputs, calls: int = 3, rounds: int = 5) -> None:
    """Print the torch kernels of eager and the TVM build side by side (median ms per call over rounds)."""
    sides = {"eager": lambda: module(*inputs), "tvm": lambda: built(*inputs)}
    got: dict[str, list[tuple[dict[str, float], float]]] = {k: [] for k in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            got[name].append(kernel_times(fn, calls))
    med = {name: {k: statistics.median(r[0].get(k, 0.0) for r in runs) for k in set().union(*(r[0] for r in runs))}
           for name, runs in got.items()}
    walls = {name: statistics.median(r[1] for r in runs) for name, runs in got.items()}
    keys = sorted(set(med["eager"]) | set(med["tvm"]), key=lambda k: -max(med["eager"].get(k, 0), med["tvm"].get(k, 0)))
    print(f"    {'kernel [input shapes]':78s} {'eager':>8s} {'tvm':>8s}  (ms per call, self, wall clock)")
    for k in keys:
        e, t = med["eager"].get(k, 0.0), med["tvm"].get(k, 0.0)
        if max(e, t) >= 0.002 * walls["eager"]:
            print(f"    {k[:78]:78s} {e:8.3f} {t:8.3f}")
    for name in sides:
        inside = sum(med[name].values())
        print(f"    {name}: wall {walls[name]:.3f} ms per call (profiled), in torch kernels {inside:.3f}, "
              f"outside {walls[name] - inside:.3f}")


def main() -> None:
    import mlcomp
    from mlcomp.hardware.probe import machine_line
    from mlcomp.targets.tvm.build import BuildConfig, build

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="process CPU time (default) or wall clock (only where the process gets the CPU)")
    ap.add_argument("--compile", action="store_true",
                    help="build through mlcomp.compile(target='tvm', pipeline='-O2') as a user's compile does (its "
                         "capture: decoders too; its measured choices), not the deterministic build of the module")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--kernels", action="store_true", help="torch kernels of both sides, wall clock, side by side")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line())
    rows = args.rows.split(",")
    if rows == ["matrix"]:
        from mlcomp.models.architectures import available_architectures
        rows = available_architectures()[0]
    for row in rows:
        module, inputs = model(row)
        try:
            built = (mlcomp.compile(module, inputs, target="tvm", pipeline="-O2", threads=args.threads).runtime.module
                     if args.compile else build(module, inputs, BuildConfig(deterministic=True)))
        except Exception as exc:  # noqa: BLE001 - one row's failure is printed, the others still run
            print(f"{row:14s} build failed: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}")
            continue
        with torch.no_grad():
            n = max(5, min(200, int(100 / max(cpu_ms(lambda: module(*inputs), 3), 0.01))))
            clock = time.process_time if args.clock == "cpu" else time.perf_counter
            rounds = [(cpu_ms(lambda: module(*inputs), n, clock), cpu_ms(lambda: built(*inputs), n, clock))
                      for _ in range(5)]
        eager, tvm_ms = (statistics.median(r[i] for r in rounds) for i in (0, 1))
        ratio = statistics.median(e / t for e, t in rounds)
        print(f"{row:14s} eager {eager:8.3f} ms  tvm {tvm_ms:8.3f} ms  eager/tvm {ratio:.2f}  "
              f"heavy ops in TVM code: {built.stats['offload']['in_tvm']}")
        if args.profile:
            for name, ms, k in profile(built, inputs)[:12]:
                print(f"    {name[:56]:56s} {ms:8.3f} ms x{k}")
        if args.kernels:
            with torch.no_grad():
                kernels(module, built, inputs)


if __name__ == "__main__":
    main()
