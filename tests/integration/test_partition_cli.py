"""`mlcomp profile` and `mlcomp partition` (the launch command is covered by tests/unit/targets/test_distributed.py)."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mlcomp.cli.main import main


def test_profile_then_partition_with_measured_times_and_a_plot(tmp_path):
    runner = CliRunner()
    times = tmp_path / "times.json"
    res = runner.invoke(main, ["profile", "mlp", "--batch", "4", "--repeats", "2", "-o", str(times)])
    assert res.exit_code == 0, res.output
    data = json.loads(times.read_text())
    assert data["model"] == "mlp" and len(data["seconds"]) == 8 and all(v > 0 for v in data["seconds"].values())
    plot = tmp_path / "timeline.png"
    res = runner.invoke(main, ["partition", "mlp", "--batch", "4", "--stages", "3", "--times", str(times),
                               "--training", "--schedule", "gpipe", "--plot", str(plot)])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0] == "mlp in 3 stages (throughput)"
    assert lines[1].split() == ["stage", "nodes", "time", "ms", "memory", "MiB", "sends", "MiB"]
    rows = [line.split() for line in lines[3:6]]
    assert [r[0] for r in rows] == ["0", "1", "2"] and sum(int(r[1]) for r in rows) == 8
    assert "simulated gpipe, 4 microbatches: bubble" in res.output
    assert plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow      # a second 2-process probe (tests/unit/hardware/test_link.py runs the first)
def test_partition_with_the_probe_simulates_overhead_on_the_probed_cores():
    res = CliRunner().invoke(main, ["partition", "mlp", "--batch", "2", "--stages", "2", "--probe", "--json"])
    assert res.exit_code == 0, res.output
    facts = json.loads(res.output)
    probe = facts["probe"]
    assert probe["cores"] >= 1 and probe["link"]["latency"] > 0 and probe["op_overhead"] >= 0
    # the mlp's compute is microseconds: with the probed overhead a batch (4 microbatches, 2 ranks) cannot
    # run faster than 4 overheads + 1 step overhead on the busiest rank
    floor = 4 * probe["op_overhead"] + probe["step_overhead"]
    assert facts["batches_per_second"] <= 1 / floor
