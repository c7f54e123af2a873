import pytest
import torch

from bench_common.timing import eager_ms, graph_ms, input_sets, interleaved_ms, rotated_ms


def test_eager_ms_times_a_call_on_the_cpu():
    calls = []
    ms = eager_ms(lambda: calls.append(torch.ones(64).sum()), torch.device("cpu"))
    assert ms >= 0.0 and len(calls) == 4  # one warm-up, then the median of three


def test_input_sets_is_one_on_the_cpu():
    assert input_sets(torch.device("cpu"), 1 << 20) == 1


def test_interleaved_ms_alternates_paths_on_the_cpu():
    order = []
    calls = {
        "a": [lambda: order.append("a"), lambda: order.append("a")],
        "b": [lambda: order.append("b")],
    }
    res = interleaved_ms(calls, torch.device("cpu"), rounds=3)
    assert set(res) == {"a", "b"}
    assert all(ms >= 0.0 and spread >= 0.0 for ms, spread in res.values())
    assert order == ["a", "a", "b"] * 3  # every round runs each path once, in turn


@pytest.mark.gpu
def test_rotated_ms_times_each_path_and_reports_what_cannot_be_captured():
    """Twice the bytes take longer; a call that syncs with the host (not capturable) is
    reported with its reason and the other paths are still timed."""
    small = torch.empty(1 << 24, device="cuda")
    big = torch.empty(1 << 25, device="cuda")
    calls = {
        "small": [lambda: small.mul_(1.0)],
        "host_sync": [lambda: small.sum().item()],
        "big": [lambda: big.mul_(1.0)],
    }
    with torch.cuda.stream(torch.cuda.Stream()):
        times, errors = rotated_ms(calls, rounds=3)
    assert set(times) == {"small", "big"} and set(errors) == {"host_sync"}
    assert errors["host_sync"]
    assert times["big"] > 1.5 * times["small"] > 0.0


@pytest.mark.gpu
def test_graph_ms_takes_one_call_or_several_on_the_current_stream():
    """The one graph timer: a single callable or a list, captured on the current stream."""
    small = torch.empty(1 << 24, device="cuda")
    big = torch.empty(1 << 25, device="cuda")
    with torch.cuda.stream(torch.cuda.Stream()):
        one = graph_ms(lambda: small.mul_(1.0))
        several = graph_ms([lambda: big.mul_(1.0), lambda: big.mul_(1.0)], budget_ms=5.0)
    assert several > 1.5 * one > 0.0
