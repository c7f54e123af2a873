"""A tiny Mistral-shaped model (sliding window 5, sequences of 30-90 tokens) against transformers'
``MistralForCausalLM`` with eager attention, in fp32, on the same random weights.

Nakta reads the weights as an HF LLaMA folder (Mistral's tensors are LLaMA's) and runs with
``ModelArgs.sliding_window`` set. Checked: the dense forward with and without a KV cache; the
packed scoring path (context trees, through the Triton kernels in interpreter mode) and the
prefix-cache scoring path (a shared 70-token prefix, longer than the window, cached in pages)
against HF's log-likelihoods; prefill + decode through the generation engine (chunked prefill,
a held shared prefix read by the decode cascade) giving HF's greedy tokens (HF's own sliding-
window KV cache) for generations that run well past the window. Each check also confirms that
full attention gives a different answer, so the window is what is being compared.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

import nakta_model
from nakta_model import scoring
from nakta_model.model import Transformer

transformers = pytest.importorskip("transformers")

WINDOW = 5
SHAPE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
    rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
)  # fmt: skip
ATOL = 1e-4  # fp32 logits: the two implementations round differently (measured ~5e-6)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def write_hf_llama_folder(hf_model, out, shape: dict = SHAPE) -> None:
    """The Mistral model's tensors as an HF LLaMA folder (the same names and layout; Nakta's
    own reader for ``model_type: mistral`` comes with its config support)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in shape.items() if k != "head_dim"}
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu")
    (out / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(hf, nakta with kernels='triton', the same without the window)`` (the last one, only
    there to show the window matters, through the PyTorch references)."""
    no_special = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)  # no EOS stops
    cfg = transformers.MistralConfig(
        sliding_window=WINDOW, initializer_range=0.2, **no_special, **SHAPE
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(cfg).float().eval()
    assert hf.config.sliding_window == WINDOW
    folder = tmp_path_factory.mktemp("mistral") / "hf"
    write_hf_llama_folder(hf, folder)
    full = nakta_model.load(folder, "cpu", torch.float32, kernels="reference")
    windowed = Transformer(full.args.replace(sliding_window=WINDOW), kernels="triton")
    windowed.load_state_dict(full.state_dict())
    return hf, windowed, full


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def hf_loglikelihood(hf, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    logits = hf_logits(hf, context + continuation)[len(context) - 1 : -1]
    logp = logits.log_softmax(-1)
    target = torch.tensor(continuation)
    ll = logp.gather(1, target[:, None]).sum().item()
    return ll, bool((logp.argmax(-1) == target).all())


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """HF's greedy ``generate``: prefill, then a token at a time through its sliding-window
    KV cache."""
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    assert out.shape == (1, len(prompt) + n)
    return out[0, len(prompt) :].tolist()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, SHAPE["vocab_size"]) for _ in range(n)]


def test_dense_forward_with_and_without_a_cache(pair):
    hf, model, full = pair
    model.kernels = "reference"  # the dense path is PyTorch either way
    try:
        toks = torch.randint(0, SHAPE["vocab_size"], (2, 37))
        with torch.no_grad():
            want = hf(toks).logits
        torch.testing.assert_close(model(toks), want, rtol=0, atol=ATOL)
        assert (full(toks) - want).abs().max() > 100 * ATOL
        model.setup_cache(2, 64)
        first = model(toks[:, :20], 0)
        rest = model(toks[:, 20:], 20)  # 17 queries over 37 cached keys
        torch.testing.assert_close(torch.cat([first, rest], 1), want, rtol=0, atol=ATOL)
        step = model(toks[:, 36:], 36)  # one query: the decode shape
        torch.testing.assert_close(step[:, 0], want[:, 36], rtol=0, atol=ATOL)
    finally:
        model.clear_cache()
        model.kernels = "triton"


def test_packed_scoring_matches_hf_loglikelihoods(pair):
    """Contexts of 12-40 tokens with 1-4 continuations each (token trees in one stream)."""
    hf, model, full = pair
    rng = random.Random(1)
    requests = []
    for _ in range(4):
        ctx = tokens(rng, rng.randint(12, 40))
        for _ in range(rng.randint(1, 4)):
            requests.append((ctx, tokens(rng, rng.randint(1, 6))))
    got = scoring.score(model, requests, prefix_cache=False)
    for (ll, greedy), (c, x) in zip(got, requests):
        want_ll, want_greedy = hf_loglikelihood(hf, c, x)
        assert abs(ll - want_ll) < 1e-3 * max(1.0, abs(want_ll)), (ll, want_ll)
        assert greedy == want_greedy
    plain = scoring.score(full, requests, prefix_cache=False)
    assert max(abs(a[0] - b[0]) for a, b in zip(plain, got)) > 0.1


def test_prefix_cache_scoring_past_the_window(pair):
    """Six contexts sharing a 70-token prefix (longer than the window): the prefix is computed
    once into KV pages and the contexts' tokens read it by position; HF's log-likelihoods."""
    from nakta_model.prefix_cache import PrefixCache

    hf, model, _ = pair
    rng = random.Random(2)
    shared = tokens(rng, 70)
    requests = [(shared + tokens(rng, rng.randint(2, 9)), tokens(rng, rng.randint(1, 4)))
                for _ in range(6)]  # fmt: skip
    cache = PrefixCache(model, budget_tokens=256)
    stats = scoring.ScoreStats()
    got = scoring.score(model, requests, prefix_cache=cache, stats=stats)
    assert stats.prefixes == 1 and stats.prefix_tokens >= 64  # the cached-prefix path ran
    for (ll, greedy), (c, x) in zip(got, requests):
        want_ll, want_greedy = hf_loglikelihood(hf, c, x)
        assert abs(ll - want_ll) < 1e-3 * max(1.0, abs(want_ll)), (ll, want_ll)
        assert greedy == want_greedy
    cache.clear()


@pytest.mark.slow  # the whole engine through the Triton interpreter: about a minute of CPU
def test_generation_greedy_tokens_equal_hf_past_the_window(pair):
    """Prompts of 6 and 90 tokens and two sharing a 70-token prefix (held once, read by the
    decode cascade), prefilled in 32-token pieces, 14 greedy tokens each: HF's tokens."""
    from nakta_model.generation.engine import Generator
    from nakta_model.generation.requests import greedy_requests

    hf, model, full = pair
    rng = random.Random(3)
    shared = tokens(rng, 70)
    prompts = [tokens(rng, 6), tokens(rng, 90), shared + tokens(rng, 3), shared + tokens(rng, 5)]
    n = 14
    want = [hf_greedy(hf, p, n) for p in prompts]
    gen = Generator(model, max_batch=4, chunk=4, graph_mode="eager", prefill_chunk=32)
    got = [r.tokens for r in gen.generate(greedy_requests(prompts, n, None))]
    assert gen.stats.prefilled_tokens < gen.stats.prompt_tokens  # the shared prefix: once
    assert got == want
    plain = Generator(full, max_batch=4, chunk=4, graph_mode="eager", prefill_chunk=32)
    assert [r.tokens for r in plain.generate(greedy_requests(prompts, n, None))] != want


def test_model_args_sliding_window_field():
    """``sliding_window``: None (full attention) or a positive int, kept in params.json."""
    from nakta_model.config import ModelArgs

    args = ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=32)
    assert args.sliding_window is None
    windowed = args.replace(sliding_window=4096)
    assert ModelArgs.from_meta_params(windowed.to_params()).sliding_window == 4096
    for bad in (0, -1, 2.5, True, "4096"):
        with pytest.raises(ValueError, match="sliding_window must be a positive int"):
            args.replace(sliding_window=bad)


@pytest.mark.gpu
def test_gpu_mistral_heads_past_a_4096_window(tmp_path):
    """Two layers at Mistral-7B's attention shape (dim 4096, 32 q / 8 kv heads of 128, window
    4096) in fp32 on the GPU: a 5,000-token sequence scored through the packed kernel gives
    HF's log-likelihoods, and a 4,200-token prompt prefilled in 1,000-token pieces (each
    reading the earlier ones through its pages) and decoded through the engine (CUDA graphs,
    split-K decode attention over 64-key pages) gives HF's 24 greedy tokens."""
    from nakta_model.generation.engine import Generator
    from nakta_model.generation.requests import greedy_requests

    shape = dict(SHAPE, hidden_size=4096, intermediate_size=1024, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, vocab_size=1000,
                 max_position_embeddings=8192)  # fmt: skip
    cfg = transformers.MistralConfig(
        sliding_window=4096, initializer_range=0.05, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, **shape,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(cfg).float().eval()
    write_hf_llama_folder(hf, tmp_path / "hf", shape)
    hf = hf.cuda()
    base = nakta_model.load(tmp_path / "hf", "cuda", torch.float32)
    model = Transformer(base.args.replace(sliding_window=4096)).cuda()
    model.load_state_dict(base.state_dict())
    del base
    rng = random.Random(0)
    ctx, cont = tokens(rng, 4990), tokens(rng, 10)
    with torch.no_grad():
        logp = hf(torch.tensor([ctx + cont], device="cuda")).logits[0, 4989:-1].log_softmax(-1)
    want = logp.gather(1, torch.tensor(cont, device="cuda")[:, None]).sum().item()
    ((ll, _),) = scoring.score(model, [(ctx, cont)], prefix_cache=False)
    assert abs(ll - want) < 1e-3 * max(1.0, abs(want)), (ll, want)

    prompt = tokens(rng, 4200)
    out = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=24, do_sample=False)
    gen = Generator(model, max_batch=1, max_seq_len=4300, chunk=8, prefill_chunk=1000)
    got = gen.generate(greedy_requests([prompt], 24, None))[0].tokens
    assert got == out[0, len(prompt) :].tolist()
