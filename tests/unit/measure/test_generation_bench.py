"""The generation bench's structure: eager timed, a refused target a row with its reason, table and JSON."""
from __future__ import annotations

import pytest
import torch

from mlcomp.hardware.timing import TimingPolicy
from mlcomp.measure.generation_bench import DYNAMIC, EAGER, GenerationResult, GenerationRow, bench_generation

pytest.importorskip("transformers")

QUICK = TimingPolicy(warmup=0, budget_s=0.001, min_repeats=1, max_repeats=1)


def test_eager_is_timed_and_a_refused_target_is_a_row_with_its_reason():
    res = bench_generation("gpt2", 6, targets=(DYNAMIC, "tvm"), policy=QUICK, prompt_len=4)
    eager, dynamic, tvm = res.rows
    assert (eager.variant, dynamic.variant, tvm.variant) == (EAGER, DYNAMIC, "tvm")
    for row in (eager, dynamic):
        assert row.ttft_ms > 0 and row.tokens_per_s > 0 and row.tokens_equal is True and row.compile_s is None
    assert tvm.ttft_ms is None and tvm.tokens_equal is None
    assert tvm.note.startswith("skipped: target tvm cannot compile a generator")
    assert res.to_json()["rows"][2]["note"] == tvm.note and res.prompt == (1, 4)


def test_table_gives_speedup_against_eager_and_flags_other_tokens():
    res = GenerationResult("m", 32, (1, 8), [GenerationRow(EAGER, None, 10.0, 100.0, True),
                                             GenerationRow("cpu", 2.0, 5.0, 250.0, False)])
    rows = res.table().rows
    assert rows[0][3:6] == ("100.0", "1.00", "yes")
    assert rows[1][1:6] == ("2.0", "5.00", "250.0", "2.50", "NO")


def test_bench_generate_on_the_command_line():
    import json

    from click.testing import CliRunner

    from mlcomp.cli.main import main

    res = CliRunner().invoke(main, ["bench", "gpt2", "--generate", "4", "--prompt-len", "4", "--targets", "tvm",
                                    "--warmup", "0", "--budget", "0.001", "--min-repeats", "1", "--max-repeats", "1",
                                    "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output[res.output.index("["):])
    assert [r["variant"] for r in data[0]["rows"]] == ["eager", "tvm"]
    assert data[0]["rows"][0]["tokens_per_s"] > 0 and data[0]["tokens"] == 4


def test_dynamic_loop_starts_each_decode_run_from_the_prompts_cache():
    from mlcomp.measure.generation_bench import DynamicLoop
    from mlcomp.models.third_party import build_generative

    model, (prompt,) = build_generative("llama", batch=1, seq=4)
    loop = DynamicLoop(model)
    token, _ = loop.first_token(prompt)
    first, again = loop.decode_from(token, 4, 5), loop.decode_from(token, 4, 5)
    assert torch.equal(first, again) and loop.cache.get_seq_length() == 4
    expected = model.generate(prompt, do_sample=False, max_new_tokens=6, min_new_tokens=6)[:, 5:]
    assert torch.equal(first, expected)
