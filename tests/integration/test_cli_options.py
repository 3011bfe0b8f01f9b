"""One consistent CLI (issue 15): help on every option, shared -O/-p, --json, output names, progress, TOML docs.

    before: `mlcomp bench mlp -O2` → "No such option: -O"; `mlcomp run` printed `addmm_2: [1, 2] ...`;
            `mlcomp report` was silent for minutes when stdout was not a terminal
    after:  -O0..-O3 on compile, bench, report and export; `output: [1, 2] ...`; one log line per stage
"""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

from mlcomp.cli.main import COMMANDS, main
from mlcomp.cli.passes import DEFAULT_PIPELINE, TOML_EXAMPLE

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def invoke(*args: str):
    res = CliRunner().invoke(main, list(args))
    assert "Traceback" not in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    return res


def _commands(group: click.Group, ctx: click.Context, prefix: str = ""):
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        yield prefix + name, cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, ctx, prefix + name + " ")


def _all_commands() -> dict[str, click.Command]:
    return dict(_commands(main, click.Context(main)))


# Commands another engineer is writing now (issue: pipeline partitioning); strict, so the day their
# options get help this xfail turns into a failure and must be removed.
_HELP_PENDING: set[str] = set()


@pytest.mark.parametrize("path", [
    pytest.param(p, marks=pytest.mark.xfail(strict=True, reason="options without help, being written"))
    if p in _HELP_PENDING else p for p in sorted(_all_commands())])
def test_every_option_of_every_command_has_help(path):
    cmd = _all_commands()[path]
    missing = [f"mlcomp {path} {param.opts[-1]}" for param in cmd.params
               if isinstance(param, click.Option) and not param.hidden and not (param.help or "").strip()]
    assert not missing, missing


def test_the_walk_sees_every_registered_command():
    assert set(COMMANDS.names()) | {"inspect", "models list", "models save"} <= set(_all_commands())


def test_target_and_targets_by_arity():
    """--target names one target, --targets a comma-separated list; no command mixes them up."""
    ctx = click.Context(main)
    for path, cmd in _commands(main, ctx):
        for param in cmd.params:
            if "--targets" in param.opts:
                assert "comma-separated" in (param.help or "").lower(), path
            if "--target" in param.opts:
                assert "," not in str(param.default or ""), path


def test_o_and_p_are_the_same_options_everywhere():
    helps = {}
    for name in ("compile", "bench", "report", "export"):
        cmd = main.get_command(click.Context(main), name)
        opts = {p.opts[0]: p for p in cmd.params if isinstance(p, click.Option)}
        assert "-O" in opts and "-p" in opts, name
        helps[name] = (opts["-O"].help, opts["-p"].help)
    assert len(set(helps.values())) == 1, helps
    assert f"Default: {DEFAULT_PIPELINE}" in helps["compile"][0]


def test_default_pipeline_is_said_once_and_the_readme_agrees():
    from mlcomp.cli.passes import resolve_pipeline

    assert resolve_pipeline(None, None) == DEFAULT_PIPELINE
    assert resolve_pipeline(None, "1") == "-O1" and resolve_pipeline("dce", None) == "dce"
    assert f"default pipeline is `{DEFAULT_PIPELINE}`" in README
    assert "--bench-batch" not in README


def test_toml_format_is_documented_and_the_example_parses():
    from mlcomp.pipeline import Pipeline

    help_text = invoke("passes", "--help").output
    assert "[[passes]]" in help_text and "max_group_size = 16" in help_text
    pipe = Pipeline.from_toml_text(TOML_EXAMPLE)
    assert pipe.target == "onnxruntime" and pipe.spec == "cleanup,fuse{max_group_size=16}"
    blocks = re.findall(r"```toml\n(.*?)```", README, re.S)
    assert blocks, "the README shows a TOML pipeline"
    assert all(Pipeline.from_toml_text(b).passes for b in blocks)
    assert TOML_EXAMPLE in blocks and (REPO / "docs" / "pipeline.toml").read_text() == TOML_EXAMPLE   # the tour's file


def test_output_names_come_from_the_model():
    from collections import namedtuple

    from mlcomp.frontend.capture import output_names

    pair = namedtuple("pair", "logits aux")
    z = torch.zeros(1)
    assert output_names(z) == ["output"]
    assert output_names((z, 3, z)) == ["output", "output_1"]          # non-tensors are not outputs
    assert output_names(pair(z, z)) == ["logits", "aux"]
    assert output_names({"logits": z, "hidden": [z, z]}) == ["logits", "hidden_0", "hidden_1"]


def test_progress_is_a_log_line_per_stage_off_a_terminal_and_one_live_line_on_it():
    from mlcomp.base.progress import Progress, ProgressLine

    log = io.StringIO()
    p = Progress(ProgressLine(log, tty=False, clock=iter(range(100)).__next__))
    with p.stage("capture mlp"):
        pass
    p(1, 2, "mlp cpu batch 1")
    assert log.getvalue().splitlines() == ["[  1.0s] capture mlp", "[1/2     2s] mlp cpu batch 1"]
    tty = io.StringIO()
    live = Progress(ProgressLine(tty, tty=True, clock=lambda: 0.0))
    with live.stage("build for tvm"):
        pass
    assert tty.getvalue() == "\r[  0.0s] build for tvm" + "\r" + " " * 22 + "\r"      # erased after
    assert Progress(None).line is None                                                 # quiet


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli-json") / "mlp"
    res = invoke("compile", "mlp", "--target", "cpu", "-O1", "--json", "-o", str(out), "--threads", "1")
    assert res.exit_code == 0, res.output
    return out, json.loads(res.stdout)


def test_compile_json_holds_what_the_text_says(compiled):
    out, facts = compiled
    assert facts["model"] == "mlp" and facts["target"] == "cpu" and facts["pipeline_given"] == "-O1"
    assert facts["pipeline"] == "cleanup" and facts["pipeline_report"]["passes"][0]["name"] == "cleanup"
    assert facts["verification"]["passed"] and facts["reloaded"]["passed"]
    assert facts["outputs"] == ["output: f32[1, 2]"] and facts["output"] == str(out)
    assert facts["size_bytes"] == sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    assert json.loads((out / "manifest.json").read_text())["outputs"][0]["name"] == "output"


def test_run_json_and_output_names(compiled, tmp_path):
    out, _ = compiled
    res = invoke("run", str(out), "--json", "--output", str(tmp_path / "y.npz"))
    assert res.exit_code == 0, res.output
    facts = json.loads(res.stdout)
    assert [o["name"] for o in facts["outputs"]] == ["output"] and facts["outputs"][0]["shape"] == [1, 2]
    import numpy as np

    assert list(np.load(tmp_path / "y.npz").files) == ["output"]
    text = invoke("run", str(out)).output
    assert "  output: [1, 2] float32" in text and "addmm" not in text


def test_targets_and_models_list_json():
    rows = json.loads(invoke("targets", "--json").stdout)
    from mlcomp.targets import TargetName

    assert [r["name"] for r in rows] == [t.value for t in TargetName]
    cpu = next(r for r in rows if r["name"] == "cpu")
    assert cpu["available"] and cpu["reason"] is None and "inference" in cpu["capabilities"]["modes"]
    text = invoke("targets").output
    assert all(r["compiles"] in text for r in rows)
    tvm = next(r for r in rows if r["name"] == "tvm")
    assert [(o["name"], o["default"]) for o in tvm["options"]] == [("kernels", "auto")] and not cpu["options"]
    assert "option tvm{kernels=...}: one of auto|on|off, default auto" in text


def test_bench_takes_o_and_reports_stages_as_log_lines():
    res = invoke("bench", "mlp", "--targets", "eager", "-O1", "--budget", "0.002", "--min-repeats", "1",
                 "--warmup", "0", "--no-memory", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)[0]["pipeline"] == "-O1"
    lines = res.stderr.splitlines()                                          # stdout is JSON: log on stderr
    assert lines[0].startswith("[0/") and "mlp eager batch 1" in lines[0]
    assert lines[-1].startswith(f"[{len(lines) - 1}/{len(lines) - 1} ") and lines[-1].endswith("mlp done")


def test_torchscript_convolutions_reach_onnxruntime(tmp_path):
    """`_convolution` from a TorchScript archive is captured as `convolution`, which ONNX translates."""
    from mlcomp.frontend.loading import load_model
    from mlcomp.targets import get_target

    path = tmp_path / "lenet.pt"
    assert invoke("models", "save", "lenet", "--format", "torchscript", "-o", str(path)).exit_code == 0
    graph = load_model(str(path)).capture()
    ops = {str(n.op) for n in graph.call_nodes()}
    assert "aten.convolution.default" in ops and "aten._convolution.default" not in ops
    target = get_target("onnxruntime")
    if target.available() is None:
        target.check(graph)                 # raises UnsupportedOpError listing any op it cannot run
