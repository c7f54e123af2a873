"""Measure HellaSwag's token lengths under the LLaMA tokenizer, once, for the embedded workload.

The default speed benchmark must run anywhere, without the HellaSwag text or the LLaMA tokenizer.
What decides its cost is only how many tokens each task has: the context length and the four
ending lengths. This script tokenizes every validation task the way lm-eval does
(context = query with BOS, continuation = ``" " + ending``, continuation tokens =
``encode(context + continuation)[len(encode(context)):]``) and writes their histograms to
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
from pathlib import Path

from nakta_model.io_utils import atomic_write_text

HISTOGRAM_PATH = Path(__file__).resolve().parent / "hellaswag_lengths.json"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _query(row: dict) -> str:
    """lm-eval's query when the row has the original schema; the full file's ``ctx`` otherwise.

    The full validation file (``hellaswag_val_full.jsonl``) stores ``"<label>: <ctx>"`` already
    preprocessed but without lm-eval's capitalisation of ``ctx_b``; capitalising one letter
    changes a token length by at most one, which is noise for a length histogram.
    """
    if "ctx_a" in row:
        import re

        def pre(text: str) -> str:
            text = text.strip().replace(" [title]", ". ")
            text = re.sub(r"\[.*?\]", "", text)
            return text.replace("  ", " ")

        ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
        return pre(row["activity_label"] + ": " + ctx)
    return row["ctx"]


def measure(data: Path, tokenizer: Path) -> dict:
    """Histograms of context tokens (with BOS) and continuation tokens over every task."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
    rows = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines() if line]
    if not rows:
        raise ValueError(f"data: {data} holds no tasks")
    queries = [_query(r) for r in rows]
    ctx_ids = sp.encode(queries)
    wholes = sp.encode([q + " " + e for q, r in zip(queries, rows) for e in r["endings"]])
    ctx_hist: collections.Counter[int] = collections.Counter()
    cont_hist: collections.Counter[int] = collections.Counter()
    chars = tokens = 0
    for i, (row, ctx) in enumerate(zip(rows, ctx_ids)):
        ctx_hist[len(ctx) + 1] += 1  # + BOS
        for j, ending in enumerate(row["endings"]):
            n = len(wholes[4 * i + j]) - len(ctx)
            if n < 1:
                raise ValueError(f"task {i} ending {j} tokenizes to no continuation tokens")
            cont_hist[n] += 1
            chars += len(ending)
            tokens += n
    return {
        "what": "HellaSwag validation token lengths under the LLaMA tokenizer, lm-eval style",
        "source": data.name,
        "source_sha256": _sha256(data),
        "tokenizer_sha256": _sha256(tokenizer),
        "n_tasks": len(rows),
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
