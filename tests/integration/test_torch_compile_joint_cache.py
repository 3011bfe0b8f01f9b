"""The joint route's forward and backward go through the compile cache and its verification (dropout included)."""
from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn

from mlcomp.api.cache import ARTIFACT, CompileCache
from mlcomp.dynamo import backend as mb
from mlcomp.dynamo import joint_step
from mlcomp.runtime.artifact import Artifact

pytestmark = pytest.mark.usefixtures("fresh_dynamo")   # tests/conftest.py


def test_the_halves_of_a_dropout_joint_are_verified_stored_and_hit_with_one_eager_run_each(tmp_path, monkeypatch):
    runs: Counter[str] = Counter()
    evaluate = joint_step.evaluate

    def counted(graph, *xs):                 # each half's reference: its IR evaluated (eager of the half)
        runs[graph.name] += 1
        return evaluate(graph, *xs)
    monkeypatch.setattr(joint_step, "evaluate", counted)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 4)).train()
    x = torch.randn(6, 8)
    statuses = []
    for _ in range(2):
        torch._dynamo.reset()
        runs.clear()
        report = mb.BackendReport()
        fast = torch.compile(copy.deepcopy(model), backend="mlcomp", options={"report": report, "cache": tmp_path})
        fast(x).pow(2).sum().backward()
        (part,) = report.partitions
        assert part.ran_on == "mlcomp:cpu"
        statuses.append(part.cache)
        assert sorted(runs.values()) == [1, 1] and len(runs) == 2      # forward and backward, once each
    assert statuses == ["stored", "hit"]
    cache = CompileCache(tmp_path)
    entries = cache.entries()
    assert len(entries) == 2
    for entry in entries:                    # verified against its IR from one seed: the dropout masks agreed
        assert Artifact.load(entry.path / ARTIFACT).manifest["verification"]["passed"] is True
