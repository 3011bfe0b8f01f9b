"""Pipeline specs: inline text, presets, TOML, the registry, and every kind of spec error."""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import ClassVar, Literal

import pytest
from click.testing import CliRunner

from mlcomp.base.errors import PipelineSpecError
from mlcomp.pipeline import PRESETS, PassSpec, Pipeline
from mlcomp.pipeline.pass_base import REGISTRY, Pass, PassRegistry, PassResult, option


class Dtype(enum.Enum):
    BF16 = "bf16"
    FP16 = "fp16"


@dataclass(frozen=True)
class MixedPrecisionStub(Pass):
    """Stand-in for a pass with typed options of every kind."""

    name: ClassVar[str] = "toy-precision"
    dtype: Dtype = option(Dtype.BF16, "compute dtype")
    loss_scale: float = option(1.0, "static loss scale")
    skip: tuple[str, ...] = option((), "module paths kept in fp32")
    mode: Literal["auto", "all"] = option("auto", "which ops")
    strict: bool = option(False, "fail on unsupported ops")
    limit: int | None = option(None, "most casts")

    def run(self, graph, ctx):  # pragma: no cover - never run here
        return PassResult(graph, False)


@pytest.fixture()
def registry() -> PassRegistry:
    reg = REGISTRY.copy()
    reg.register(MixedPrecisionStub, replace=True)   # stands in for the real pass (issue 10)
    return reg


def test_inline_spec_parses_to_canonical_text(registry):
    pipe = Pipeline.parse("cleanup , toy-precision{dtype=fp16 loss_scale=128, skip=[head,layer1.0]},fuse",
                          registry=registry)
    assert pipe.names == ["cleanup", "toy-precision", "fuse"]
    assert pipe.spec == "cleanup,toy-precision{dtype=fp16,loss_scale=128.0,skip=[head,layer1.0]},fuse"
    mp = pipe.passes[1]
    assert dict(mp.options) == {"dtype": Dtype.FP16, "loss_scale": 128.0, "skip": ("head", "layer1.0")}
    # the canonical text parses back to the same pipeline
    assert Pipeline.parse(pipe.spec, registry=registry) == pipe


def test_defaults_are_dropped_so_equal_pipelines_have_equal_specs(registry):
    a = Pipeline.parse("toy-precision{dtype=bf16,strict=false}", registry=registry)
    b = Pipeline.parse("toy-precision", registry=registry)
    assert a == b and a.spec == "toy-precision"


def test_option_values_convert_to_their_types(registry):
    p = Pipeline.parse('toy-precision{strict=yes mode=all limit=none skip=head}', registry=registry).passes[0]
    assert dict(p.options) == {"strict": True, "mode": "all", "skip": ("head",)}
    q = Pipeline.parse("toy-precision{limit=12, loss_scale=1e3}", registry=registry).passes[0]
    assert dict(q.options) == {"limit": 12, "loss_scale": 1000.0}
    built = q.build(registry)
    assert isinstance(built, MixedPrecisionStub) and built.limit == 12 and built.dtype is Dtype.BF16


def test_hyphenated_option_names_are_accepted():
    p = Pipeline.parse("fuse{max-group-size=8}")
    assert p.spec == "fuse{max_group_size=8}"


def test_empty_spec_and_presets():
    assert Pipeline.parse("").passes == () and Pipeline.parse("  ").spec == ""
    assert Pipeline.parse("-O0").spec == ""
    assert Pipeline.parse("-O1").spec == "cleanup"
    assert Pipeline.parse("-O2").spec == "cleanup,fuse,cleanup"
    assert Pipeline.parse("O2") == Pipeline.parse("-O2") == Pipeline.preset("O2")
    o3 = Pipeline.parse("-O3")
    assert o3.names == ["cleanup", "fuse", "cleanup"] and dict(o3.passes[1].options)["max_group_size"] == 128
    # a preset can start a longer pipeline
    assert Pipeline.parse("O1,fuse").spec == "cleanup,fuse"
    assert Pipeline.parse("-O1, fuse").spec == "cleanup,fuse"          # the dash is optional inside a list
    for text in PRESETS.values():        # every preset is itself a valid pipeline
        Pipeline.parse(text)


def test_pipeline_is_frozen_and_hashable():
    p = Pipeline.parse("cleanup,fuse{tile=false}")
    assert hash(p) == hash(Pipeline.parse("cleanup, fuse{ tile = false }"))
    with pytest.raises(Exception):
        p.passes = ()  # type: ignore[misc]
    assert str(PassSpec("dce")) == "dce"


def test_toml_file(tmp_path, registry):
    path = tmp_path / "pipe.toml"
    path.write_text('target = "tvm"\n\n[[passes]]\nname = "cleanup"\nmax_iterations = 2\n\n'
                    '[[passes]]\nname = "toy-precision"\ndtype = "fp16"\nskip = ["head"]\n\n'
                    '[[passes]]\nname = "O1"\n')
    pipe = Pipeline.from_toml(path, registry=registry)
    assert pipe.target == "tvm"
    assert pipe.spec == "cleanup{max_iterations=2},toy-precision{dtype=fp16,skip=[head]},cleanup"
    assert Pipeline.coerce(str(path), registry=registry) == pipe
    other = tmp_path / "inline.toml"
    other.write_text('pipeline = "cleanup,fuse"\n')
    assert Pipeline.from_toml(other).spec == "cleanup,fuse" and Pipeline.from_toml(other).target is None


# ---------------------------------------------------------------------------
# errors


def _error(text: str, registry: PassRegistry | None = None) -> str:
    with pytest.raises(PipelineSpecError) as info:
        Pipeline.parse(text, registry=registry)
    return str(info.value)


def test_unknown_pass_lists_known_passes_and_the_closest_match():
    msg = _error("cleanup,fuze")
    assert "unknown pass 'fuze'; did you mean 'fuse'?" in msg
    assert "Known passes: cleanup, cse, dce" in msg
    # the column of the bad name, and the text from there
    assert msg.startswith("bad pipeline spec at column 9 of 'cleanup,fuze' (at 'fuze'): unknown pass")


def test_unknown_pass_without_a_close_match():
    msg = _error("distill")
    assert "unknown pass 'distill'." in msg and "did you mean" not in msg


def test_unknown_option_names_pass_option_and_the_accepted_ones():
    msg = _error("fuse{max_grop_size=4}")
    assert "pass 'fuse' has no option 'max_grop_size'; did you mean 'max_group_size'?" in msg
    assert "max_group_size (int >= 1, default 32)" in msg and "tile (bool, default true)" in msg


def test_ill_typed_options(registry):
    msg = _error("fuse{max_group_size=lots}")
    assert "option 'max_group_size' of pass 'fuse' expects int >= 1, got 'lots'" in msg
    msg = _error("toy-precision{dtype=fp8}", registry)
    assert "option 'dtype' of pass 'toy-precision' expects one of bf16|fp16, got 'fp8'" in msg
    msg = _error("toy-precision{mode=some}", registry)
    assert "expects one of auto|all" in msg
    msg = _error("cleanup{fold=maybe}")
    assert "expects bool" in msg
    assert "at column 14 of 'cleanup{fold=maybe}' (at 'maybe}')" in msg


@pytest.mark.parametrize("text, problem, column", [
    ("cleanup,,fuse", "expected a pass name, found ','", 9),
    ("cleanup,", "expected a pass name, found the end", 9),
    ("cleanup fuse", "expected ',' or the end, found 'f'", 9),
    ("fuse{max_group_size 3}", "expected '=' after option name 'max_group_size'", 21),
    ("fuse{max_group_size=}", "expected a value, found '}'", 21),
    ("fuse{tile=false", "unterminated '{' (missing '}')", 16),
    ("fuse{tile=false,}", "expected an option name after ','", 17),
    ("fuse{tile=false tile=true}", "option 'tile' of pass 'fuse' is given twice", 17),
    ('fuse{tile="false}', "unterminated string", 11),
])
def test_malformed_specs_point_at_the_character(text, problem, column):
    msg = _error(text)
    rest = text[column - 1:]
    here = f"at {rest[:12] + ('...' if len(rest) > 12 else '')!r}" if rest else "at the end"
    assert msg.startswith(f"bad pipeline spec at column {column} of {text!r} ({here}): {problem}")
    assert "\n" not in msg


def test_preset_with_options_is_an_error():
    assert "preset O2 takes no options" in _error("O2{x=1}")
    with pytest.raises(PipelineSpecError, match="unknown preset"):
        Pipeline.preset("O7")


@pytest.mark.parametrize("toml, problem", [
    ("[[passes]\nname='dce'", "is not valid TOML"),
    ("colour = 'red'", "unknown top-level key(s) colour"),
    ("[[passes]]\nmax_iterations = 2", "pass #1 needs name"),
    ("[[passes]]\nname = 'cleanup'\nmax_iterations = 'two'", "option 'max_iterations' of pass 'cleanup' expects int"),
    ("[[passes]]\nname = 'cleanup'\nfold = 1", "expects bool"),
    ("[[passes]]\nname = 'cleanup'\nrounds = 1", "pass 'cleanup' has no option 'rounds'"),
    ("[[passes]]\nname = 'fusee'", "did you mean 'fuse'"),
    ("pipeline = 'dce'\n[[passes]]\nname = 'dce'", "has both pipeline"),
    ("target = 3", "target must be a string"),
])
def test_toml_errors(tmp_path, toml, problem):
    path = tmp_path / "p.toml"
    path.write_text(toml)
    with pytest.raises(PipelineSpecError) as info:
        Pipeline.from_toml(path)
    assert problem in str(info.value)


def test_missing_toml_file(tmp_path):
    with pytest.raises(PipelineSpecError, match="cannot read pipeline file"):
        Pipeline.from_toml(tmp_path / "nope.toml")


# ---------------------------------------------------------------------------
# registry


def test_registry_is_lazy_and_extensible():
    reg = PassRegistry({"dce": "mlcomp.passes.cleanup.cleanup:DeadCodeElimination"})
    assert reg.names() == ["dce"] and not reg._infos          # nothing imported yet
    info = reg.get("dce")
    assert info.summary.startswith("Remove nodes whose values nobody reads")
    assert [(o.name, o.type_text(), o.default) for o in info.options] == [("keep_params", "bool", False)]
    reg.register("mlcomp.passes.cleanup.cleanup:CommonSubexpressionElimination", name="cse")
    assert reg.names() == ["cse", "dce"]
    with pytest.raises(ValueError, match="already registered"):
        reg.register(MixedPrecisionStub, name="dce")
    reg.register(MixedPrecisionStub)
    assert reg.get("toy-precision").option("loss-scale").type is float


def test_builtin_passes_all_describe_themselves():
    for info in REGISTRY.infos():
        assert info.summary, info.name
        assert info.cls.name == info.name
        for opt in info.options:
            assert opt.help, (info.name, opt.name)
            # every default survives a round trip through the spec syntax
            text = f"{info.name}{{{opt.name}={opt.format_value(opt.default)}}}"
            assert Pipeline.parse(text).spec == info.name


# ---------------------------------------------------------------------------
# CLI


def test_passes_command_lists_passes_options_and_presets():
    from mlcomp.cli.main import main

    result = CliRunner().invoke(main, ["passes"])
    assert result.exit_code == 0, result.output
    assert "fuse-attention" in result.output and "max_group_size" in result.output
    assert "-O2  cleanup,fuse,cleanup" in result.output
    data = json.loads(CliRunner().invoke(main, ["passes", "--json"]).output)
    names = [p["name"] for p in data["passes"]]
    assert "cleanup" in names and data["presets"]["-O1"] == "cleanup"
    fuse = next(p for p in data["passes"] if p["name"] == "fuse")
    assert {"name": "tile", "type": "bool", "default": "true",
            "help": "run large elementwise groups tile by tile (cache blocking)"} in fuse["options"]
    # composites list their children; passes list the graph modes they run on
    assert fuse["children"] == ["fold-batchnorm", "recompose", "fuse-attention", "fold-bias", "fuse-elementwise"]
    cleanup = next(p for p in data["passes"] if p["name"] == "cleanup")
    assert cleanup["children"] == ["simplify", "fold-constants", "cse", "dce"]
    fold_bn = next(p for p in data["passes"] if p["name"] == "fold-batchnorm")
    assert fold_bn["modes"] == ["inference"] and fold_bn["children"] is None and fold_bn["requires"] == []
    assert "runs: fixed point (at most 4 rounds) of simplify, fold-constants, cse, dce" in result.output
    assert "runs: fold-batchnorm (inference only), recompose, fuse-attention, fold-bias, fuse-elementwise" \
        in result.output
    lines = result.output.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  fold-batchnorm  "))
    assert lines[at + 1].strip() == "runs on inference graphs only"


def test_pipeline_options_and_helper():
    import click

    from mlcomp.cli.passes import pipeline_from_cli, pipeline_options

    seen = {}

    @click.command()
    @pipeline_options
    def cmd(**kwargs):
        seen["request"] = pipeline_from_cli(**kwargs)

    runner = CliRunner()
    assert runner.invoke(cmd, ["-O1"]).exit_code == 0
    assert seen["request"].pipeline.spec == "cleanup" and not seen["request"].verify
    assert runner.invoke(cmd, ["-p", "dce,cse", "--verify", "--explain", "--dump-after", "cse"]).exit_code == 0
    req = seen["request"]
    assert req.pipeline.spec == "dce,cse" and req.verify and req.explain
    kinds = [type(i).__name__ for i in req.instruments()]
    assert kinds == ["Verify", "Explain", "IRCheck", "Dump", "Timing"]
    dump = req.instruments()[3]
    assert dump.names == {"cse"} and dump.dump_dir == "mlcomp-dump"
    assert [type(i).__name__ for i in pipeline_from_cli(pipeline="dce").instruments()] == ["IRCheck", "Timing"]
    assert runner.invoke(cmd, []).exit_code == 0 and seen["request"].pipeline.spec == "cleanup,fuse,cleanup"
    result = runner.invoke(cmd, ["-O2", "-p", "dce"])
    assert isinstance(result.exception, PipelineSpecError) and "both -p" in str(result.exception)
    assert pipeline_from_cli(default=None).pipeline.spec == ""


def test_declared_option_ranges_are_enforced_in_specs_toml_and_python():
    from mlcomp.passes.fusion.fusion import Fuse

    with pytest.raises(PipelineSpecError, match=r"option 'max_group_size' of pass 'fuse' must be at least 1, got -5"):
        Pipeline.parse("fuse{max_group_size=-5}")
    with pytest.raises(PipelineSpecError, match="must be at least 0"):
        Pipeline.from_toml_text('[[passes]]\nname = "fuse"\npeak_slack = -0.5\n')
    with pytest.raises(PipelineSpecError, match="'max_iterations' of pass 'cleanup' must be at least 1, got 0"):
        REGISTRY.get("cleanup").cls(max_iterations=0)
    assert Fuse(max_group_size=1).max_group_size == 1          # the bound itself is allowed
    assert "int >= 1" in REGISTRY.get("fuse").option("max_group_size").type_text()
