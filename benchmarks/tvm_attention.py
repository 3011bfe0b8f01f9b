"""The attention block of the zoo transformer, the ways a TVM build can run it, against eager's own.

    .venv/bin/python benchmarks/tvm_attention.py --batches 32,1 --threads 2,1

One ``nn.MultiheadAttention`` block (d_model 256, 4 heads, sequence 128, batch-first, eval), timed
interleaved in one process, wall clock (run it where the process gets the CPU), median ms per call:

* ``eager``: ``torch._native_multi_head_attention`` (what ``nn.TransformerEncoderLayer``'s fast
  path calls: in-projection without bias, one pass adding the bias, scaling q and splitting heads,
  two batched GEMMs and a softmax, the heads merged, the out-projection);
* ``flash``: the TVM build's kernels: in-projection ``F.linear``, ``scaled_dot_product_attention``
  on strided q/k/v views of its result, out-projection ``F.linear``;
* ``packed``: the same projections, attention by :func:`mlcomp.targets.tvm.kernels.attention_from_packed`
  (what the build runs from two threads);
* ``bmm``: the same with each of q (scaled), k, v copied out of the projection, then ``bmm``, softmax, ``bmm``;
* ``manual``: eager's steps called one by one (``mm``, ``_transform_bias_rescale_qkv``, ``bmm``,
  ``softmax``, ``bmm``, heads merged by a copy, ``F.linear``).

``--kernels``: each variant's torch kernels (``torch.profiler``, ms per call) and minor page faults per call.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def blocks(batch: int, e: int = 256, heads: int = 4, seq: int = 128):
    from mlcomp.targets.tvm.kernels import attention_from_packed, packed_qkv

    torch.manual_seed(0)
    x = torch.randn(batch, seq, e)
    w, b = torch.randn(3 * e, e) / e ** 0.5, torch.randn(3 * e)
    wo, bo = torch.randn(e, e) / e ** 0.5, torch.randn(e)
    d = e // heads
    scale = d ** -0.5

    def views(qkv):
        base = qkv.view(batch, seq, 3, heads, d).permute(2, 0, 3, 1, 4)    # [3, B, H, L, D], strided
        return base[0], base[1], base[2]

    def ours(attend):
        def run():
            q, k, v = views(F.linear(x, w, b))
            out = attend(q, k, v, scale).permute(0, 2, 1, 3).reshape(batch * seq, e)
            return F.linear(out, wo, bo)
        return run

    def eager():
        return torch._native_multi_head_attention(x, x, x, e, heads, w, b, wo, bo, need_weights=False)[0]

    def flash(q, k, v, s):
        return F.scaled_dot_product_attention(q, k, v, scale=s)

    def plain_bmm(q, k, v, s):
        n = batch * heads
        qs = torch.empty(batch, heads, seq, d)
        torch.mul(q, s, out=qs)
        p = torch.softmax(torch.bmm(qs.view(n, seq, d), k.reshape(n, seq, d).transpose(1, 2)), -1)
        return torch.bmm(p, v.reshape(n, seq, d)).view(batch, heads, seq, d)

    def manual():
        qkv = torch.mm(x.view(-1, e), w.t()).view(batch, seq, 3 * e)
        q, k, v = torch._transform_bias_rescale_qkv(qkv, b, heads)
        p = torch.softmax(torch.bmm(q.view(-1, seq, d), k.view(-1, seq, d).transpose(1, 2)), -1)
        out = torch.bmm(p, v.view(-1, seq, d)).view(batch, heads, seq, d)
        return F.linear(out.permute(0, 2, 1, 3).reshape(batch * seq, e), wo, bo)

    return {"eager": eager, "flash": ours(flash), "packed": ours(lambda q, k, v, s: attention_from_packed(packed_qkv(q, k, v), heads, s)), "bmm": ours(plain_bmm),
            "manual": manual}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="32,1")
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--kernels", action="store_true", help="each variant's torch kernels and page faults")
    args = ap.parse_args()
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for batch in (int(b) for b in args.batches.split(",")):
            fns = blocks(batch)
            with torch.no_grad():
                ref = fns["eager"]().reshape(-1, 256)
                errs = {k: float((f().reshape(-1, 256) - ref).abs().max()) for k, f in fns.items()}
                n = max(3, int(0.3 / max(1e-5, _once(fns["eager"]))))
                times = {k: [] for k in fns}
                for _ in range(args.rounds):
                    for k, f in fns.items():
                        times[k].append(_ms(f, n))
            line = "  ".join(f"{k} {statistics.median(v):8.3f} (err {errs[k]:.1e})" for k, v in times.items())
            print(f"threads {threads} batch {batch:3d}: {line}", flush=True)
            if args.kernels:
                _kernels(fns)


def _kernels(fns) -> None:
    import resource

    from tvm_vs_eager import kernel_times

    with torch.no_grad():
        for name, fn in fns.items():
            fn()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            per, wall = kernel_times(fn, 5)
            faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5
            top = sorted(per.items(), key=lambda kv: -kv[1])[:9]
            print(f"    {name}: wall {wall:.3f} ms, {faults:.0f} page faults per call; "
                  + "; ".join(f"{k.split(' [')[0].replace('aten::', '')} {v:.2f}" for k, v in top if v >= 0.01))


def _once(fn) -> float:
    fn()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _ms(fn, n: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e3


if __name__ == "__main__":
    main()
