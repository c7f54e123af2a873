import torch

from nakta_model.bench.timing import eager_ms, input_sets


def test_eager_ms_times_a_call_on_the_cpu():
    calls = []
    ms = eager_ms(lambda: calls.append(torch.ones(64).sum()), torch.device("cpu"))
    assert ms >= 0.0 and len(calls) == 4  # one warm-up, then the median of three


def test_input_sets_is_one_on_the_cpu():
    assert input_sets(torch.device("cpu"), 1 << 20) == 1
