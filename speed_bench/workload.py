"""The scoring workloads every engine runs: HellaSwag (real tasks, or an embedded synthetic copy)
and an embedded MMLU-shaped one (a long few-shot prefix shared by every question of a subject).

Real: ``--data FILE --tokenizer FILE`` builds exactly lm-eval's requests
(``nakta_model.tasks.hellaswag``). Embedded: no text and no tokenizer needed; random token ids
whose context and ending lengths are drawn (seeded) from HellaSwag's own length histogram under
the LLaMA tokenizer (``hellaswag_lengths.json``). Speed depends only on those lengths, so the
embedded workload costs what the real one costs. The histogram is measured once (only counts are
committed, never text) by tokenizing every validation task the way lm-eval does
(``nakta_model.tasks.hellaswag``: context = query with BOS, continuation = ``" " + ending``,
continuation tokens = ``encode(context + continuation)[len(encode(context)):]``)::

    python -m speed_bench.workload --data ../shared/data/hellaswag_val_full.jsonl \
        --tokenizer ../shared/data/llama_tokenizer.model

MMLU-shaped (``mmlu_shaped_workload``): random token ids with lm-eval's MMLU structure: per
subject a fixed 5-shot prefix (``sampler: first_n``), then each question with its options
(60-150 tokens) and ``Answer:``; the four continuations are one letter token each. What repeats
(the prefix, the question across its four letters) is what makes it expensive or cheap.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from nakta_model.io_utils import atomic_write_text
from nakta_model.scoring import unique_tokens
from nakta_model.tasks.hellaswag import Doc, build_requests, load_jsonl, sentencepiece_encoder

Request = tuple[list[int], list[int]]  # (context tokens with BOS, continuation tokens)


@dataclass
class Workload:
    """Docs (for the metrics) and their token requests, 4 consecutive requests per doc."""

    name: str
    docs: list[Doc]
    requests: list[Request]
    _unique: int | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        need = sum(len(d.choices) for d in self.docs)
        if need != len(self.requests):
            raise ValueError(f"requests has {len(self.requests)} entries, docs need {need}")
        for i, (ctx, cont) in enumerate(self.requests):
            if not ctx or not cont:
                raise ValueError(f"request {i} has an empty context or continuation")

    @property
    def n_tasks(self) -> int:
        return len(self.docs)

    def max_token_id(self) -> int:
        return max(max(max(c), max(x)) for c, x in self.requests)

    def max_length(self) -> int:
        """Longest model input, ``len(context + continuation) - 1``."""
        return max(len(c) + len(x) - 1 for c, x in self.requests)

    def request_tokens(self) -> int:
        """Tokens a plain scorer runs: ``len(context + continuation) - 1`` per request."""
        return sum(len(c) + len(x) - 1 for c, x in self.requests)

    def unique_tokens(self) -> int:
        """Tokens of the trie of every request's model input: each shared context (a task's, or
        a few-shot prefix shared by many tasks) counted once; what no engine can skip. Computed
        once (a sort of every request: run_all reports it per engine)."""
        if self._unique is None:
            self._unique = unique_tokens(self.requests)
        return self._unique

    def scored_tokens(self) -> int:
        """Positions whose next-token log-prob is summed (the continuation tokens)."""
        return sum(len(x) for _, x in self.requests)

    def spread(self, n: int) -> Workload:
        """``n`` tasks evenly spaced over this workload (a warm-up that meets every length)."""
        n = max(1, min(n, self.n_tasks))
        starts, i = [], 0
        for doc in self.docs:
            starts.append(i)
            i += len(doc.choices)
        pick = [t * self.n_tasks // n for t in range(n)]
        docs = [self.docs[t] for t in pick]
        requests = [
            r
            for t in pick
            for r in self.requests[starts[t] : starts[t] + len(self.docs[t].choices)]
        ]
        return Workload(f"{self.name}/spread{n}", docs, requests)


# ----------------------------------------------------------------------------- histogram
HISTOGRAM_PATH = Path(__file__).resolve().parent / "hellaswag_lengths.json"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def measure(data: Path, tokenizer: Path) -> dict:
    """Histograms of context tokens (with BOS) and continuation tokens over every task.

    Requests are built by ``nakta_model.tasks.hellaswag`` exactly as lm-eval builds them. For
    the full validation file (already preprocessed, ``ctx_b`` not capitalised) the lengths
    differ from lm-eval's by at most a token here and there: noise for a length histogram.
    """
    docs = load_jsonl(data)
    requests = build_requests(docs, sentencepiece_encoder(tokenizer))
    ctx_hist: collections.Counter[int] = collections.Counter()
    cont_hist: collections.Counter[int] = collections.Counter()
    chars = tokens = i = 0
    for doc in docs:
        ctx_hist[len(requests[i][0])] += 1
        for choice in doc.choices:
            n = len(requests[i][1])
            cont_hist[n] += 1
            chars += len(choice)
            tokens += n
            i += 1
    return {
        "what": "HellaSwag validation token lengths under the LLaMA tokenizer, lm-eval style",
        "source": data.name,
        "source_sha256": _sha256(data),
        "tokenizer_sha256": _sha256(tokenizer),
        "n_tasks": len(docs),
        "endings_per_task": 4,
        "context_tokens_with_bos": {str(k): v for k, v in sorted(ctx_hist.items())},
        "continuation_tokens": {str(k): v for k, v in sorted(cont_hist.items())},
        "chars_per_continuation_token": round(chars / tokens, 4),
    }


def load_histogram(path: str | Path = HISTOGRAM_PATH) -> dict:
    """The committed HellaSwag length histogram, checked for the fields the sampler needs."""
    hist = json.loads(Path(path).read_text())
    for key in ("context_tokens_with_bos", "continuation_tokens", "chars_per_continuation_token"):
        if key not in hist:
            raise ValueError(f"histogram {path} is missing {key!r}")
    for key in ("context_tokens_with_bos", "continuation_tokens"):
        counts = hist[key]
        if not counts or any(int(k) < 1 or v < 0 for k, v in counts.items()):
            raise ValueError(f"histogram {path} field {key!r} must map lengths >= 1 to counts")
    return hist


def _sampler(counts: dict[str, int], rng: random.Random):
    """Draw a length from the histogram, restricted to lengths <= ``at_most``."""
    table = sorted((int(k), v) for k, v in counts.items() if v > 0)
    lengths, weights = [n for n, _ in table], [c for _, c in table]

    def draw(at_most: int) -> int:
        if at_most >= lengths[-1]:
            return rng.choices(lengths, weights)[0]
        fit = [(n, c) for n, c in table if n <= at_most]
        return rng.choices([n for n, _ in fit], [c for _, c in fit])[0]

    return draw


FEWSHOT_SEPARATOR = 13  # one token between few-shot examples (lm-eval joins them with "\n\n")


def synthetic_workload(
    n_tasks: int,
    vocab_size: int,
    seed: int = 0,
    max_length: int | None = None,
    shots: int = 0,
) -> Workload:
    """``n_tasks`` random tasks with HellaSwag's token lengths (random labels and token ids).

    ``shots`` puts that many examples (a context and an ending from the same histograms, then
    a separator) before each task's context, drawn anew for every task as lm-eval's few-shot
    sampler does: HellaSwag 10-shot's ~1,000-token rows, which share nothing across tasks.
    ``max_length`` caps ``context + continuation`` (for tiny models with a short context window)
    by drawing from the histogram restricted to the lengths that fit (and dropping the shots
    that would not).
    """
    if not isinstance(shots, int) or shots < 0:
        raise ValueError(f"shots must be an int >= 0, got {shots!r}")
    if n_tasks < 1:
        raise ValueError(f"n_tasks must be >= 1, got {n_tasks}")
    if vocab_size < 4:
        raise ValueError(f"vocab_size must be >= 4, got {vocab_size}")
    hist = load_histogram()
    rng = random.Random(seed)
    ctx_len = _sampler(hist["context_tokens_with_bos"], rng)
    cont_len = _sampler(hist["continuation_tokens"], rng)
    chars_per_token = hist["chars_per_continuation_token"]
    limit = max_length if max_length is not None else 1 << 30
    shortest = min(int(k) for k in hist["continuation_tokens"])
    if min(int(k) for k in hist["context_tokens_with_bos"]) + shortest > limit:
        raise ValueError(f"max_length {max_length} is shorter than the shortest HellaSwag task")
    docs, requests = [], []
    longest = max(int(k) for k in hist["continuation_tokens"])
    sep = min(FEWSHOT_SEPARATOR, vocab_size - 1)
    for t in range(n_tasks):
        n_ctx = ctx_len(limit - shortest)
        ctx = [1] + [rng.randrange(3, vocab_size) for _ in range(n_ctx - 1)]  # BOS = 1
        for _ in range(shots):  # examples between BOS and the task's own context
            n = ctx_len(limit) - 1 + cont_len(limit)
            if len(ctx) + n + 1 + longest > limit:
                break
            shot = [rng.randrange(3, vocab_size) for _ in range(n)] + [sep]
            ctx[1:1] = shot
        choices = []
        for _ in range(4):
            n = cont_len(limit - len(ctx))
            requests.append((ctx, [rng.randrange(3, vocab_size) for _ in range(n)]))
            choices.append("x" * max(1, round(n * chars_per_token)))
        docs.append(Doc(query="", choices=tuple(choices), label=rng.randrange(4), ind=t))
    tag = f"-{shots}shot" if shots else ""
    return Workload(f"synthetic-hellaswag{tag}-{n_tasks}", docs, requests)


def real_workload(
    data: str | Path, tokenizer: str | Path, limit: int | None = None, select: str = "first"
) -> Workload:
    """lm-eval's HellaSwag requests from a local jsonl and the LLaMA sentencepiece model.

    ``select="first"`` takes the first ``limit`` tasks (lm-eval's ``--limit``); ``"spread"``
    takes ``limit`` tasks evenly spaced over the file. The validation file is ordered by source
    (ActivityNet first, then the ~2x longer WikiHow tasks), so only a spread sample has the
    whole file's length mix.
    """
    if select not in ("first", "spread"):
        raise ValueError(f"select must be 'first' or 'spread', got {select!r}")
    if select == "first" or limit is None:
        docs = load_jsonl(data, limit=limit)
    else:
        every = load_jsonl(data)
        n = min(limit, len(every))
        docs = [every[i * len(every) // n] for i in range(n)]
    requests = build_requests(docs, sentencepiece_encoder(tokenizer))
    tag = "" if select == "first" else "-spread"
    return Workload(f"{Path(data).stem}-{len(docs)}{tag}", docs, requests)


MMLU_SUBJECTS = 57
MMLU_SHOTS = 5


def mmlu_shaped_workload(
    n_tasks: int, vocab_size: int, seed: int = 0, max_length: int | None = None
) -> Workload:
    """``n_tasks`` MMLU-shaped questions over up to 57 subjects, at least 10 questions each
    (random ids, seeded).

    Per subject: BOS, a ~16-token header, 5 shots (question with options 60-150 tokens, then
    ``Answer: X`` and a blank line, 5 tokens); per question the shots, the question and
    ``Answer:`` (2 tokens) are the context, and the letters A-D (one token each) the four
    continuations, as lm-eval's ``mmlu`` builds them. ``max_length`` (a tiny model's window)
    scales every length down to fit.
    """
    if n_tasks < 1:
        raise ValueError(f"n_tasks must be >= 1, got {n_tasks}")
    if vocab_size < 16:
        raise ValueError(f"vocab_size must be >= 16, got {vocab_size}")
    rng = random.Random(seed)
    longest = 1 + 16 + MMLU_SHOTS * (150 + 5) + 150 + 2
    scale = min(1.0, (max_length or longest) / longest)

    def ids(n: int) -> list[int]:
        return [rng.randrange(16, vocab_size) for _ in range(max(1, round(n * scale)))]

    letters = [4, 5, 6, 7]  # four fixed token ids for " A" .. " D" (below the random range)
    n_subjects = min(MMLU_SUBJECTS, -(-n_tasks // 10))  # >= 10 questions a subject (MMLU: 100+)
    prefixes = []
    for _ in range(n_subjects):
        prefix = [1] + ids(16)
        for _ in range(MMLU_SHOTS):
            prefix += ids(rng.randint(60, 150)) + ids(2) + [rng.choice(letters)] + ids(2)
        prefixes.append(prefix)
    docs, requests = [], []
    for t in range(n_tasks):
        ctx = prefixes[t % n_subjects] + ids(rng.randint(60, 150)) + ids(2)
        requests += [(ctx, [letter]) for letter in letters]
        docs.append(Doc(query="", choices=("A", "B", "C", "D"), label=rng.randrange(4), ind=t))
    return Workload(f"synthetic-mmlu-{n_tasks}", docs, requests)


def main(argv: list[str] | None = None) -> None:
    """Measure the histogram (module docstring) into ``hellaswag_lengths.json``."""
    here = Path(__file__).resolve().parents[1]
    shared = here.parent / "shared" / "data"
    p = argparse.ArgumentParser(
        description="Measure HellaSwag's token lengths for the embedded workload"
    )
    p.add_argument("--data", type=Path, default=shared / "hellaswag_val_full.jsonl")
    p.add_argument("--tokenizer", type=Path, default=shared / "llama_tokenizer.model")
    p.add_argument("--out", type=Path, default=HISTOGRAM_PATH)
    args = p.parse_args(argv)
    hist = measure(args.data, args.tokenizer)
    atomic_write_text(args.out, json.dumps(hist, indent=1) + "\n")
    print(f"{hist['n_tasks']} tasks -> {args.out}")


if __name__ == "__main__":
    main()
