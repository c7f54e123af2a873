"""The adapters' ``loglikelihood`` tokenization (``accuracy_test.lm_eval_requests``) against
lm-eval's own ``TemplateLM.loglikelihood``: the same ``((context, continuation), context_enc,
continuation_enc)`` list reaches ``_loglikelihood_tokens``, token for token, with each distinct
string encoded once. If lm-eval changes its rule, these tests fail. No model is loaded.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from checkpoint_factory import train_tiny_tokenizer  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.model import TemplateLM  # noqa: E402

from accuracy_test.lm_eval_base import ScoringLM  # noqa: E402
from nakta_model import Tokenizer  # noqa: E402

VOCAB = (  # plain words, unicode (CJK, emoji, combining accent), digits, punctuation
    "the cat sat on a mat . Question : Answer which of following is true ? "
    "café naïve 中文 日本語 🙂 Ωmega ĳ x\u0301 1984 3.14 -- ( ) , ; 'quoted' \"dq\""
)
WORDS = VOCAB.split()
# str.rstrip strips all of these: lm-eval moves them to the continuation
TRAILING = (" ", "  ", "\n", " \n", "\t", "\n\n", "\u00a0", "\u3000", " \u2003")
CONT_HEADS = ("", " ", "  ", "\n", " \n", "\t")


class _Capture(ScoringLM):
    """The shared adapter class, with the scorer replaced by a recorder of its input."""

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw):
        self.captured = requests
        return [(0.0, False)] * len(requests)


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _requests(seed: int = 0) -> list[tuple[str, str]]:
    """~400 MMLU-like requests: 4 choices per context, few-shot prefixes shared by subject,
    trailing whitespace, empty and whitespace-only contexts, unicode, duplicates."""
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    for subject in range(4):
        shots = "".join(f"{_sentence(rng, 12)}\nAnswer: {rng.choice('ABCD')}\n\n" for _ in range(5))
        prefix = f"Subject {subject} 🙂\n\n{shots}"
        for _ in range(20):
            ctx = prefix + _sentence(rng, rng.randint(0, 15)) + "\nAnswer:"
            if rng.random() < 0.4:
                ctx += rng.choice(TRAILING)
            for choice in "ABCD":
                out.append((ctx, rng.choice(CONT_HEADS) + choice))
    for _ in range(60):  # free-form continuations, some with whitespace inside and at the end
        ctx = _sentence(rng, rng.randint(1, 8)) + rng.choice(("",) + TRAILING)
        out.append((ctx, rng.choice(CONT_HEADS) + _sentence(rng, rng.randint(1, 4))))
    for cont in (" the cat", "the cat", "\nnew line", " 🙂", "中文", "  two spaces"):
        out.append(("", cont))  # empty context: conditioned on BOS
    out += [(" ", " sat"), ("\n\n", "A"), ("\u3000", " x")]  # whitespace-only contexts
    out += [("a cat", " sat"), ("a cat sat ", "on"), ("a cat sat", " on")]  # shared strings
    out += out[:8] + [out[-1]]  # exact duplicates
    return out


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory) -> Path:
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tok_requests"))


@pytest.fixture(params=["tiny", "llama"])
def tokenizer_file(request, tiny_tokenizer) -> Path:
    if request.param == "tiny":
        return tiny_tokenizer
    path = request.getfixturevalue("shared_data") / "llama_tokenizer.model"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    return path


def _both_ways(lm: _Capture, args: list[tuple[str, str]]) -> tuple[list, list]:
    """(lm-eval's ``TemplateLM.loglikelihood`` input to the scorer, the adapter's)."""
    insts = [Instance("loglikelihood", {}, a, i) for i, a in enumerate(args)]
    TemplateLM.loglikelihood(lm, insts, disable_tqdm=True)
    ref = lm.captured
    lm.loglikelihood(insts, disable_tqdm=True)
    return ref, lm.captured


def test_pairs_equal_lm_evals_with_each_distinct_string_encoded_once(tokenizer_file, monkeypatch):
    lm = _Capture(str(tokenizer_file), device="cpu")
    args = _requests()
    assert len(args) > 300
    batches: list[tuple[list[str], bool]] = []
    real = lm.tok.encode_many
    ref, _ = _both_ways(lm, args)

    def recording(strings, bos, eos, num_threads=-1):
        batches.append((list(strings), bos))
        return real(strings, bos, eos, num_threads)

    def one_at_a_time(*a, **kw):
        raise AssertionError("the adapter encoded one string at a time")

    monkeypatch.setattr(lm.tok, "encode_many", recording)
    monkeypatch.setattr(lm.tok, "encode", one_at_a_time)
    lm.loglikelihood([Instance("loglikelihood", {}, a, i) for i, a in enumerate(args)], True)
    got = lm.captured
    assert got == ref  # keys, context tokens and continuation tokens
    assert all(len(c) > 0 for _, _, c in got)
    with_bos = [s for strings, bos in batches if bos for s in strings]
    bare = [s for strings, bos in batches if not bos for s in strings]
    assert (
        len(with_bos)
        == len(set(with_bos))
        == len({c.rstrip() for c, _ in args if c} | {c + x for c, x in args if c})
    )
    assert sorted(bare) == sorted({x for c, x in args if c == ""})
    # the 4 choices of a context share one context encoding; lm-eval's lists are separate
    assert got[0][1] is got[1][1] and ref[0][1] is not ref[1][1]


def test_pairs_equal_lm_evals_across_encode_chunks(tiny_tokenizer, monkeypatch):
    from accuracy_test import lm_eval_requests

    monkeypatch.setattr(lm_eval_requests, "CHUNK", 7)
    lm = _Capture(str(tiny_tokenizer), device="cpu")
    ref, got = _both_ways(lm, _requests(seed=1))
    assert got == ref


class _CharTok:
    """One token per character, ``§`` encoded as BOS: the empty-context rule's other branch
    (a continuation whose first token is the prefix token) that real text never reaches."""

    bos_id, eos_id = 1, 2

    def encode(self, s: str, bos: bool, eos: bool) -> list[int]:
        ids = [1 if ch == "§" else 3 + ord(ch) % 97 for ch in s]
        return [1] * bos + ids + [2] * eos

    def encode_many(self, strings, bos: bool, eos: bool, num_threads: int = -1):
        return [self.encode(s, bos, eos) for s in strings]


def test_empty_context_rules_equal_lm_evals(tiny_tokenizer):
    lm = _Capture(str(tiny_tokenizer), device="cpu")
    lm.tok = _CharTok()
    args = [("", "§abc"), ("", "§"), ("", "xyz"), ("", " §"), ("ab ", " c"), ("ab", "§")]
    ref, got = _both_ways(lm, args)
    assert got == ref
    assert got[0][1:] == ([1], [3 + ord(ch) % 97 for ch in "abc"])
    for bad in ([("", "")], [("ok", " fine"), ("", "")]):  # lm-eval: IndexError
        with pytest.raises(IndexError):
            _both_ways(lm, bad)


@pytest.mark.parametrize(
    ("bos", "eos"), [(True, False), (False, False), (True, True), (False, True)]
)
def test_encode_many_equals_encode(tiny_tokenizer, bos, eos):
    tok = Tokenizer(tiny_tokenizer)
    strings = ["", " ", "the cat sat", " the cat", "\n中文 🙂", "a" * 500] + _sentence(
        random.Random(2), 200
    ).split(". ")
    assert tok.encode_many(strings, bos, eos) == [tok.encode(s, bos, eos) for s in strings]
    assert tok.encode_many(tuple(strings), bos, eos, num_threads=1) == tok.encode_many(
        strings, bos, eos
    )
    assert tok.encode_many([], bos, eos) == []
    with pytest.raises(TypeError, match="str only, got bytes"):
        tok.encode_many(["ok", b"bytes"], bos, eos)
