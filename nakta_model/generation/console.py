"""The generate command's terminal side: prompts in, streamed text and a timing line out.

Several prompts are generated together (continuous batching) but printed in order: the first
unfinished prompt streams live, the ones after it are buffered and printed once it is done.
Under a tensor-parallel grid every rank generates (the same seed, so the same draws) and only
rank 0 reads stdin (``--interactive``: each line handed to every rank) and prints.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import torch

from nakta_model.chat import encode_chat
from nakta_model.cli import InputError
from nakta_model.generation.engine import Generator, max_rows
from nakta_model.generation.streaming import StreamTiming, TextStream, generate_streaming
from nakta_model.parallel import ParallelContext, gather_objects, is_distributed

__all__ = ["GenerationSession", "OrderedPrinter", "dtype_name"]


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


class OrderedPrinter:
    """Pieces of several generations, written in prompt order: the head streams, the rest wait."""

    def __init__(self, prompts: Sequence[str], out=None, enabled: bool = True):
        self.prompts, self.out, self.enabled = list(prompts), out or sys.stdout, enabled
        self.pending = [""] * len(prompts)
        self.done = [False] * len(prompts)
        self.head = 0
        self._begin(0)

    def write(self, i: int, piece: str, finish: str | None) -> None:
        self.pending[i] += piece
        self.done[i] = self.done[i] or finish is not None
        while self.head < len(self.prompts):
            self._emit(self.pending[self.head])
            self.pending[self.head] = ""
            if not self.done[self.head]:
                break
            self._emit("\n" if len(self.prompts) == 1 else "\n\n")
            self.head += 1
            self._begin(self.head)

    def _begin(self, i: int) -> None:
        if i < len(self.prompts):
            self._emit(self.prompts[i])

    def _emit(self, text: str) -> None:
        if self.enabled and text:
            self.out.write(text)
            self.out.flush()


class GenerationSession:
    """One loaded model, its tokenizer and the command's settings (``a``: parsed arguments with
    ``sampling``, ``max_new_tokens``, ``stop``, ``seed``, ``warmup``; ``chat`` and ``system``
    optional). In chat mode a prompt is a user message in the tokenizer's chat format, after
    ``history`` (the interactive conversation so far)."""

    def __init__(self, a, model, tokenizer, parallel: ParallelContext):
        self.a, self.model, self.tokenizer, self.parallel = a, model, tokenizer, parallel
        self.leader = parallel.is_leader
        self._generators: dict[tuple[int, int], Generator] = {}
        self.chat = bool(getattr(a, "chat", False))
        self.history: list[dict[str, str]] = []
        self.replies: list[str] = []  # the last run's texts, on every rank

    def encode(self, prompt: str) -> list[int]:
        """A prompt's ids: BOS + its text, or (chat) the dialog so far plus it as a user turn."""
        if not self.chat:
            return self.tokenizer.encode(prompt, bos=True, eos=False)
        system = getattr(self.a, "system", None)
        dialog = [{"role": "system", "content": system}] if system else []
        dialog += [*self.history, {"role": "user", "content": prompt}]
        return encode_chat(self.tokenizer, dialog)

    def say(self, message: str) -> None:
        """A status line on stderr (rank 0 only), apart from the generated text."""
        if self.leader:
            print(message, file=sys.stderr, flush=True)

    # ------------------------------------------------------------------------------- runs
    def run(self, prompts: Sequence[str]) -> list[dict] | None:
        """Generate ``prompts`` (batched), print them in order, then the timing line."""
        encoded = [self.encode(p) for p in prompts]
        limit = self.model.args.max_seq_len
        for i, ids in enumerate(encoded):
            if len(ids) >= limit:
                raise InputError(
                    f"prompt {i + 1} has {len(ids)} tokens; the model's max_seq_len {limit} "
                    "leaves no room to generate"
                )
        for i, ids in enumerate(encoded):  # the row ends at max_seq_len: say so, not stop early
            room = limit - len(ids)
            if room < self.a.max_new_tokens:
                self.say(
                    f"warning: prompt {i + 1} has {len(ids)} tokens and the model's max_seq_len "
                    f"is {limit}: at most {room} new tokens, not --max-new-tokens "
                    f"{self.a.max_new_tokens}"
                )
        row_len = min(limit, max(map(len, encoded)) + self.a.max_new_tokens)
        gen = self._generator(len(prompts), row_len)
        warmup = (
            self.a.warmup if self.a.warmup is not None else int(self.model.device.type == "cuda")
        )
        for _ in range(warmup):  # compile the kernels, capture the graphs: not timed
            self._generate(gen, prompts, encoded, min(self.a.max_new_tokens, 2 * gen.chunk), False)
        results, streams, timing = self._generate(
            gen, prompts, encoded, self.a.max_new_tokens, True
        )
        self.replies = [s.shown for s in streams]
        self.say(self.timing_line(timing, len(prompts), warmup))
        if not self.leader:
            return None
        return [
            {"prompt": p, "text": s.shown, "tokens": list(r.tokens), "finish": r.finish}
            for p, s, r in zip(prompts, streams, results)
        ]

    def interactive(self) -> None:
        """A prompt per stdin line until end of input (rank 0 reads; every rank generates); a
        line that cannot be generated (too long) is an ``error:`` line, and the session goes on."""
        while True:
            line = self._read_line()
            if line is None:
                return
            if line.strip():
                try:
                    self.run([line])
                except InputError as e:  # every rank meets the same line: all go on
                    self.say(f"error: {e}")
                    continue
                if self.chat:  # the next line answers this reply
                    self.history += [
                        {"role": "user", "content": line},
                        {"role": "assistant", "content": self.replies[0]},
                    ]

    # ---------------------------------------------------------------------------- helpers
    def _generator(self, n_prompts: int, row_len: int) -> Generator:
        # every prompt in flight at once (up to the step's limit): a row takes only the pages its
        # prompt and budget need, one the pool cannot hold yet waits (the pool's size is agreed
        # over tensor-parallel ranks)
        rows = min(max_rows(), max(1, n_prompts))
        key = (rows, row_len)
        if key not in self._generators:
            self._generators.clear()  # one KV cache at a time
            self._generators[key] = Generator(self.model, max_batch=rows, max_seq_len=row_len)
        return self._generators[key]

    def _generate(self, gen, prompts, encoded, max_new: int, show: bool):
        torch.manual_seed(self.a.seed)  # the same draws on every rank, warm-up or not
        streams = [TextStream(self.tokenizer, ids, self.a.stop) for ids in encoded]
        stops = tuple(self.tokenizer.stop_ids)  # Llama-3: end_of_text, eom and eot
        requests = [s.request(max_new, self.a.sampling, stops) for s in streams]
        shown = prompts  # chat: the reply alone after a typed line, under its prompt for a batch
        if self.chat:
            typed = getattr(self.a, "interactive", False)
            shown = ["" if typed else p + "\n" for p in prompts]
        printer = OrderedPrinter(shown, enabled=show and self.leader)
        results, timing = generate_streaming(gen, streams, requests, printer.write)
        return results, streams, timing

    def timing_line(self, t: StreamTiming, n_prompts: int, warmup: int) -> str:
        ttft = "n/a" if math.isnan(t.first_token_s) else f"{t.first_token_s * 1e3:.0f} ms"
        tp = f", tp={self.parallel.tp_size}" if self.parallel.tp_size > 1 else ""
        return (
            f"[{n_prompts} prompt(s), {t.prompt_tokens} prompt tokens] {t.generated_tokens} "
            f"tokens in {t.total_s:.2f} s: {t.tokens_per_s:.1f} tokens/s, time to first token "
            f"{ttft} ({dtype_name(self.model.dtype)}, {self.model.device}{tp}"
            f"{', after warm-up' if warmup else ''})"
        )

    def _read_line(self) -> str | None:
        line = None
        if self.leader:
            if sys.stdin.isatty():
                print("> ", end="", file=sys.stderr, flush=True)
            raw = sys.stdin.readline()
            line = raw.rstrip("\n") if raw else None
        if is_distributed():
            line = gather_objects(line)[0]
        return line
