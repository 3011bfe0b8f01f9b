"""A target's own options in the one spec grammar: ``get_target("tvm{kernels=off}")`` (no build here)."""
from __future__ import annotations

import pytest

from mlcomp.api.compiler import _key
from mlcomp.frontend.loading import load_model
from mlcomp.api.auto.search import DEFAULT_AUTO_TIMING
from mlcomp.targets import CompileOptions, get_target
from mlcomp.targets.options import OptionsError


def test_options_make_a_separate_instance_with_a_canonical_spec():
    plain, off = get_target("tvm"), get_target("TVM{ kernels=off }")
    assert (off.name, off.spec, off.settings.kernels, repr(off)) == ("tvm", "tvm{kernels=off}", "off",
                                                                     "<Target tvm{kernels=off}>")
    assert off is not plain and off is get_target("tvm{kernels=off}") and get_target("tvm{kernels=auto}") is plain
    assert (plain.spec, plain.settings.kernels) == ("tvm", "auto")
    assert get_target("tvm{kernels=auto}").spec == "tvm"              # the default is left out of the text


@pytest.mark.parametrize("text, says", [
    ("tvm{kernels=none}", "column 13 of 'tvm{kernels=none}' (at 'none}'): option 'kernels' of target 'tvm' "
                          "expects one of auto|on|off, got 'none'"),
    ("tvm{kernel=off}", "target 'tvm' has no option 'kernel'; did you mean 'kernels'?"),
    ("cpu{kernels=off}", "target 'cpu' has no option 'kernels'. Its options are: none"),
    ("tvmm{kernels=off}", "there is no target named 'tvmm' (did you mean 'tvm'?)"),
    ("tvm{kernels=off},cpu", "target spec 'tvm{kernels=off},cpu' names 2 targets; give one"),
])
def test_bad_target_specs_say_where_and_what(text, says):
    with pytest.raises(OptionsError) as err:
        get_target(text)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_the_cache_key_tells_the_options_apart(zoo):
    graph = load_model(zoo["mlp"].build(), example_inputs=zoo["mlp"].example_inputs(1)).capture()
    keys = {t: _key(graph, t, None, None, CompileOptions(), DEFAULT_AUTO_TIMING)[0] for t in
            ("tvm", "tvm{kernels=auto}", "tvm{kernels=off}")}
    assert keys["tvm"].digest == keys["tvm{kernels=auto}"].digest != keys["tvm{kernels=off}"].digest
    assert keys["tvm{kernels=off}"].parts["target"] == "tvm{kernels=off}"
