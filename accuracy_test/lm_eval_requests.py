"""lm-eval's ``loglikelihood`` request tokenization, each distinct string encoded once.

lm-eval's ``TemplateLM.loglikelihood`` (with ``_encode_pair``, causal backend) turns every
``(context, continuation)`` into tokens by encoding two strings, one call each:
``context + continuation`` and ``context``. A multiple-choice task repeats each context once
per choice (MMLU 5-shot: 4 x ~600-token contexts per question), so on an H200 that loop was 3 s
of a 15 s scoring phase. ``tokenize_requests`` gives the same pairs, token for token, from one
batched, multi-threaded encode of the distinct strings. The rules it reproduces:

- trailing whitespace of the context (``str.rstrip``) moves to the front of the continuation;
- ``context_enc = encode(context)``, ``continuation_enc = encode(context + continuation)``
  from ``len(context_enc)`` on (both encoded with BOS);
- an empty context: the continuation encoded without BOS, conditioned on ``prefix_token_id``,
  or on its own first token when that token is ``prefix_token_id`` (an empty continuation
  then raises ``IndexError``, as in lm-eval).

``tests/test_lm_eval_requests.py`` checks the pairs against lm-eval's own method.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tqdm.auto import tqdm

__all__ = ["tokenize_requests"]

# strings per encode call: large enough to keep every thread busy, small enough for a live bar
CHUNK = 4096

EncodeMany = Callable[[list[str], bool], list[list[int]]]


def _encode_all(
    with_bos: dict[str, None], bare: dict[str, None], encode_many: EncodeMany, progress: bool
) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Distinct strings -> tokens, ``encode_many(strings, bos)`` over chunks of ``CHUNK``."""
    bar = tqdm(total=len(with_bos) + len(bare), desc="Tokenizing inputs", disable=not progress)
    out: tuple[dict[str, list[int]], dict[str, list[int]]] = ({}, {})
    for table, strings, bos in ((out[0], list(with_bos), True), (out[1], list(bare), False)):
        for start in range(0, len(strings), CHUNK):
            chunk = strings[start : start + CHUNK]
            table.update(zip(chunk, encode_many(chunk, bos)))
            bar.update(len(chunk))
    bar.close()
    return out


def tokenize_requests(
    args: Sequence[tuple[str, str]],
    encode_many: EncodeMany,
    prefix_token_id: int,
    progress: bool = False,
) -> list[tuple[list[int], list[int]]]:
    """``(context_enc, continuation_enc)`` per ``(context, continuation)``, as lm-eval's causal
    ``TemplateLM.loglikelihood`` makes them; ``encode_many(strings, bos)`` must equal the
    model's ``tok_encode`` of each string (BOS when ``bos``). Requests sharing a context share
    its ``context_enc`` list: copy before mutating."""
    with_bos: dict[str, None] = {}  # ordered sets
    bare: dict[str, None] = {}
    for context, continuation in args:
        if context == "":
            bare[continuation] = None
        else:
            with_bos[context.rstrip()] = None
            with_bos[context + continuation] = None
    enc, enc_bare = _encode_all(with_bos, bare, encode_many, progress)
    pairs: list[tuple[list[int], list[int]]] = []
    for context, continuation in args:
        if context == "":
            cont = enc_bare[continuation]
            if prefix_token_id != cont[0]:
                pairs.append(([prefix_token_id], list(cont)))
            else:
                pairs.append((cont[:1], cont[1:]))
        else:
            ctx = enc[context.rstrip()]
            pairs.append((ctx, enc[context + continuation][len(ctx) :]))
    return pairs
