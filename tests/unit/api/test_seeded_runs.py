"""Every run of an artifact compared with eager starts from the seed eager ran from.

A model that draws random numbers in inference (``rand_like``) verifies only when the artifact draws
from the same seed as the eager reference: after the compile, in the CLI's re-check of the saved
folder, in ``mlcomp.load(verify=True)`` and in ``mlcomp run --verify``.  The same folder checked
without the seed fails, so each assertion below fails if its path runs the artifact unseeded.
"""
from __future__ import annotations

import json
import textwrap

import pytest
import torch
from click.testing import CliRunner

import mlcomp
from mlcomp.cli.main import main
from mlcomp.pipeline import seeding
from mlcomp.runtime.artifact import Artifact

NOISY = textwrap.dedent('''
    import torch


    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x) + torch.rand_like(x)


    def build():
        torch.manual_seed(0)
        return Noisy().eval(), (torch.randn(4, 8),)
''')


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``mlcomp compile noisy.py:build --target cpu -o OUT --json``: the folder and the command's facts."""
    root = tmp_path_factory.mktemp("seeded")
    (root / "noisy.py").write_text(NOISY)
    out = root / "out"
    result = CliRunner().invoke(main, ["compile", f"{root / 'noisy.py'}:build", "--target", "cpu", "-O", "0",
                                       "--no-cache", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return out, json.loads(result.output[result.output.index("{"):])


def test_the_folder_verifies_only_from_the_eager_seed(saved):
    out, facts = saved
    assert facts["verification"]["passed"] and facts["reloaded"]["passed"]   # the re-check after save
    art = Artifact.load(out)
    inputs, expected = art.reference
    with torch.random.fork_rng():
        torch.manual_seed(1)
        other = art(*inputs)
    assert not torch.allclose(other, expected[0], atol=1e-3)              # the numbers do depend on the seed
    torch.rand(100)                                                       # the global generator moved on
    assert art.verify(record=False, raise_on_failure=False).passed       # verify runs from the eager seed


def test_load_and_run_verify_from_the_eager_seed(saved):
    out, _ = saved
    torch.rand(100)
    mlcomp.load(out, verify=True)                       # raises VerificationError when the re-run differs
    result = CliRunner().invoke(main, ["run", str(out), "--verify", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["verification"]["passed"]


def test_seeded_forks_the_cuda_generators_only_once_cuda_is_initialised(monkeypatch):
    """Without a GPU the CUDA side is faked: which devices' generators ``fork_rng`` is asked to restore, and
    which fake device generators are seeded (none before CUDA is initialised: nothing is queued for later)."""
    forked = []
    real = torch.random.fork_rng

    def spy(devices, **kwargs):
        forked.append(list(devices))
        return real(devices=[], **kwargs)

    monkeypatch.setattr(torch.random, "fork_rng", spy)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for initialised in (False, True):
        gens = [torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)]
        monkeypatch.setattr(torch.cuda, "default_generators", gens)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialised)
        before = torch.get_rng_state()
        with seeding.seeded():
            a = torch.rand(4)
        assert torch.equal(torch.get_rng_state(), before)
        with seeding.seeded():
            assert torch.equal(torch.rand(4), a)
        assert [g.initial_seed() for g in gens] == ([seeding.VERIFY_SEED] * 2 if initialised else [7, 7])
    assert forked == [[], [], [0, 1], [0, 1]]


@pytest.mark.cuda
def test_seeded_draws_the_same_cuda_numbers_and_restores_the_generator():
    torch.cuda.init()
    before = torch.cuda.get_rng_state()
    with seeding.seeded():
        a = torch.rand(4, device="cuda")
    assert torch.equal(torch.cuda.get_rng_state(), before)
    with seeding.seeded():
        assert torch.equal(torch.rand(4, device="cuda"), a)
