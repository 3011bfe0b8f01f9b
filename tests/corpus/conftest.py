"""Fixtures shared by the corpus cases: the user's folder, a small artifact, a batch-2 ``.pt2``."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from mlcomp.cli.main import main
from tests.corpus.harness import make_user_folder


@pytest.fixture
def user_folder(tmp_path):
    return make_user_folder(tmp_path)


@pytest.fixture(scope="module")
def pt2_batch2(tmp_path_factory):
    path = tmp_path_factory.mktemp("pt2") / "mlp-b2.pt2"
    res = CliRunner().invoke(main, ["models", "save", "mlp", "--format", "pt2", "--batch", "2", "-o", str(path)])
    assert res.exit_code == 0, res.output
    return str(path)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("bad-inputs") / "mlp-cpu"
    res = CliRunner().invoke(main, ["compile", "mlp", "--target", "cpu", "-o", str(out), "--threads", "1"])
    assert res.exit_code == 0, res.output
    return out


