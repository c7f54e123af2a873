"""Scoring engine vs a brute-force lm-eval-style reference, on a tiny pure-PyTorch model.

The model here is independent of nakta_model's Transformer on purpose: the engine's packing
(tree mask, restarted positions, scored-position gather) is checked on its own, with a model
whose output depends on both positions (rotary) and attention, so a wrong mask or position
shows up. One test runs the real Nakta model when it is importable.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from nakta_model import score_batches, scoring
from nakta_model.kernels.packed_attention import packed_attention_mask


class TinyLM(torch.nn.Module):
    """Embedding -> one rotary attention layer -> MLP -> head; ``forward_packed`` like Nakta's."""

    def __init__(self, vocab: int = 37, dim: int = 16, max_seq_len: int = 64, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.vocab_size, self.max_seq_len, self.dim = vocab, max_seq_len, dim
        p = lambda *s: torch.nn.Parameter(torch.randn(*s, generator=g, dtype=torch.float64))
        self.emb = p(vocab, dim)
        self.wq, self.wk, self.wv = p(dim, dim) / dim**0.5, p(dim, dim) / dim**0.5, p(dim, dim)
        self.w1, self.w2 = p(dim, 2 * dim) / dim**0.5, p(2 * dim, dim) / (2 * dim) ** 0.5
        self.head = p(dim, vocab)
        self.calls: list[dict[str, int]] = []  # per forward: sequences, scored rows, longest

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        half = self.dim // 2
        freq = 1.0 / (100.0 ** (torch.arange(half, dtype=torch.float64) / half))
        ang = pos[..., None].double() * freq
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()], -1)

    def hidden(self, tokens, positions, mask):
        h = self.emb[tokens]
        q, k, v = (
            self._rope(h @ self.wq, positions),
            self._rope(h @ self.wk, positions),
            h @ self.wv,
        )
        s = q @ k.transpose(-1, -2) / math.sqrt(self.dim)
        if mask is None:
            L = tokens.shape[1]
            mask = torch.ones(L, L, dtype=torch.bool).tril()[None]
        s = s.masked_fill(~mask, float("-inf"))
        h = h + torch.softmax(s, -1) @ v
        return h + torch.tanh(h @ self.w1) @ self.w2

    def forward(self, tokens):  # plain: [b, s] -> [b, s, V]
        pos = torch.arange(tokens.shape[1])[None].expand_as(tokens)
        return self.hidden(tokens, pos, None) @ self.head

    def forward_packed(self, tokens, positions, seq_start, span_end, logits_index, upcast=True):
        real = seq_start[logits_index].unique()  # sequences with a scored token (not padding)
        lengths = [int((seq_start == s).sum()) for s in real.tolist()]
        self.calls.append(
            {"seqs": len(real), "scored": int(logits_index.numel()), "longest": max(lengths)}
        )
        mask = packed_attention_mask(seq_start, span_end)[None]
        h = self.hidden(tokens[None], positions[None], mask).reshape(-1, self.dim)
        return (h[logits_index] @ self.head).float()


def brute_force(model: TinyLM, requests, max_length: int):
    """lm-eval's HF loop, one request at a time, full log-softmax."""
    out = []
    for ctx, cont in requests:
        inp = (list(ctx) + list(cont))[-(max_length + 1) :][:-1]
        logp = torch.log_softmax(model(torch.tensor([inp]))[0], -1)
        sel = logp[len(inp) - len(cont) :]
        tgt = torch.tensor(cont)
        ll = sel.gather(1, tgt[:, None]).sum().item()
        out.append((ll, bool((sel.argmax(-1) == tgt).all())))
    return out


def make_requests(rng: random.Random, n_ctx: int, vocab: int, n_choices=(1, 4), cont=(1, 9)):
    reqs = []
    for _ in range(n_ctx):
        ctx = [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
        for _ in range(rng.randint(*n_choices)):
            reqs.append((ctx, [rng.randrange(vocab) for _ in range(rng.randint(*cont))]))
    rng.shuffle(reqs)
    return reqs


def assert_close(got, want, tol=1e-4):
    assert len(got) == len(want)
    for (g, gg), (w, wg) in zip(got, want):
        assert abs(g - w) <= tol * max(1.0, abs(w)), (g, w)
        assert gg == wg


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("budget", [40, 4096])
def test_matches_brute_force(use_cache, budget):
    model = TinyLM()
    reqs = make_requests(random.Random(1), 12, model.vocab_size)
    want = brute_force(model, reqs, model.max_seq_len)
    got = scoring.score(model, reqs, use_cache=use_cache, token_budget=budget)
    assert_close(got, want)


def test_cache_packs_contexts_once_and_scores_fewer_positions():
    model = TinyLM()
    reqs = make_requests(random.Random(2), 10, model.vocab_size, n_choices=(4, 4))
    on = scoring.score(model, reqs, use_cache=True, token_budget=10**6)
    rows_on, scored_on = model.calls[0]["seqs"], model.calls[0]["scored"]
    model.calls.clear()
    off = scoring.score(model, reqs, use_cache=False, token_budget=10**6)
    rows_off, scored_off = model.calls[0]["seqs"], model.calls[0]["scored"]
    assert_close(on, off)
    assert (rows_on, rows_off) == (10, 40)  # one row per context vs one per request
    # the shared last-context position is scored once per context, not once per request, and
    # a continuation token once per distinct beginning (cont[:k]) among its context's
    assert scored_off == sum(len(x) for _, x in reqs)
    beginnings = {(tuple(c), tuple(x[:k])) for c, x in reqs for k in range(1, len(x))}
    assert scored_on == 10 + len(beginnings) < scored_off - 30


def test_greedy_flag_true_for_argmax_continuation():
    model = TinyLM()
    ctx = [3, 5, 7]
    cont = []
    for _ in range(4):  # greedy-decode 4 tokens with the plain forward
        logits = model(torch.tensor([ctx + cont]))[0, -1]
        cont.append(int(logits.argmax()))
    other = cont[:-1] + [(cont[-1] + 1) % model.vocab_size]
    for use_cache in (True, False):
        (ll_g, g), (ll_o, o) = scoring.score(
            model, [(ctx, cont), (ctx, other)], use_cache=use_cache
        )
        assert g is True and o is False
        assert ll_g > ll_o


def test_left_truncation_like_lm_eval():
    model = TinyLM(max_seq_len=64)
    rng = random.Random(3)
    ctx = [rng.randrange(37) for _ in range(30)]
    reqs = [(ctx, [rng.randrange(37) for _ in range(n)]) for n in (1, 5, 12)]
    reqs.append(([1, 2], [rng.randrange(37) for _ in range(16)]))  # cont == max_length
    L = 16
    want = brute_force(model, reqs, L)
    for use_cache in (True, False):
        assert_close(scoring.score(model, reqs, use_cache=use_cache, max_length=L), want)
    assert_close(scoring.score_with_forward(model, reqs, max_length=L), want)
    # truncation really happened: the full-context score differs
    full = brute_force(model, reqs[:1], 64)
    assert abs(full[0][0] - want[0][0]) > 1e-6


def test_packed_rows_respect_max_length():
    model = TinyLM(max_seq_len=64)
    ctx = list(range(10))
    reqs = [(ctx, [(i + j) % 37 for j in range(8)]) for i in range(12)]  # 10 + 12*7 > 20
    want = brute_force(model, reqs, 20)
    got = scoring.score(model, reqs, use_cache=True, max_length=20)
    assert_close(got, want)
    assert max(c["longest"] for c in model.calls) <= 20


def test_duplicates_and_single_token_continuations():
    model = TinyLM()
    reqs = [([4, 4, 2], [9]), ([4, 4, 2], [9]), ([4, 4, 2], [1]), ([4, 4, 2], [9, 9, 9])]
    want = brute_force(model, reqs, 64)
    assert_close(scoring.score(model, reqs), want)
    assert_close(scoring.score(model, reqs, use_cache=False), want)


def test_score_with_forward_matches_and_batches():
    model = TinyLM()
    reqs = make_requests(random.Random(4), 8, model.vocab_size)
    want = brute_force(model, reqs, model.max_seq_len)
    for bs in (1, 3, None):
        got = scoring.score_with_forward(model, reqs, max_length=64, batch_size=bs)
        assert_close(got, want)


def test_packed_layout_and_its_mask():
    """One batch of two rows: positions count depth, the scored positions and targets line
    up, padding is a sequence of its own, and the mask keeps rows and branches apart."""
    rows = [
        score_batches.Row([5, 6], [(0, [7, 8]), (1, [9])]),
        score_batches.Row([4], [(2, [3, 2])]),
    ]
    b = score_batches.pack(rows)
    n = b.n_real
    assert b.tokens[:n].tolist() == [5, 6, 7, 4, 3]  # ctx, cont0[:-1], cont1[:-1] (empty)
    assert b.positions[:n].tolist() == [0, 1, 2, 0, 1]
    assert b.seq_start[:n].tolist() == [0, 0, 0, 3, 3]
    assert b.span_end[:n].tolist() == [3, 3, 3, 5, 5]
    assert b.tokens.shape[0] == score_batches.PAD_MULTIPLE
    assert b.seq_start[n:].tolist() == list(range(n, score_batches.PAD_MULTIPLE))  # pads: alone
    assert b.flat_index.tolist() == [1, 2, 3, 4]
    # targets 7, 8 | 9 | 3, 2 predicted from flat rows 0, 1 | 0 | 2, 3
    assert b.target.tolist() == [7, 8, 9, 3, 2]
    assert b.src.tolist() == [0, 1, 0, 2, 3]
    assert b.req.tolist() == [0, 0, 1, 2, 2]
    assert b.span_end[n:].tolist() == list(range(n + 1, score_batches.PAD_MULTIPLE + 1))
    m = packed_attention_mask(
        torch.tensor([0, 0, 0, 0, 4, 4, 6]), torch.tensor([4, 4, 3, 4, 6, 6, 7])
    )
    assert m.dtype == torch.bool and m.shape == (7, 7)
    assert m[2].tolist() == [True, True, True, False, False, False, False]  # ctx + own branch
    assert m[3].tolist() == [True, True, False, True, False, False, False]  # skips branch 1
    assert m[5].tolist() == [False] * 4 + [True, True, False]  # its own row only
    assert m[6].tolist() == [False] * 6 + [True]  # a pad sees itself only
    assert not m[0, 1]  # causal within the context


def test_continuations_that_begin_alike_share_their_tokens():
    """A row's sequences form a trie: the shared first tokens are one node each, every
    continuation's targets are predicted from its own path, in request order."""
    row = score_batches.Row([5], [(0, [7, 8, 1]), (1, [4]), (2, [7, 9]), (3, [7, 8, 2])])
    assert len(row) == 3 and row.trie.paths == [[0, 1, 2], [0], [0, 1], [0, 1, 2]]
    b = score_batches.pack([row])
    n = b.n_real
    assert b.tokens[:n].tolist() == [5, 7, 8] and b.positions[:n].tolist() == [0, 1, 2]
    assert b.span_end[:n].tolist() == [3, 3, 3] and b.flat_index.tolist() == [0, 1, 2]
    assert b.target.tolist() == [7, 8, 1, 4, 7, 9, 7, 8, 2]
    assert b.src.tolist() == [0, 1, 2, 0, 0, 1, 0, 1, 2]
    assert b.req.tolist() == [0, 0, 0, 1, 2, 2, 3, 3, 3]
    rng = random.Random(8)  # a row's length, counted without its trie, is the trie's
    for _ in range(50):
        conts = [[rng.randrange(3, 6) for _ in range(rng.randint(1, 5))] for _ in range(4)]
        r = score_batches.Row([1, 2], [(i, c) for i, c in enumerate(conts)])
        assert len(r) == len(r.trie.tokens)
    # two subtrees: [7, 8, x] and [6, 3]: 7's span ends before 6's
    t = score_batches.sequence_trie([[7, 8, 1], [6, 3, 0], [7, 2]])
    assert t.tokens == [6, 3, 0, 7, 2, 8, 1] and t.depth == [0, 1, 2, 0, 1, 1, 2]
    assert t.end == [3, 3, 3, 7, 5, 7, 7] and t.paths == [[3, 5, 6], [0, 1, 2], [3, 4]]


def test_rows_whose_contexts_begin_alike_are_merged_into_one_tree():
    """HellaSwag tasks of one video share their first sentence: one tree computes it once;
    a context that is a prefix of another is scored from its own last node; rows with a
    cached prefix, rows sharing too little and trees over the caps stay apart."""
    a = score_batches.Row([1, 2, 3, 4, 5, 6], [(0, [7, 8])])
    b = score_batches.Row([1, 2, 3, 4, 9], [(1, [5, 6, 7])])
    c = score_batches.Row([1, 2, 3, 4], [(2, [5])])  # a prefix of both
    d = score_batches.Row([1, 2, 8, 8], [(3, [1])])  # shares 2 tokens only
    e = score_batches.Row([1, 2, 3, 4, 5, 7], [(4, [2])], prefix=4)  # cached prefix
    merged = score_batches.merge_rows([a, b, c, d, e], max_tokens=64, min_shared=4)
    trees = sorted(merged, key=lambda r: -len(r.merged))
    assert [len(r.merged) for r in trees] == [2, 0, 0]
    tree = trees[0]
    assert {tuple(r.ctx) for r in (tree, *tree.merged)} == {(1, 2, 3, 4), (1, 2, 3, 4, 5, 6),
                                                           (1, 2, 3, 4, 9)}  # fmt: skip
    assert len(tree) == 4 + 3 + 3  # 1 2 3 4 | 5 6 7 | 9 5 6
    p = score_batches.pack([tree])
    want = {0: [7, 8], 1: [5, 6, 7], 2: [5]}
    for i, cont in want.items():
        sel = p.req == i
        assert p.target[sel].tolist() == cont
        # each target is predicted from the node holding the token before it
        before = ([1, 2, 3, 4, 5, 6] + cont, [1, 2, 3, 4, 9] + cont, [1, 2, 3, 4] + cont)[i]
        rows = p.flat_index[p.src[sel]]
        assert p.tokens[rows].tolist() == before[-len(cont) - 1 : -1]
    capped = score_batches.merge_rows([a, b, c], max_tokens=8, min_shared=4)  # 10 > 8 tokens
    assert sorted(len(r) for r in capped) == [7, 7] and max(len(r) for r in capped) <= 8
    assert all(not r.merged for r in score_batches.merge_rows([a, b, c], 6, 4))
    assert all(not r.merged for r in score_batches.merge_rows([a, b], 64, 5))
    assert max(len(r.merged) for r in score_batches.merge_rows([a, b, c], 64, 4, 2)) == 1


def test_the_engine_computes_each_token_of_the_requests_trie_once():
    """Endings that begin alike (HellaSwag's "the man ..." / "the woman ...") cost their
    shared tokens once: computed tokens equal the unique ones, scores equal the plain path."""
    model = TinyLM()
    rng = random.Random(3)
    reqs = []
    video = [rng.randrange(3, model.vocab_size) for _ in range(6)]  # contexts begin alike
    for k in range(6):
        ctx = [3 + k] + [rng.randrange(3, model.vocab_size) for _ in range(rng.randint(3, 9))]
        ctx = video + ctx if k % 2 else ctx  # the others share nothing (3 + k first)
        stem = [rng.randrange(3, model.vocab_size) for _ in range(rng.randint(1, 4))]
        for _ in range(4):
            tail = [rng.randrange(3, model.vocab_size) for _ in range(rng.randint(1, 5))]
            reqs.append((ctx, stem + tail))
    stats = scoring.ScoreStats()
    on = scoring.score(model, reqs, use_cache=True, stats=stats)
    assert_close(on, scoring.score(model, reqs, use_cache=False), tol=1e-4)
    assert_close(on, brute_force(model, reqs, model.max_seq_len), tol=1e-4)
    assert stats.computed_tokens == stats.unique_tokens < stats.request_tokens
    assert model.calls[0]["seqs"] < 6  # the contexts of one video in one tree


def test_packed_batches_fill_the_budget_best_fit():
    lens = [9, 7, 6, 5, 4, 3, 2, 2, 1, 1]
    rows = [score_batches.Row(list(range(n)), [(i, [1])]) for i, n in enumerate(lens)]
    batches = score_batches.packed_batches(rows, token_budget=10, max_rows=None)
    sizes = sorted(sum(len(r) for r in b) for b in batches)
    assert sum(sizes) == sum(lens) and max(sizes) <= 10
    assert len(batches) == 4  # 40 tokens in bins of 10: best fit leaves no gap
    capped = score_batches.packed_batches(rows, token_budget=10, max_rows=2)
    assert max(len(b) for b in capped) == 2
    big = score_batches.packed_batches([score_batches.Row(list(range(30)), [(0, [1])])], 10, None)
    assert [len(b) for b in big] == [1]  # a row over the budget runs alone


@pytest.mark.parametrize(
    "reqs, exc, msg",
    [
        ([([1, 2], [])], ValueError, "empty continuation"),
        ([([], [3])], ValueError, "empty context"),
        ([([1, 2], [37])], ValueError, "outside the vocabulary"),
        ([([1, -1], [3])], ValueError, "outside the vocabulary"),
        ([([1, 2], [3.0])], TypeError, "int token ids"),
        ([([1, 2], [3] * 65)], ValueError, "max_length"),
        ([([1, 2],)], TypeError, "pair"),
    ],
)
def test_bad_requests(reqs, exc, msg):
    with pytest.raises(exc, match=msg):
        scoring.score(TinyLM(), reqs)


def test_bad_arguments():
    with pytest.raises(ValueError, match="token_budget"):
        scoring.score(TinyLM(), [([1], [2])], token_budget=0)
    for bad in (0, -3):  # not silently replaced by the model's default
        with pytest.raises(ValueError, match="max_length must be a positive int"):
            scoring.score(TinyLM(), [([1], [2])], max_length=bad)
    with pytest.raises(TypeError, match="forward_packed"):
        scoring.score(object(), [([1], [2])])
    with pytest.raises(ValueError, match="vocabulary"):
        scoring.score_with_forward(TinyLM(), [([1], [40])], max_length=64)
    assert scoring.score(TinyLM(), []) == []


def test_real_nakta_model_cache_on_off():
    """The real Transformer's packed forward (tree rows) agrees with plain causal rows."""
    nakta_model = pytest.importorskip("nakta_model")
    if not hasattr(nakta_model, "random_model"):
        pytest.skip("nakta_model.random_model not available yet")
    from nakta_model.config import ModelArgs

    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=61, max_seq_len=64)
    model = nakta_model.random_model(args, torch.device("cpu"), torch.float32, seed=0)
    reqs = make_requests(random.Random(5), 3, 61, n_choices=(2, 4), cont=(1, 5))
    on = scoring.score(model, reqs, use_cache=True)
    off = scoring.score(model, reqs, use_cache=False)
    plain = scoring.score_with_forward(lambda t: model(t, 0), reqs, max_length=64)
    assert_close(on, off, tol=1e-4)
    assert_close(on, plain, tol=1e-4)
    model.setup_cache(1, 8)  # model.max_seq_len is now the cache length; args still rule
    assert_close(scoring.score(model, reqs), on, tol=1e-4)


def test_results_do_not_depend_on_request_order():
    """Canonical packing: a permutation of the requests gives bit-identical results."""
    model = TinyLM()
    reqs = make_requests(random.Random(6), 10, model.vocab_size)
    perm = list(range(len(reqs)))
    random.Random(7).shuffle(perm)
    shuffled = [reqs[i] for i in perm]
    for use_cache in (True, False):
        a = scoring.score(model, reqs, use_cache=use_cache, token_budget=60)
        b = scoring.score(model, shuffled, use_cache=use_cache, token_budget=60)
        assert [b[perm.index(i)] for i in range(len(reqs))] == a


def test_warm_up_scores_a_tiny_tree_batch():
    model = TinyLM()
    seconds = scoring.warm_up(model)
    assert seconds >= 0 and len(model.calls) == 1
    assert model.calls[0]["seqs"] == 2  # a shared-context row with two branches + a plain row
