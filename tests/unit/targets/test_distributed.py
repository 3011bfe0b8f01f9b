"""The distributed target: stage modules, save/load, and real gloo runs on loopback (few: each spawn ~5 s)."""
from __future__ import annotations

import pytest
import torch

from mlcomp.base.errors import MlcompError
from mlcomp.targets.distributed.launch import backend as launch_backend
from mlcomp.passes.placement.partition import Partition
from mlcomp.pipeline.pass_base import PassContext
from mlcomp.runtime.artifact import Artifact
from mlcomp.targets.distributed.target import DistributedTarget, launch_check


@pytest.fixture(scope="module")
def mlp4(captured):
    module, inputs, graph = captured("mlp", batch=4)
    return module, inputs, graph


def _artifact(mlp4, stages, tmp_path_factory, *, check_launch=False, name="pp"):
    module, inputs, graph = mlp4
    staged = Partition(stages=stages).run(graph.copy(), PassContext()).graph
    art = DistributedTarget(check_launch=check_launch).compile(staged)
    with torch.no_grad():
        art.set_reference(inputs, (module(*inputs),))
    return art, art.save(tmp_path_factory.mktemp(name) / "art")


@pytest.fixture(scope="module")
def two_stage(mlp4, tmp_path_factory):
    return _artifact(mlp4, 2, tmp_path_factory, check_launch=True)


def test_compile_verifies_a_real_two_process_run(two_stage, mlp4):
    art, folder = two_stage
    result = art.manifest["distributed_verification"]
    assert result["passed"] and result["nproc"] == 2 and result["backend"] == "gloo"
    assert [r["stages"] for r in result["ranks"]] == [[0], [1]]
    assert result["max_error"] < 1e-5
    # in one process the stages run one after another and equal eager; saved and reloaded alike
    module, inputs, _ = mlp4
    with torch.no_grad():
        expected = module(*inputs)
    torch.testing.assert_close(art(*inputs), expected, rtol=1e-5, atol=1e-6)
    again = Artifact.load(folder)
    assert again.runtime.info["stages"] == 2 and again.runtime.info["receives"][1] == again.runtime.info["sends"][0]
    torch.testing.assert_close(again(*inputs), expected, rtol=1e-5, atol=1e-6)


def test_two_process_training_matches_gradients_and_updated_weights(two_stage):
    _, folder = two_stage
    result = launch_check(folder, 2, train=True, schedule="gpipe",
                          optimizer="sgd{lr=0.05 momentum=0.9 weight_decay=0.01}")
    assert result["train"] and result["passed"], result
    assert result["max_error"] < 1e-5
    assert result["optimizer"] == "sgd{lr=0.05,momentum=0.9,weight_decay=0.01}"     # the spec each rank stepped


def test_launch_optimizer_spec_and_the_deprecated_lr(capsys, monkeypatch):
    """``--optimizer`` takes an optimizer spec; ``--lr X`` still means sgd{lr=X}, with a note."""
    from mlcomp.targets.distributed.launch import main, optimizer_of
    from mlcomp.runtime.optim import OptimizerKind

    monkeypatch.delenv("RANK", raising=False)
    assert optimizer_of(None, None).text() == "sgd{lr=0.1}"
    spec = optimizer_of("adam{lr=1e-3}", None)
    assert spec.kind is OptimizerKind.ADAM and spec.options.lr == 1e-3
    assert optimizer_of(None, 0.05).text() == "sgd{lr=0.05}"
    assert 'note: --lr is deprecated; use --optimizer "sgd{lr=0.05}"' in capsys.readouterr().err
    with pytest.raises(MlcompError, match="--lr and --optimizer were both given"):
        optimizer_of("sgd", 0.1)
    # a bad spec is a user error (exit 2) before any process group starts or the artifact is read
    assert main(["no-such-folder", "--train", "--optimizer", "sgd{lr=0}"]) == 2
    err = capsys.readouterr().err
    assert "bad optimizer spec at column 8" in err and "option 'lr' of optimizer 'sgd' must be greater than 0" in err


def test_launch_cli_refuses_a_bad_optimizer_before_torchrun(tmp_path):
    from click.testing import CliRunner

    from mlcomp.cli.main import main

    res = CliRunner().invoke(main, ["launch", str(tmp_path), "--train", "--optimizer", "adm{lr=0.1}"])
    assert res.exit_code == 2 and "unknown optimizer 'adm'; did you mean 'adam'?" in res.output, res.output
    assert "Traceback" not in res.output


def test_unpartitioned_graph_is_refused(mlp4):
    _, _, graph = mlp4
    with pytest.raises(MlcompError, match="no pipeline stages.*partition"):
        DistributedTarget(check_launch=False).compile(graph.copy())


@pytest.mark.slow
def test_four_processes_and_interleaved(mlp4, tmp_path_factory):
    _, folder = _artifact(mlp4, 4, tmp_path_factory, name="pp4")
    for kwargs in ({"train": False}, {"train": True, "schedule": "1f1b"}):
        result = launch_check(folder, 4, **kwargs)
        assert result["passed"] and result["nproc"] == 4, result
    inter = launch_check(folder, 2, train=True, schedule="interleaved", microbatches=2)
    assert inter["passed"] and [r["stages"] for r in inter["ranks"]] == [[0, 2], [1, 3]], inter


def test_nccl_only_when_each_local_rank_has_its_own_gpu():
    """NCCL refuses two ranks on one GPU: a 2-process run on a one-GPU machine goes through gloo."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert launch_backend(2) == ("nccl" if gpus >= 2 else "gloo")
    assert launch_backend(1) == ("nccl" if gpus >= 1 else "gloo")
