"""The engines ``speed_bench.throughput`` times: each generates a whole list of requests with
its own batching and says, per request, how many tokens it generated and when (host clock,
``time.perf_counter``) its first new token was known on the host.

* ``nakta``: one ``Generator(max_batch=...)`` call over every request (continuous batching);
  a request's first token is known when the Generator's ``on_tokens`` hook first reports it
  (right after the prefill that admitted it: the sampled tokens are read back there).
* ``hf``: ``transformers``' ``generate`` over consecutive batches of ``max_batch`` requests,
  left-padded, static KV cache, greedy; EOS is ignored by ``min_new_tokens = max_new_tokens``
  (HF masks EOS out instead of keeping it: the same work). The first token of a batch is known
  when ``generate`` hands it to its streamer (on the host, as ``tokens.cpu()``).
* ``llama_org``: Meta's loop (``Llama.generate``) over consecutive batches of ``max_batch``
  requests, ``eos_id=-1``. Its model's ``forward`` is wrapped to read the clock (after a device
  sync) at the step that produces each request's first token: the loop itself syncs at every
  step (``all(eos_reached)``), so the wrapper adds no stall of its own.

A batched engine decodes every row of a batch to the batch's longest output; only the tokens
each request asked for count as output (``speed_bench.throughput`` does the counting).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from speed_bench.weights import WeightSource


@dataclass
class Outcome:
    """Per request: tokens generated (>= asked for) and when its first one was known."""

    generated: list[int]
    first_token_at: list[float]
    stats: dict | None = None  # engine counters (nakta: its GenerationStats)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ThroughputEngine:
    name = "engine"

    def warm_up(self, prompts: list[list[int]], outputs: list[int], max_batch: int) -> None:
        """Whatever the first call of this shape would do once (compile, capture, allocate)."""

    def run(self, prompts: list[list[int]], outputs: list[int], max_batch: int) -> Outcome:
        raise NotImplementedError

    def close(self) -> None:
        pass


class NaktaThroughput(ThroughputEngine):
    """One model; a fresh ``Generator`` per ``max_batch`` (its cache has that many rows)."""

    name = "nakta"

    kv_cache: str | None = None  # None: the model's dtype; "fp8": e4m3 KV pages

    def __init__(
        self, weights: WeightSource, device, dtype, max_seq: int, quant: str | None = None
    ):
        from nakta_model.loading import load

        self.model = load(weights.source(device, dtype), device, dtype, quant=quant)
        self.max_seq, self.device, self.quant = max_seq, device, quant
        self.gen, self.max_batch = None, None

    def _generator(self, max_batch: int):
        from nakta_model.generation import Generator

        if self.max_batch != max_batch:
            self.gen = None  # its captured graphs and their memory pools go first
            self.model.clear_cache()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.gen = Generator(
                self.model, max_batch=max_batch, max_seq_len=self.max_seq, kv_cache=self.kv_cache
            )
            self.max_batch = max_batch
        return self.gen

    def warm_up(self, prompts: list[list[int]], outputs: list[int], max_batch: int) -> None:
        """Capture the decode step of every batch bucket and compile the prefill kernels for
        these prompt lengths, outside the timed call (a bucket's graph is captured on first use)."""
        from nakta_model.generation import GenerationRequest

        gen = self._generator(max_batch)
        for bucket in gen.buckets:
            reqs = [GenerationRequest(p, 2) for p in (prompts * bucket)[:bucket]]
            gen.generate(reqs)

    def run(self, prompts, outputs, max_batch):
        from nakta_model.generation import GenerationRequest

        gen = self._generator(max_batch)
        first = [float("nan")] * len(prompts)

        def on_tokens(i: int, tokens: list[int], finish: str | None) -> None:
            if tokens and first[i] != first[i]:  # nan: not seen yet
                first[i] = time.perf_counter()

        reqs = [GenerationRequest(p, n) for p, n in zip(prompts, outputs)]  # no stop ids
        results = gen.generate(reqs, on_tokens=on_tokens)
        stats = vars(gen.stats).copy()
        stats.pop("first_token_s")  # per request: measured here from on_tokens instead
        stats["prefill_burst"] = gen.prefill_burst  # prefill forwards before a chunk
        return Outcome([len(r.tokens) for r in results], first, stats)

    def close(self):
        self.gen = None
        self.model.clear_cache()
        self.model = None


class _FirstTokenStreamer:
    """An HF streamer that notes the host clock when the first generated tokens arrive (the
    first ``put`` is the prompt itself)."""

    def __init__(self):
        self.puts, self.first_at = 0, float("nan")

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_at = time.perf_counter()

    def end(self) -> None:
        pass


def _batches(n: int, size: int) -> list[range]:
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


class HFThroughput(ThroughputEngine):
    name = "hf"

    def __init__(self, weights: WeightSource, device, dtype, max_seq: int):
        from speed_bench.hf_engine import hf_model

        self.model = hf_model(weights, device, dtype, max_seq)
        self.device = device

    def _generate(self, prompts: list[list[int]], new: int) -> tuple[int, float]:
        """(tokens generated per row, when the first were known) for one left-padded batch."""
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        streamer = _FirstTokenStreamer()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask.to(self.device), max_new_tokens=new,
                min_new_tokens=new, do_sample=False, cache_implementation="static",
                pad_token_id=0, streamer=streamer,
            )  # fmt: skip
        return out.shape[1] - width, streamer.first_at

    def warm_up(self, prompts: list[list[int]], outputs: list[int], max_batch: int) -> None:
        """Run the first batch and the last (a smaller one when the count does not divide):
        the static cache is made and the step compiled for each shape the timed run meets."""
        groups = _batches(len(prompts), max_batch)
        for g in {groups[0].start: groups[0], groups[-1].start: groups[-1]}.values():
            self._generate([prompts[i] for i in g], max(outputs[i] for i in g))

    def run(self, prompts, outputs, max_batch):
        generated, first = [0] * len(prompts), [float("nan")] * len(prompts)
        for g in _batches(len(prompts), max_batch):
            n, at = self._generate([prompts[i] for i in g], max(outputs[i] for i in g))
            for i in g:
                generated[i], first[i] = n, at
        return Outcome(generated, first)

    def close(self):
        self.model = None


class LlamaOrgThroughput(ThroughputEngine):
    """Meta's loop; built again (its cache has ``max_batch`` rows) when ``max_batch`` changes."""

    name = "llama_org"

    def __init__(self, weights: WeightSource, device, dtype, max_seq: int):
        self.weights, self.device, self.dtype, self.max_seq = weights, device, dtype, max_seq
        self.llama, self.max_batch = None, None

    def _build(self, max_batch: int):
        from llama_org import Llama

        if self.max_batch != max_batch:
            self.llama = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.llama = Llama.from_state_dict(
                self.weights.args.to_meta_params(),
                self.weights.state_dict(self.device, self.dtype), self.max_seq, max_batch,
                device=self.device, dtype=self.dtype,
            )  # fmt: skip
            self.max_batch = max_batch
        return self.llama

    def warm_up(self, prompts: list[list[int]], outputs: list[int], max_batch: int) -> None:
        llama = self._build(max_batch)
        llama.generate(prompts[:max_batch], max_gen_len=2, temperature=0.0, eos_id=-1, pad_id=-1)

    def run(self, prompts, outputs, max_batch):
        llama = self._build(max_batch)
        generated, first = [0] * len(prompts), [float("nan")] * len(prompts)
        model = llama.model
        for g in _batches(len(prompts), max_batch):
            batch = [prompts[i] for i in g]
            shortest = min(map(len, batch))
            # forward call c (1-based) yields the token at position shortest + c - 1: a prompt
            # of length L gets its first new token from call L - shortest + 1
            due: dict[int, list[int]] = {}
            for i in g:
                due.setdefault(len(prompts[i]) - shortest + 1, []).append(i)
            model.forward = _clocked(model.forward, due, first, self.device)
            try:
                toks, _ = llama.generate(
                    batch, max_gen_len=max(outputs[i] for i in g), temperature=0.0,
                    eos_id=-1, pad_id=-1,
                )  # fmt: skip
            finally:
                del model.forward  # the class's forward again
            for i, t in zip(g, toks):
                generated[i] = len(t)
        return Outcome(generated, first)

    def close(self):
        from llama_org.distributed import shutdown

        self.llama = None
        shutdown()


def _clocked(forward: Callable, due: dict[int, list[int]], first: list[float], device):
    """``forward``, noting the clock (after a sync) for the requests ``due`` at each call."""
    calls = [0]

    def wrapper(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls[0] += 1
        if calls[0] in due:
            _sync(device)
            now = time.perf_counter()
            for i in due[calls[0]]:
                first[i] = now
        return out

    return wrapper


class NaktaFp8Throughput(NaktaThroughput):
    """The Nakta engine on the FP8 model (e4m3 block weights, ``docs/fp8.md``)."""

    name = "nakta_fp8"

    def __init__(self, weights: WeightSource, device, dtype, max_seq: int):
        super().__init__(weights, device, dtype, max_seq, quant="fp8")


class NaktaKv8Throughput(NaktaThroughput):
    """The Nakta engine with an e4m3 KV cache (``kv_cache="fp8"``, ``docs/fp8.md``)."""

    name = "nakta_kv8"
    kv_cache = "fp8"


class NaktaFp8Kv8Throughput(NaktaFp8Throughput):
    """FP8 weights and an e4m3 KV cache."""

    name = "nakta_fp8_kv8"
    kv_cache = "fp8"


BUILDERS: dict[str, type[ThroughputEngine]] = {
    "nakta": NaktaThroughput,
    "nakta_fp8": NaktaFp8Throughput,
    "nakta_kv8": NaktaKv8Throughput,
    "nakta_fp8_kv8": NaktaFp8Kv8Throughput,
    "hf": HFThroughput,
    "llama_org": LlamaOrgThroughput,
}
