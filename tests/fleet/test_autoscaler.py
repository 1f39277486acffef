"""The autoscaler's decisions for given signals (no processes, an injected clock)."""

from __future__ import annotations

from fleetllm.fleet.autoscaler import Autoscaler, ScalingPolicy, Signals


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def scaler(min_copies=1, max_copies=8, **policy) -> tuple[Autoscaler, Clock]:
    clock = Clock()
    defaults = dict(down_window_s=30.0, cooldown_s=5.0, idle_s=60.0)
    return Autoscaler(ScalingPolicy(**{**defaults, **policy}), min_copies, max_copies, clock), clock


def test_a_queue_past_its_target_scales_up_in_proportion():
    a, _ = scaler(concurrency_per_copy=100)
    d = a.decide(Signals(copies=2, waiting=20))  # 10 per copy, target 5
    assert (d.desired, d.direction, d.reason) == (4, "up", "waiting")


def test_ttft_over_the_slo_scales_up_naming_ttft():
    a, _ = scaler(ttft_p90_s=0.5)
    d = a.decide(Signals(copies=2, waiting=1, ttft_p90_s=1.2))
    assert (d.desired, d.reason) == (5, "ttft")


def test_the_maximum_caps_a_scale_up():
    a, _ = scaler(max_copies=3)
    d = a.decide(Signals(copies=2, waiting=100))
    assert (d.desired, d.reason) == (3, "max")


def test_a_lull_must_last_the_down_window_before_copies_go():
    a, clock = scaler()
    for t in (0, 10, 20):
        clock.t = t
        assert a.decide(Signals(copies=4, waiting=0, kv_usage=0.1)).direction == "none"
    clock.t = 31
    d = a.decide(Signals(copies=4, waiting=0, kv_usage=0.1))
    assert (d.desired, d.direction, d.reason) == (1, "down", "min")


def test_a_burst_inside_the_down_window_keeps_the_copies():
    a, clock = scaler()
    clock.t = 1
    a.decide(Signals(copies=4, running=32))  # 8 per copy: exactly at target, 4 copies wanted
    clock.t = 31
    d = a.decide(Signals(copies=4, waiting=0))
    assert (d.desired, d.direction) == (4, "none")


def test_no_change_during_the_cooldown_after_a_change():
    a, clock = scaler()
    assert a.decide(Signals(copies=1, waiting=10)).desired == 2
    clock.t = 2
    d = a.decide(Signals(copies=2, waiting=40))
    assert (d.desired, d.reason) == (2, "cooldown")
    clock.t = 6
    assert a.decide(Signals(copies=2, waiting=40)).desired == 8


def test_a_spike_shorter_than_the_up_window_does_not_scale():
    a, clock = scaler(up_window_s=10)
    a.decide(Signals(copies=2, waiting=0))
    clock.t = 5
    assert a.decide(Signals(copies=2, waiting=40)).direction == "none"


def test_a_min_zero_model_goes_to_zero_when_idle_and_comes_back_for_a_held_request():
    a, clock = scaler(min_copies=0)
    clock.t = 30
    assert a.decide(Signals(copies=1)).desired == 1  # idle for 30 s of 60
    clock.t = 61
    d = a.decide(Signals(copies=1))
    assert (d.desired, d.direction, d.reason) == (0, "down", "idle")
    clock.t = 62  # inside the cooldown: a held request still brings a copy at once
    d = a.decide(Signals(copies=0, held=1))
    assert (d.desired, d.direction, d.reason) == (1, "up", "held")


def test_kv_pressure_alone_scales_up():
    a, _ = scaler()
    d = a.decide(Signals(copies=2, kv_usage=0.95))
    assert (d.desired, d.reason) == (3, "kv")


def test_concurrency_sizes_a_model_both_ways():
    a, clock = scaler()
    d = a.decide(Signals(copies=2, running=40))  # 20 per copy, target 8
    assert (d.desired, d.reason) == (5, "concurrency")
    clock.t = 40
    a.decide(Signals(copies=5, running=12))
    clock.t = 80
    d = a.decide(Signals(copies=5, running=12))  # 2.4 per copy for 30 s
    assert (d.desired, d.direction) == (2, "down")


def test_latency_far_under_its_target_does_not_shrink_a_busy_model():
    a, clock = scaler(ttft_p90_s=1.0)
    for t in (0, 20, 40, 60):
        clock.t = t
        d = a.decide(Signals(copies=7, running=54, ttft_p90_s=0.05))  # within 10% of 8 per copy
        assert (d.desired, d.direction) == (7, "none")


def test_a_hot_lora_adapter_scales_its_base_models_copies_naming_adapter():
    a, _ = scaler(adapter_concurrency_per_copy=4)
    hot = Signals(copies=2, running=13, adapters={"sql": 12.0, "chat": 1.0})  # 6.5 per copy: concurrency in bounds
    d = a.decide(hot)  # sql: 12 in flight on 2 copies, 4 per copy wanted
    assert (d.desired, d.direction, d.reason) == (3, "up", "adapter")
    b, _ = scaler()  # no per-adapter target: the same load is within the model's concurrency target
    assert b.decide(hot).direction == "none"
