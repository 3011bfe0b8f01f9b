"""Symbolic sizes with ranges: parsing, the checks a call gets, the sizes verification picks."""
from __future__ import annotations

import pytest

from mlcomp.base.errors import InputSpecError
from mlcomp.ir.symbols import SizeRange, check_sizes, out_of_range, ranges_from_json, ranges_json, sample_points


def test_a_range_whose_minimum_exceeds_its_maximum_is_refused_in_one_paragraph():
    with pytest.raises(InputSpecError) as info:
        SizeRange.parse("64..8")
    text = str(info.value)
    assert "64..8" in text and "minimum" in text and "batch=1..64" in text and "\n" not in text


@pytest.mark.parametrize("text", ["8", "a..b", "1...4"])
def test_malformed_range_text_says_the_form(text):
    with pytest.raises(InputSpecError, match="MIN..MAX"):
        SizeRange.parse(text)


def test_manifest_form_round_trips():
    ranges = {"seq": SizeRange(8, 512), "batch": SizeRange(1)}
    assert ranges_json(ranges) == {"batch": [1, None], "seq": [8, 512]}
    assert ranges_from_json(ranges_json(ranges)) == ranges


def test_a_size_outside_its_range_names_the_input_dim_and_range():
    ranges = {"batch": SizeRange(1, 8), "seq": SizeRange(2, 16)}
    shapes = [("batch", "seq", 4)]
    assert out_of_range(ranges, shapes, [(3, 16, 4)], ["x"]) is None
    with pytest.raises(InputSpecError) as info:
        check_sizes(ranges, shapes, [(3, 17, 4)], ["x"], where="cpu artifact of m")
    assert "dim 1 of input x is 17, outside the range 2..16 of the symbolic size seq" in str(info.value)
    assert "cpu artifact of m" in str(info.value)


def test_one_symbol_given_two_sizes_is_refused():
    problem = out_of_range({}, [("batch", 4), ("batch", 2)], [(3, 4), (5, 2)], ["x", "mask"])
    assert problem == "dim 0 of input mask is 5 but dim 0 of input x is 3, and both are the size batch"


def test_verification_points_are_both_ends_and_a_middle():
    assert sample_points({"batch": SizeRange(1, 9), "seq": SizeRange(4, 8)}, {"batch": 2, "seq": 5}) == [
        {"batch": 1, "seq": 4}, {"batch": 5, "seq": 6}, {"batch": 9, "seq": 8}]
    # no upper bound: four times the example; a minimum of 0 is verified at 1
    assert sample_points({"n": SizeRange(0)}, {"n": 3}) == [{"n": 1}, {"n": 6}, {"n": 12}]
