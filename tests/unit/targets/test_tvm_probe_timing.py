"""The small-GEMM probe's timing (tvm/offload/probe_timing.py) on fake calls and a fake clock: batched samples,
the decision through hardware/decide.py, a wild ratio re-measured after a pause, and what is recorded."""
from __future__ import annotations

from pytest import approx

from mlcomp.hardware.decide import Decision, Verdict
from mlcomp.targets.tvm.offload import probe_timing
from mlcomp.targets.tvm.offload.probe_timing import SETTLE_S, WILD, batch_size, judge


class Clock:
    """A fake clock; a fake call advances it by its cost (the cost may change after a pause)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.pauses: list[float] = []
        self.calls = {"tvm": 0, "torch": 0}

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.pauses.append(s)
        self.now += s

    def fn(self, name: str, cost: float, after_pause: float | None = None):
        def call() -> None:
            self.calls[name] += 1
            self.now += after_pause if self.pauses and after_pause is not None else cost
        return call


def _judge(tvm_s: float, torch_s: float, torch_after_pause: float | None = None) -> tuple[Decision, Clock]:
    clock = Clock()
    d = judge("q", clock.fn("tvm", tvm_s), clock.fn("torch", torch_s, torch_after_pause), clock=clock,
              sleep=clock.sleep)
    return d, clock


def test_clear_winners_and_the_noise_margin():
    d, clock = _judge(13e-6, 44e-6)                   # batch-1 GEMV: TVM's serial kernel vs a torch call
    assert (d.choice, d.verdict, d.default) == ("tvm", Verdict.DECIDED, "torch")
    assert d.medians == {"tvm": approx(13e-6), "torch": approx(44e-6)}     # per call, not per batch
    assert clock.pauses == []                                            # 0.3x: not wild, measured once
    d, _ = _judge(140e-6, 40e-6)                      # a layer norm TVM runs slower
    assert d.choice == "torch" and d.verdict is Verdict.DECIDED
    d, _ = _judge(38e-6, 40e-6)                       # within KEEP_RATIO: the torch call stays
    assert d.choice == "torch"


def test_samples_are_batches_of_calls():
    assert batch_size(20e-6) == 10 and batch_size(1e-3) == 1 and batch_size(1e-9) == probe_timing.MAX_BATCH
    d, clock = _judge(20e-6, 40e-6)
    # warm-up (20 each) + one sampler warm-up batch + every round's batch of 10 (tvm) / 5 (torch) calls
    assert (clock.calls["tvm"] - 20) % 10 == 0 and (clock.calls["torch"] - 20) % 5 == 0
    assert (clock.calls["tvm"] - 20) // 10 == d.rounds + 1 and (clock.calls["torch"] - 20) // 5 == d.rounds + 1


def test_a_wild_ratio_is_re_measured_after_a_pause_and_the_second_stands():
    # torch inflated 77x while something else held a core, 44 us after the pause: the torch call stays
    d, clock = _judge(150e-6, 3.4e-3, torch_after_pause=44e-6)
    assert clock.pauses == [SETTLE_S]
    assert d.choice == "torch" and d.medians["torch"] == approx(44e-6)
    assert "re-measured after a 0.2 s pause" in d.why and f"beyond {WILD:g}x" in d.why and "0.0441" in d.why
    assert d.to_json()["why"] == d.why and Decision.from_json(d.to_json()).choice == "torch"   # recorded as is
    # a ratio that is wild twice is what this host does (a tiny op against a torch call's fixed cost)
    d, clock = _judge(1e-6, 12e-6)
    assert clock.pauses == [SETTLE_S] and d.choice == "tvm" and "re-measured" in d.why
    # wild the other way (TVM far slower) is re-measured too
    d, clock = _judge(1e-3, 50e-6)
    assert clock.pauses == [SETTLE_S] and d.choice == "torch"


def test_a_torch_call_stalled_twice_is_compared_at_one_thread():
    """Layer norm 1x128x256: TVM 140 us, torch 40 us on a quiet machine (66 us on one thread), 3.4 ms per call
    while its barrier waits for a worker that has no core; the stall outlasts the pause."""
    import contextlib

    clock, state = Clock(), {"threads": 2}

    def torch_call() -> None:
        clock.now += 3.4e-3 if state["threads"] > 1 else 66e-6

    @contextlib.contextmanager
    def one_thread():
        state["threads"] = 1
        yield
        state["threads"] = 2

    d = judge("q", clock.fn("tvm", 140e-6), torch_call, clock=clock, sleep=clock.sleep, one_thread=one_thread)
    assert d.choice == "torch" and d.medians["torch"] == approx(66e-6) and state["threads"] == 2
    assert "torch on one thread" in d.why and "a stalled multi-thread figure" in d.why
    # without the one-thread fallback the stalled figure would have decided for TVM
    assert judge("q", clock.fn("tvm", 140e-6), torch_call, clock=clock, sleep=clock.sleep).choice == "tvm"
    # TVM wildly faster even against torch on one thread (a tiny op): TVM
    d = judge("q", clock.fn("tvm", 3e-6), torch_call, clock=clock, sleep=clock.sleep, one_thread=one_thread)
    assert d.choice == "tvm" and "torch on one thread" in d.why
