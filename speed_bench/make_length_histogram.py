"""Measure HellaSwag's token lengths under the LLaMA tokenizer, once, for the embedded workload.

The default speed benchmark must run anywhere, without the HellaSwag text or the LLaMA tokenizer.
What decides its cost is only how many tokens each task has: the context length and the four
ending lengths. This script tokenizes every validation task the way lm-eval does
(``nakta_model.tasks.hellaswag``: context = query with BOS, continuation = ``" " + ending``,
continuation tokens = ``encode(context + continuation)[len(encode(context)):]``) and writes their histograms to
``hellaswag_lengths.json`` beside it. Only counts are committed, never text.

    python -m speed_bench.make_length_histogram \
        --data ../shared/data/hellaswag_val_full.jsonl \
        --tokenizer ../shared/data/llama_tokenizer.model
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import sys
from pathlib import Path

if not __package__:  # run by path: import from the repo root, not from this script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from nakta_model.io_utils import atomic_write_text
from nakta_model.tasks.hellaswag import build_requests, load_jsonl, sentencepiece_encoder

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


def main(argv: list[str] | None = None) -> None:
    here = Path(__file__).resolve().parents[1]
    shared = here.parent / "shared" / "data"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=shared / "hellaswag_val_full.jsonl")
    p.add_argument("--tokenizer", type=Path, default=shared / "llama_tokenizer.model")
    p.add_argument("--out", type=Path, default=HISTOGRAM_PATH)
    args = p.parse_args(argv)
    hist = measure(args.data, args.tokenizer)
    atomic_write_text(args.out, json.dumps(hist, indent=1) + "\n")
    print(f"{hist['n_tasks']} tasks -> {args.out}")


if __name__ == "__main__":
    main()
