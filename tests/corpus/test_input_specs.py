"""TorchScript files given the wrong input spec: the error names the input, what was given, what the
model's first op does with it, and an ``--input-shape`` that works (``mlcomp.frontend.script_inputs``)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.corpus.harness import check


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(50, 8), nn.Linear(8, 3)

    def forward(self, ids):
        return self.out(self.emb(ids))


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.conv(x).relu()


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scripts")
    torch.manual_seed(0)
    torch.jit.trace(Tagger().eval(), (torch.randint(0, 50, (2, 8)),)).save(str(folder / "tagger.pt"))
    torch.jit.trace(Conv().eval(), (torch.randn(1, 3, 8, 8),)).save(str(folder / "conv.pt"))
    return folder


@pytest.mark.parametrize("capture", [[], ["--capture", "fx"]])
def test_float_ids_name_the_embedding_and_the_dtype_to_give(user_folder, scripts, capture):
    check(user_folder, ["compile", str(scripts / "tagger.pt"), "--input-shape", "2x8", *capture, "-o", "out"],
          expect=("input 1 (ids) is f32[2, 8]", "first use of it is aten::embedding", "integer tensor",
                  "--input-shape 2x8:i64"))


def test_an_input_too_many_is_counted(user_folder, scripts):
    check(user_folder, ["compile", str(scripts / "tagger.pt"), "--input-shape", "2x8:i64", "--input-shape", "2x8:i64",
                        "-o", "out"],
          expect=("takes 1 input(s) (ids) but 2 were given", "--input-shape 2x8:i64"))


def test_a_conv_input_of_the_wrong_rank_and_dtype(user_folder, scripts):
    check(user_folder, ["compile", str(scripts / "conv.pt"), "--input-shape", "8x8", "-o", "out"],
          expect=("conv fails on the given inputs (--input-shape 8x8:f32)", "Expected 4-dimensional input",
                  "one --input-shape per forward argument"))
    check(user_folder, ["compile", str(scripts / "conv.pt"), "--input-shape", "1x3x8x8:i64", "-o", "out"],
          expect=("input 1 (x) is i64[1, 3, 8, 8]", "floating-point tensor", "--input-shape 1x3x8x8:f32"))
