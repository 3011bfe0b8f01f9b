"""The one ``name{key=value}`` grammar (mlcomp.base.spec) and typed options with open/closed ranges
(mlcomp.base.spec_options), on a toy table and on the three real kinds: pipelines, optimizers, loss scales."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import pytest

from mlcomp.base.errors import MlcompError, PipelineSpecError
from mlcomp.base.spec import Grammar, SpecItem, SpecTable
from mlcomp.base.spec_options import Range, check_fields, convert_value, format_value, option


class ToyError(MlcompError):
    pass


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Walk:
    """Walk somewhere."""

    speed: float = option(1.0, "metres per second", gt=0, le=10)
    steps: int = option(3, "how many", ge=1, lt=100)
    colour: Colour = option(Colour.RED, "of the shoes")
    path: tuple[str, ...] = option((), "places")
    pair: tuple[float, float] = option((0.5, 0.5), "two fractions", ge=0, lt=1)
    label: str | None = option(None, "a name")

    def __post_init__(self) -> None:
        check_fields(self, owner="walk", noun="move", error=ToyError)
        if self.steps > 50 and self.speed > 5:
            raise ToyError("option 'steps' above 50 needs speed <= 5")


@dataclass(frozen=True)
class Rest:
    """Rest."""


GRAMMAR = Grammar("move", ToyError, whole="route", tuples=True, fold_case=True,
                  hint="write moves as walk{speed=...} or rest, separated by commas")
TABLE = SpecTable(GRAMMAR, {"walk": Walk, "rest": Rest})


def _err(text: str) -> str:
    with pytest.raises(ToyError) as info:
        TABLE.parse(text)
    return info.value.message


# ---------------------------------------------------------------------------
# valid forms


@pytest.mark.parametrize("text, items", [
    ("", []),
    ("  ", []),
    ("rest", [SpecItem("rest")]),
    ("walk{}", [SpecItem("walk")]),
    ("walk{speed=2}", [SpecItem("walk", (("speed", 2.0),))]),
    ("walk{speed=2 steps=4}", [SpecItem("walk", (("speed", 2.0), ("steps", 4)))]),
    ("walk{ steps = 4 , speed=2 }", [SpecItem("walk", (("speed", 2.0), ("steps", 4)))]),    # field order
    ("walk{speed=1.0}", [SpecItem("walk")]),                                   # defaults are left out
    ("WALK{Speed=2}, rest", [SpecItem("walk", (("speed", 2.0),)), SpecItem("rest")]),      # fold_case
    ("walk{path=[a,'b c',\"d,e\"]}", [SpecItem("walk", (("path", ("a", "b c", "d,e")),))]),
    ("walk{path=x}", [SpecItem("walk", (("path", ("x",)),))]),                 # one item is a list of one
    ("walk{pair=(0.1,0.2)}", [SpecItem("walk", (("pair", (0.1, 0.2)),))]),    # tuples=True: ( ) is a list
    ("walk{colour=BLUE label=none}", [SpecItem("walk", (("colour", Colour.BLUE),))]),
    ("walk{label='x y'}", [SpecItem("walk", (("label", "x y"),))]),
])
def test_valid_forms(text, items):
    assert TABLE.parse(text) == items
    assert TABLE.parse(",".join(i.text for i in items)) == items            # the canonical text reads back


def test_parse_one_builds_the_entry():
    item, walk = TABLE.parse_one("walk{speed=2}")
    assert item.name == "walk" and walk == Walk(speed=2.0)


# ---------------------------------------------------------------------------
# invalid forms: what, where (the column, the spec and the text from there), what to do


@pytest.mark.parametrize("text, problem, column", [
    ("rest,,walk", "expected a move name, found ','", 6),
    ("rest,", "expected a move name, found the end", 6),
    ("rest walk", "expected ',' or the end, found 'w'", 6),
    ("walk{speed 3}", "expected '=' after option name 'speed'", 12),
    ("walk{speed=}", "expected a value, found '}'", 12),
    ("walk{speed=2", "unterminated '{' (missing '}')", 13),
    ("walk{speed=2,}", "expected an option name after ','", 14),
    ("walk{speed=2 speed=3}", "option 'speed' of move 'walk' is given twice", 14),
    ("walk{label=\"x}", "unterminated string", 12),
    ("walk{path=[a,b}", "unterminated '[' (missing ']')", 11),
    ("walk{pair=(0.1,0.2}", "unterminated '(' (missing ')')", 11),
    ("wlak", "unknown move 'wlak'; did you mean 'walk'? Known moves: walk, rest", 1),
    ("rest,walk{sped=2}", "move 'walk' has no option 'sped'; did you mean 'speed'? Its options are: speed "
                          "(float in (0, 10], default 1.0)", 11),
    ("walk{speed=fast}", "option 'speed' of move 'walk' expects float in (0, 10], got 'fast'", 12),
    ("walk{colour=green}", "option 'colour' of move 'walk' expects one of red|blue, got 'green'", 13),
    ("walk{pair=(0.1)}", "option 'pair' of move 'walk' expects list of 2 float in [0, 1)", 11),
    ("walk{steps=60 speed=6}", "option 'steps' above 50 needs speed <= 5", 1),        # across options: the item
])
def test_invalid_forms_point_at_the_character(text, problem, column):
    msg = _err(text)
    head, _, after = msg.partition(": ")
    assert head.startswith(f"bad route spec at column {column} of {text!r} (at ")   # the whole's name, the column
    rest = text[column - 1:]
    assert head.endswith(f"(at {rest[:12] + ('...' if len(rest) > 12 else '')!r})" if rest else "(at the end)")
    assert after.startswith(problem)
    assert "\n" not in msg and "Traceback" not in msg                     # one paragraph, one line


def test_messages_say_what_to_do():
    assert _err("rest walk").endswith("write moves as walk{speed=...} or rest, separated by commas.")
    assert _err("walk{speed=0}").endswith("for example walk{speed=1.0}; write moves as walk{speed=...} or rest, "
                                          "separated by commas.")


def test_one_item_and_the_count():
    with pytest.raises(ToyError, match=r"route spec 'rest,rest' names 2 moves; give one"):
        TABLE.parse_one("rest,rest")
    assert Grammar("pass", ToyError, "").nouns == "passes" and GRAMMAR.nouns == "moves"


def test_expansion_of_names():
    expand = {"twice": [SpecItem("rest"), SpecItem("rest")]}.get
    assert GRAMMAR.parse("twice,walk", TABLE.get, expand=expand) == [SpecItem("rest")] * 2 + [SpecItem("walk")]
    with pytest.raises(ToyError, match="preset twice takes no options"):
        GRAMMAR.parse("twice{x=1}", TABLE.get, expand=expand)


# ---------------------------------------------------------------------------
# ranges: each end open or closed, checked at the end itself and just past it


@pytest.mark.parametrize("bounds, inside, outside, words", [
    (Range(gt=0), [1e-12, 5], [0, -1], "must be greater than 0"),
    (Range(ge=0), [0, 3], [-1e-12], "must be at least 0"),
    (Range(lt=1), [0.999, -5], [1, 2], "must be less than 1"),
    (Range(le=1), [1, 0], [1.000001], "must be at most 1"),
    (Range(ge=0, lt=1), [0, 0.5], [1, -0.1], "must be in [0, 1)"),
    (Range(gt=0, le=10), [10, 0.1], [0, 10.5], "must be in (0, 10]"),
    (Range(gt=0, lt=math.inf), [1e300], [math.inf, 0], "must be in (0, inf)"),
])
def test_open_and_closed_ends(bounds, inside, outside, words):
    assert all(bounds.problem(v) is None for v in inside)
    assert all(bounds.problem(v) == words for v in outside)
    assert bounds.problem((inside[0], outside[0])) == words.replace("must be", "must have every item")
    assert bounds.problem("text") is None and bounds.problem(True) is None     # not numbers: not its business


def test_range_text_and_conflicts():
    assert [Range(gt=0).text(), Range(ge=1).text(), Range(lt=2.5).text(), Range(le=1).text(), Range().text()] == \
        ["> 0", ">= 1", "< 2.5", "<= 1", ""]
    with pytest.raises(ValueError):
        Range(gt=0, ge=0)


@pytest.mark.parametrize("key, value, ok", [
    ("speed", 10.0, True), ("speed", 0.0, False), ("speed", 1e-9, True), ("speed", 10.01, False),
    ("steps", 1, True), ("steps", 0, False), ("steps", 99, True), ("steps", 100, False),
    ("pair", (0.0, 0.99), True), ("pair", (0.0, 1.0), False),
])
def test_ranges_at_their_ends_in_specs_and_python(key, value, ok):
    text = f"walk{{{key}={format_value(value)}}}"
    if ok:
        assert TABLE.parse_one(text)[1] == Walk(**{key: value}) and getattr(Walk(**{key: value}), key) == value
        return
    with pytest.raises(ToyError, match=f"option '{key}' of move 'walk' must"):
        TABLE.parse(text)
    with pytest.raises(ToyError, match=f"option '{key}' of move 'walk' must"):       # the same words in Python
        Walk(**{key: value})


@pytest.mark.parametrize("value", ["a b", 'q"uo\\te', "x,y}", "plain-text_1.0"])
def test_format_value_reads_back(value):
    item, walk = TABLE.parse_one(f"walk{{label={format_value(value)}}}")
    assert walk.label == value and TABLE.parse_one(item.text)[1] == walk


def test_convert_value_types():
    assert convert_value(tuple[float, float], ["1", "2"]) == (1.0, 2.0)
    assert convert_value(int, "1_000") == 1000 and convert_value(bool, "off") is False
    for tp, bad in ((int, True), (int, "2.5"), (float, True), (str, 3), (bool, "maybe"), (tuple[int, int], [1])):
        with pytest.raises(ValueError):
            convert_value(tp, bad)


# ---------------------------------------------------------------------------
# the three kinds of spec go through it, each in its own words


def test_pipeline_specs_say_pass_and_pipeline():
    from mlcomp.pipeline.spec import Pipeline

    with pytest.raises(PipelineSpecError) as info:
        Pipeline.parse("cleanup,fuse{max_group_size=0}")
    msg = info.value.message
    assert msg.startswith("bad pipeline spec at column 29 of 'cleanup,fuse{max_group_size=0}' (at '0}'): ")
    assert "option 'max_group_size' of pass 'fuse' must be at least 1, got 0" in msg
    with pytest.raises(PipelineSpecError, match="unknown pass 'fusee'; did you mean 'fuse'"):
        Pipeline.parse("fusee")
    with pytest.raises(PipelineSpecError, match=r"'sparsity' of pass 'prune' must be in \[0, 1\), got 1.0"):
        Pipeline.parse("prune{sparsity=1}")                 # an open end declared in option(), no hand check


def test_optimizer_specs_say_optimizer():
    from mlcomp.runtime.optim import OptimizerSpec, OptimizerSpecError, SgdOptions

    with pytest.raises(OptimizerSpecError) as info:
        OptimizerSpec.parse("sgd{lr=0.1 momentum=1}")
    msg = info.value.message
    assert msg.startswith("bad optimizer spec at column 21 of 'sgd{lr=0.1 momentum=1}' (at '1}'): ")
    assert "pass" not in msg
    assert "option 'momentum' of optimizer 'sgd' must be in [0, 1), got 1.0" in msg
    assert OptimizerSpec.parse("SGD{LR=0.5}").options.lr == 0.5
    with pytest.raises(OptimizerSpecError, match="option 'lr' of optimizer 'sgd' must be greater than 0"):
        SgdOptions(lr=0.0)                                  # built in Python: the same words


def test_loss_scale_specs_say_loss_scale():
    from mlcomp.training.loss_scaling import DynamicOptions, LossScaleError, LossScaleSpec

    with pytest.raises(LossScaleError) as info:
        LossScaleSpec.parse("dynamic{backoff=1}")
    msg = info.value.message
    assert msg.startswith("bad loss scale spec at column 17 of 'dynamic{backoff=1}' (at '1}'): ")
    assert "pass" not in msg
    assert "option 'backoff' of loss-scale mode 'dynamic' must be in (0, 1), got 1.0" in msg
    with pytest.raises(LossScaleError, match="names 2 loss-scale modes; give one"):
        LossScaleSpec.parse("dynamic,none")
    assert LossScaleSpec.parse("dynamic{backoff=0.25}").backoff == 0.25
    with pytest.raises(LossScaleError, match="option 'growth' of loss-scale mode 'dynamic' must be greater than 1"):
        DynamicOptions(growth=1.0)
