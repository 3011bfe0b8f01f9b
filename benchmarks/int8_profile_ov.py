"""Where OpenVINO's CPU plugin spends a model's time: mlcomp fp32, mlcomp int8 and NNCF's int8, by layer type.

    .venv/bin/python benchmarks/int8_profile_ov.py --models bert,vit --batch 1       # the tiny third-party rows
    .venv/bin/python benchmarks/int8_profile_ov.py --models transformer --batch 1

Each model (built as ``benchmarks/quantization.py`` builds it) is compiled three ways: mlcomp's
``openvino`` target with its default pipeline (fp32), with the bench's int8 pipeline
(``mlcomp.measure.variants``), and NNCF's int8 as ``benchmarks/quantization.py`` makes it
(``nncf_saved``); each is read back as the saved OpenVINO IR and compiled again as that bench
compiles NNCF's (``ov_config``, one thread) with ``PERF_COUNT`` on.  Per (layer type, executed
precision) of the executed graph: how many layers, microseconds per call summed over them (the
plugin's own per-layer counters, averaged over ``--runs`` calls after warm-up), and the sum over
all layers.  The counts need no clock; the times are this machine's at its current load.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import quantization as Q  # noqa: E402
import torch  # noqa: E402
from mlcomp.measure.variants import Variant  # noqa: E402


def profile(xml: str, arrays: list, runs: int) -> tuple[Counter, Counter]:
    """Layers and microseconds per call by (layer type, executed precision) of ``xml`` compiled for CPU."""
    import openvino as ov
    core = ov.Core()
    request = core.compile_model(core.read_model(xml), "CPU", {**Q.ov_config(1), "PERF_COUNT": True})
    request = request.create_infer_request()
    layers: Counter = Counter()
    micros: Counter = Counter()
    warm = max(2, runs // 10)
    for i in range(warm + runs):
        request.infer(arrays)
        if i < warm:
            continue
        for p in request.profiling_info:
            key = (p.node_type, p.exec_type.rsplit("_", 1)[-1] if p.exec_type else "")
            micros[key] += p.real_time.total_seconds() * 1e6 / runs
            layers[key] += 1
    return Counter({k: v // runs for k, v in layers.items()}), micros


def saved(name: str, module, inputs, work: str) -> dict[str, str]:
    """The three OpenVINO IR files: mlcomp fp32 and int8 (:class:`~mlcomp.measure.variants.Variant`), NNCF."""
    out = {}
    for variant in (Variant("openvino"), Variant("openvino", "int8")):
        got = Q.mlcomp_saved(module, inputs, variant, work, threads=1)
        if isinstance(got, str):
            raise SystemExit(f"{name}: mlcomp {variant.dtype} not built: {got}")
        out[f"mlcomp {variant.dtype}"] = str(got[1] / "model.xml")
    out["nncf"] = os.path.join(work, "nncf.xml")
    Q.nncf_saved(name, module, inputs, out["nncf"])
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bert,vit")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--runs", type=int, default=200)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    for name in args.models.split(","):
        module, inputs = Q.build(name, args.batch)
        with tempfile.TemporaryDirectory() as work, torch.no_grad():
            got = {k: profile(xml, [t.numpy() for t in inputs], args.runs)
                   for k, xml in saved(name, module, inputs, work).items()}
        keys = sorted(set().union(*(set(m) for _, m in got.values())),
                      key=lambda k: -max(m.get(k, 0.0) for _, m in got.values()))
        print(f"\n{name} batch {args.batch}, 1 thread, {args.runs} calls: layers and us per call")
        print(f"{'layer type':18}{'prec':>6}" + "".join(f"{k + ' n':>16}{'us':>9}" for k in got))
        for key in keys:
            if max(m.get(key, 0.0) for _, m in got.values()) < 0.5:
                continue
            print(f"{key[0]:18}{key[1]:>6}" + "".join(f"{n.get(key, 0):16d}{m.get(key, 0.0):9.1f}"
                                                      for n, m in got.values()))
        print(f"{'sum of layers':24}" + "".join(f"{'':16}{sum(m.values()):9.1f}" for _, m in got.values()))


if __name__ == "__main__":
    main()
