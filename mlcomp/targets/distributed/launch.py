"""The per-rank entry point torchrun runs: ``python -m mlcomp.targets.distributed.launch ARTIFACT``.

``mlcomp launch ARTIFACT --nproc N`` starts it on this host through
``torchrun``; across hosts run torchrun yourself with the same arguments::

    $ torchrun --nproc-per-node 2 -m mlcomp.targets.distributed.launch out/mlp-pp --check
    $ torchrun --nnodes 2 --node-rank 0 --master-addr host0 --master-port 29500 \\
          --nproc-per-node 2 -m mlcomp.targets.distributed.launch out/mlp-pp --train --check
    # on host0; the same with --node-rank 1 on host1

Input: an artifact folder of the ``distributed`` target.  Each rank runs
its stages under the chosen schedule; rank 0 prints one JSON line (and writes
it to ``--result``): outputs, and with ``--train`` gradients and the weights
after one step of ``--optimizer`` (a spec such as ``"sgd{lr=0.1}"``, the
default, or ``"adam{lr=1e-3}"``), compared with a single-process run.
``--lr X`` is a deprecated alias of ``--optimizer "sgd{lr=X}"``.  torchrun hands each process its
rank and the rendezvous address; ``torch.distributed`` reads them when the
process group starts (gloo on CPU, NCCL when CUDA is present).  Exit 4 when
``--check`` finds a difference, 2 on a user error, 130 on Ctrl-C; every failure is
one ``error: ...`` line on stderr, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

if __name__ == "__main__":      # a rank: Ctrl-C ends it at once, quietly (also inside gloo or while torch imports)
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import torch
import torch.distributed as dist

from mlcomp.base.errors import MlcompError
from mlcomp.base.files import Kind, check_destination
from mlcomp.runtime.optim import OptimizerSpec
from mlcomp.targets.distributed.target import DEFAULT_OPTIMIZER, check_artifact, run_rank


def backend(local_ranks: int | None = None) -> str:
    """NCCL when each of this host's ranks has a GPU of its own, else gloo on the CPU.

    NCCL refuses two ranks on one device ("invalid usage"), so a 2-process run on a one-GPU
    machine goes through gloo.  ``local_ranks``: torchrun's ``LOCAL_WORLD_SIZE`` when not given.
    """
    local = local_ranks if local_ranks is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local else "gloo"


def optimizer_of(text: str | None, lr: float | None) -> OptimizerSpec:
    """The optimizer of ``--optimizer`` or of the deprecated ``--lr`` (``sgd{lr=...}``, with a note)."""
    if lr is not None and text is not None:
        raise MlcompError("--lr and --optimizer were both given", hint='give the learning rate inside the spec, '
                                                                     'e.g. --optimizer "sgd{lr=0.05}"')
    if lr is not None:
        spec = OptimizerSpec.parse(f"sgd{{lr={lr!r}}}")
        if int(os.environ.get("RANK", "0")) == 0:
            print(f'note: --lr is deprecated; use --optimizer "{spec.text()}"', file=sys.stderr)
        return spec
    return OptimizerSpec.parse(text or DEFAULT_OPTIMIZER)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlcomp.targets.distributed.launch",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved"])
    parser.add_argument("--microbatches", type=int)
    parser.add_argument("--train", action="store_true", help="one training step (loss on the last stage)")
    parser.add_argument("--optimizer", help=f'with --train: an optimizer spec (default "{DEFAULT_OPTIMIZER}")')
    parser.add_argument("--lr", type=float, help='deprecated: the same as --optimizer "sgd{lr=LR}"')
    parser.add_argument("--check", action="store_true", help="compare with a single-process run")
    parser.add_argument("--repeat", type=int, default=0, help="time this many more batches")
    parser.add_argument("--result", help="rank 0 writes the JSON summary here")
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "0")
    try:
        summary = _run(args)
    except KeyboardInterrupt:           # Ctrl-C (torchrun forwards it): no traceback from any rank
        print("interrupted", file=sys.stderr)
        return 130
    except MlcompError as err:          # the same message in every rank: the parent shows it once
        print(f"error: {err.message}", file=sys.stderr)
        return err.exit_code
    except Exception as exc:            # noqa: BLE001 - one line per rank, never a traceback
        text = " ".join(str(exc).split())[:400] or "(no message)"
        print(f"error: rank {rank} failed: {type(exc).__name__}: {text}. If another rank reported an error, "
              "that one is the cause; otherwise this is a bug in mlcomp: run the ranks with torchrun by hand "
              "to see the traceback and report it.", file=sys.stderr)
        return 3
    if summary["this_rank"] == 0:
        print(json.dumps({k: v for k, v in summary.items() if k not in ("ranks", "this_rank")}))
        if args.check and not summary["passed"]:
            print(f"error: the {summary['nproc']}-process run differs from the single-process run of the same "
                  f"stages: max error {summary['max_error']:.3g} over the tolerance. The JSON line above has "
                  "every rank's error", file=sys.stderr)
    return 4 if args.check and not summary["passed"] else 0


def _run(args: argparse.Namespace) -> dict:
    """Join the process group, run this rank, leave the group (also on an error)."""
    optimizer = optimizer_of(args.optimizer, args.lr)
    if args.result:          # a user's file is never replaced (mlcomp.base.files); rank 0 writes it
        check_destination(args.result, Kind.FILE, option="--result", fmt="json", force=True,
                          inputs=(args.artifact,))
    check_artifact(Path(args.artifact))
    dist.init_process_group(backend())
    try:
        return run_rank(args.artifact, schedule=args.schedule, microbatches=args.microbatches, train=args.train,
                        optimizer=optimizer, check=args.check, repeat=args.repeat, result=args.result)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
