"""``mlcomp run DIR``: load a saved artifact, run it on input files or random inputs, write its outputs.

Outputs are named after the model's outputs (dict keys, named-tuple fields,
``--output-names``, else ``output``, ``output_1`` ...), as ``mlcomp compile``
recorded them in the manifest::

    output: [1, 2] float32 [-0.05588, 0.1556]        (the IR's name would be addmm_2)

    $ mlcomp run out/r18 --input x.npy --output y.npz      # y.npz holds "output"
    $ mlcomp run out/r18 --verify --json                    # the same facts as JSON

Registered lazily by :mod:`mlcomp.cli.main`.
"""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from mlcomp.base.errors import InputSpecError
from mlcomp.base.files import Kind, check_destination

__all__ = ["run_cmd"]


def _read_inputs(files: Sequence[str]) -> list[Any]:
    import numpy as np
    import torch

    values: list[Any] = []
    for name in files:
        path = Path(name)
        suffix = path.suffix.lower()
        try:
            if suffix == ".npy":
                values.append(torch.from_numpy(np.load(path, allow_pickle=False)))
            elif suffix == ".npz":
                with np.load(path, allow_pickle=False) as data:
                    values.extend(torch.from_numpy(data[k]) for k in data.files)
            elif suffix in (".pt", ".pth"):
                obj = torch.load(path, map_location="cpu", weights_only=True)
                values.extend(obj if isinstance(obj, (list, tuple)) else [obj])
            else:
                raise InputSpecError(f"input file {name} is neither .npy, .npz nor .pt",
                                     hint="save inputs with numpy.save or torch.save")
        except (OSError, ValueError, RuntimeError) as exc:
            raise InputSpecError(f"input file {name} could not be read: {exc}",
                                 hint="give a .npy/.npz written by numpy or a .pt holding tensors") from None
    return values


@click.command("run")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("-i", "--input", "input_files", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Input tensor file (.npy, .npz or .pt); repeat per input. Default: random inputs.")
@click.option("-o", "--output", type=click.Path(), default=None,
              help="Write the outputs to this .npz (or .pt) file, keyed by the model's output names.")
@click.option("--verify", "do_verify", is_flag=True,
              help="Run the artifact's stored reference inputs and compare with eager outputs.")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True,
              help="Run this many times and report the median latency.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the same facts (artifact, verification, latency, outputs) as one JSON object.")
@click.option("--force", is_flag=True, help="Replace an earlier mlcomp output at --output (never a user's file).")
def run_cmd(directory: Path, input_files: tuple[str, ...], output: str | None, do_verify: bool,
            repeat: int, as_json: bool = False, force: bool = False) -> None:
    """Load the artifact in DIRECTORY and run it."""
    import statistics

    from mlcomp.runtime.artifact import Artifact

    if output:
        if not output.endswith(tuple(_OUTPUT_FORMATS)):
            raise InputSpecError(f"--output {output} must end in .npz or .pt",
                                 hint="name the file out.npz (numpy) or out.pt (torch)")
        check_destination(output, Kind.FILE, option="--output", fmt=_OUTPUT_FORMATS[Path(output).suffix],
                          force=force, inputs=(directory,))
    say = (lambda text: None) if as_json else click.echo
    art = Artifact.load(directory)
    facts: dict[str, Any] = {"artifact": str(directory), "model": art.manifest["model"], "target": art.target,
                             "inputs": [str(s) for s in art.inputs]}
    say(f"loaded {art.manifest['model']} for {art.target} ({', '.join(map(str, art.inputs))})")
    if do_verify:
        result = art.verify(record=False, raise_on_failure=False)   # from the seed eager ran from
        facts["verification"] = result.to_json()
        say(f"verified against stored eager outputs: {result.summary()}")
        result.raise_if_failed(where=f"artifact {directory}")
        if not input_files and not output and repeat == 1:
            if as_json:
                click.echo(json.dumps(facts, indent=2, default=str))
            return
    if input_files:
        inputs = tuple(_read_inputs(input_files))
        source = "the inputs in " + ", ".join(input_files)
    elif do_verify and art.reference is not None:
        inputs, source = art.reference[0], "the stored reference inputs"
    else:
        inputs, source = art.random_inputs(), "random inputs from the input spec"
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = art(*inputs)
        times.append(time.perf_counter() - t0)
    outs = out if isinstance(out, tuple) else (out,)
    median = statistics.median(times)
    facts.update(ran_on=source, repeat=repeat, median_ms=median * 1e3, outputs=[])
    say(f"ran on {source}: median {median * 1e3:.3f} ms over {repeat} run(s)")
    for spec, value in zip(art.outputs, outs):
        flat = value.detach().float().flatten()
        head = flat[:6].tolist()
        dtype = str(value.dtype).replace("torch.", "")
        facts["outputs"].append({"name": spec.name, "shape": list(value.shape), "dtype": dtype, "head": head})
        say(f"  {spec.name}: {list(value.shape)} {dtype} "
            f"[{', '.join(f'{v:.4g}' for v in head)}{', ...' if flat.numel() > 6 else ''}]")
    if output:
        _write_outputs(output, [s.name for s in art.outputs], outs)
        facts["wrote"] = output
        say(f"wrote {output}")
    if as_json:
        click.echo(json.dumps(facts, indent=2, default=str))


# --output's suffix -> the file's format (mlcomp.base.marks.FORMATS)
_OUTPUT_FORMATS = {".npz": "npz", ".pt": "torch"}


def _write_outputs(path: str, names: list[str], outs: Sequence[Any]) -> None:
    import numpy as np
    import torch

    from mlcomp.base.files import atomic_path

    with atomic_path(path, _OUTPUT_FORMATS[Path(path).suffix]) as tmp:
        if path.endswith(".pt"):
            torch.save({n: o.detach().cpu() for n, o in zip(names, outs)}, tmp)
        elif path.endswith(".npz"):
            with open(tmp, "wb") as fh:
                np.savez(fh, **{n: o.detach().cpu().float().numpy() if o.dtype == torch.bfloat16
                                else o.detach().cpu().numpy() for n, o in zip(names, outs)})
        else:
            raise InputSpecError(f"--output {path} must end in .npz or .pt")
