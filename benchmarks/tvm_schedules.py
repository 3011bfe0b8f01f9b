"""Untuned TVM before and after vendor kernels + default schedules, against eager PyTorch.

    .venv/bin/python benchmarks/tvm_schedules.py                          # zoo + HF BERT/ViT, batch 1 and 32
    .venv/bin/python benchmarks/tvm_schedules.py --models resnet18 --batches 32 --threads 1 --no-before

For each (model, batch): ``eager`` (the module under ``torch.no_grad()``), ``tvm-before``
(the untuned build of the last commit, ``git show HEAD:mlcomp/targets/tvm/build.py``:
DLight GEMV/Reduction only, matmul and conv as plain loop nests) and ``tvm-after``
(``get_target("tvm").compile``: conv/matmul in torch's kernels through packed functions,
the rest fused by TVM with mlcomp's ParallelVector schedule), each verified against eager
(max norm-wise relative error).  Timing: interleaved rounds with the order rotated every round,
median per runner (``mlcomp.hardware.timing.measure_interleaved`` per round); the load
average is printed before and after.  ``--threads`` sets torch's and TVM's thread count
(``TVM_NUM_THREADS`` of this benchmark process only, as ``benchmarks/anchors.py`` does).

``--profile`` (with ``--ablate``): each variant's time per VM call (``profile_calls``: TVM's fused
loops, the torch kernels), to see where a gap to eager goes.

``--clock thread`` (with ``--threads 1``): CPU seconds of the calling thread, which a busy shared
machine does not inflate the way it does wall time.

``--ablate``: also the current build without each of the larger rewrites of the kernel offload
(``tvm.offload.rewrite.Fusion``: attention → SDPA, conv/linear epilogues, layer norm, layout views; ``--ablate views``:
only the named ones, comma-separated; ``small-gemms``: without ``tvm.offload.gemm``'s probe, every GEMM
a torch call) and without any of them
(``tvm-no-fusion``, plain ``--ablate`` only) and with all (``tvm-all-fusions``: built the same way, no artifact wrapper, the fair
reference for the others), timed in the same interleaved rounds, to decide which of them pay.

Threads: ``tvm-after`` calls torch's kernels, so its TVM code has no parallel loop
(column "TVM par. loops", from ``stats["schedules"]``) and TVM's thread pool never starts.
``tvm-before`` does start it when its build has parallel loops; its workers busy-wait after
each call, which also slows the runners timed next to it in this process: compare with
``--no-before`` for eager against the current build.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import time

_pre = argparse.ArgumentParser(add_help=False)
_pre.add_argument("--threads", type=int, default=None)
_THREADS = _pre.parse_known_args()[0].threads or os.cpu_count() or 1
os.environ.setdefault("TVM_NUM_THREADS", str(_THREADS))   # read once when TVM's runtime starts

import torch  # noqa: E402

_SMALL = "small-gemms"    # --ablate small-gemms: the build without tvm_gemm's probe (every GEMM in torch)
ZOO = ("mlp", "lenet", "resnet18", "mobilenet", "transformer", "gru")
HF = ("bert", "vit")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _source(name: str, batch: int):
    from mlcomp.models import get
    from mlcomp.models.third_party import build_third_party

    if name in HF:
        return build_third_party(name, batch=batch)
    zoo = get(name)
    return zoo.build(), zoo.example_inputs(batch)


def _before_backend():
    """The last commit's tvm_backend, imported from ``git show`` (what untuned TVM was before)."""
    text = subprocess.run(["git", "show", "HEAD:mlcomp/targets/tvm/build.py"], cwd=REPO, check=True,
                          capture_output=True, text=True).stdout
    path = os.path.join(REPO, "mlcomp-out", "tvm_backend_before.py")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("tvm_backend_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rel(expected, actual) -> float:
    from mlcomp.analysis.verify import compare, flatten_outputs

    return compare(tuple(flatten_outputs(expected)), tuple(flatten_outputs(actual))).max_rel


def profile_calls(module, inputs, repeats: int = 5) -> list[tuple[float, int, str]]:
    """Per VM call of a built ``TvmModule``: (ms per run, calls per run, function), most expensive first.

    The VM's instrument hook (``VirtualMachine.set_instrument``) stamps ``perf_counter`` before and
    after every call instruction (TVM fused loops, torch kernels, allocations), on a second VM of the
    same executable, after two untimed runs.
    """
    import collections

    import tvm
    from tvm import relax

    vm = relax.VirtualMachine(module._ex, tvm.cpu(0))
    main, spent, started = vm["main"], collections.defaultdict(list), {}

    def hook(_func, symbol, before, _ret, *_args):
        if before:
            started[symbol] = time.perf_counter()
        else:
            spent[symbol].append(time.perf_counter() - started.pop(symbol))
        return 0

    with torch.no_grad():
        for _ in range(2):
            main(*inputs)
        vm.set_instrument(hook)
        for _ in range(repeats):
            main(*inputs)
    return sorted(((sum(v) / repeats * 1e3, len(v) // repeats, k) for k, v in spent.items()), reverse=True)


def run(name: str, batch: int, *, before: bool, budget: float, rounds: int, ablate: str | None = None,
        clock=time.perf_counter, profile: bool = False) -> dict:
    from mlcomp.frontend.loading import load_model
    from mlcomp.hardware.timing import TimingPolicy, measure_interleaved
    from mlcomp.targets import CompileOptions, get_target
    from mlcomp.runtime.codegen import to_fx

    module, inputs = _source(name, batch)
    with torch.no_grad():
        expected = module(*inputs)
    graph = load_model(module, example_inputs=inputs).capture()
    runners, row = {"eager": lambda: module(*inputs)}, {"model": name, "batch": batch}
    t0 = time.perf_counter()
    art = get_target("tvm").compile(graph, CompileOptions(threads=_THREADS))
    row["compile_after_s"] = round(time.perf_counter() - t0, 1)
    row["err_after"] = _rel(expected, art(*inputs))
    row["kernels"] = art.runtime.stats.get("kernels")
    row["schedules"] = art.runtime.stats.get("schedules")
    runners["tvm-after"] = lambda: art(*inputs)
    if ablate:
        from mlcomp.targets.tvm.build import BuildConfig, build
        from mlcomp.targets.tvm.offload.rewrite import ALL_FUSIONS, Fusion

        # tvm-all-fusions: the same build as tvm-after without the artifact's call wrapper (threads, checks)
        names = ablate.split(",")
        off = list(Fusion) if ablate == "all" else [Fusion(v) for v in names if v != _SMALL]
        variants = ({"tvm-all-fusions": (ALL_FUSIONS, True)}
                    | {f"tvm-no-{f.value}": (ALL_FUSIONS - {f}, True) for f in off}
                    | ({f"tvm-no-{_SMALL}": (ALL_FUSIONS, False)} if ablate == "all" or _SMALL in names else {})
                    | ({"tvm-no-fusion": (frozenset(), True)} if ablate == "all" else {}))
        row["ablations"] = list(variants)
        fx = to_fx(graph).eval()
        for label, (fusions, small) in variants.items():
            mod = build(fx, inputs, BuildConfig(fusions=fusions, small_gemms=small, threads=_THREADS))
            row[f"err_{label}"] = _rel(expected, mod(*inputs))
            runners[label] = (lambda m: lambda: m(*inputs))(mod)
            if profile:
                row[f"profile_{label}"] = [(round(ms, 3), n, fn) for ms, n, fn in profile_calls(mod, inputs)]
    if before:
        t0 = time.perf_counter()
        old = _before_backend().build(to_fx(graph).eval(), inputs)
        row["compile_before_s"] = round(time.perf_counter() - t0, 1)
        row["err_before"] = _rel(expected, old(*inputs))
        runners["tvm-before"] = lambda: old(*inputs)
    names = list(runners)
    samples: dict[str, list[float]] = {k: [] for k in names}
    with torch.no_grad():
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            got = measure_interleaved({k: runners[k] for k in order},
                                      TimingPolicy(warmup=1 if r else 3, budget_s=budget / rounds, min_repeats=1),
                                      clock=clock)
            for k, t in got.items():
                samples[k].append(t.median)
    for k in names:
        row[f"{k}_ms"] = round(statistics.median(samples[k]) * 1e3, 3)
    row["speedup_vs_eager"] = round(row["eager_ms"] / row["tvm-after_ms"], 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(ZOO + HF))
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--threads", type=int, default=None, help="torch and TVM threads (default: all cores)")
    ap.add_argument("--no-before", action="store_true", help="skip the last commit's untuned build (slow)")
    ap.add_argument("--budget", type=float, default=4.0, help="seconds of timing per runner")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--ablate", nargs="?", const="all", default=None,
                    help="also time the build without each offload fusion (or only those named: --ablate views)")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="thread: CPU time of the calling thread (with --threads 1, robust to a shared machine)")
    ap.add_argument("--profile", action="store_true",
                    help="with --ablate: also time every VM call of each variant (where the time goes)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(_THREADS)
    print(f"# load before: {os.getloadavg()}, threads {_THREADS}", flush=True)
    rows = []
    for name in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            row = run(name, batch, before=not args.no_before, budget=args.budget, rounds=args.rounds,
                      ablate=args.ablate, clock=time.thread_time if args.clock == "thread" else time.perf_counter,
                      profile=args.profile)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"# load after: {os.getloadavg()}")
    print(f"threads {_THREADS}, clock {args.clock}")
    print("| model@batch | eager ms | tvm before ms | tvm after ms | speedup vs eager | max rel err | compile s "
          "| TVM par. loops |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']}@{r['batch']} | {r['eager_ms']} | {r.get('tvm-before_ms', '—')} | {r['tvm-after_ms']} | "
              f"{r['speedup_vs_eager']} | {r['err_after']:.1e} | {r['compile_after_s']} | "
              f"{(r['schedules'] or {}).get('parallel_loops', '—')} |")
    ablations = rows[0].get("ablations", []) if rows else []
    if ablations:
        print("\n| model@batch | eager ms | tvm ms | " + " | ".join(f"{a} ms" for a in ablations) + " |")
        print("|---" * (3 + len(ablations)) + "|")
        for r in rows:
            print(f"| {r['model']}@{r['batch']} | {r['eager_ms']} | {r['tvm-after_ms']} | "
                  + " | ".join(str(r[f"{a}_ms"]) for a in ablations) + " |")
    for r in rows:
        for label in r.get("ablations", []) if args.profile else []:
            print(f"\n{r['model']}@{r['batch']} {label}: ms per run, calls, VM function")
            for ms, n, fn in r[f"profile_{label}"][:12]:
                print(f"  {ms:9.2f}  x{n:<3d} {fn}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
