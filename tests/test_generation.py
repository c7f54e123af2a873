"""generate(): the real stories260K greedy reference, batching/padding, EOS, sampling, errors.

Here too: stop strings cut a continuation exactly where lm-eval's post-hoc split would.
"""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_factory import TINY_PARAMS, meta_state_dict, train_tiny_tokenizer

import convert
import nakta_model
from nakta_model.config import ModelArgs
from nakta_model.generation import StopStrings, generate_tokens
from nakta_model.sources import state_dict_source


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    from conftest import SHARED_DATA

    if not (SHARED_DATA / "stories260K").is_dir():
        pytest.skip("shared data not found")
    out = tmp_path_factory.mktemp("stories") / "nakta"
    convert.convert(SHARED_DATA / "stories260K", out, quiet=True)
    reference = json.loads((SHARED_DATA / "stories260K_greedy_reference.json").read_text())
    return out, reference


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_stories260k_reproduces_the_greedy_reference(stories, kernels):
    path, ref = stories
    model = nakta_model.load(path, "cpu", torch.float32, kernels=kernels)
    logits = model(torch.tensor([[1]]))[0, 0]
    top = logits.topk(5)
    assert top.indices.tolist() == [i for i, _ in ref["pos0_logits_top5"]]
    torch.testing.assert_close(
        top.values, torch.tensor([v for _, v in ref["pos0_logits_top5"]]), atol=1e-3, rtol=0
    )
    assert abs(logits.sum().item() - ref["pos0_logits_sum"]) < 1e-2
    if kernels == "triton":  # the interpreter is slow: one teacher-forced pass over 64 tokens
        seq = torch.tensor([ref["tokens"][:64]])
        assert model(seq)[0].argmax(-1).tolist() == ref["tokens"][1:65]
        return
    out = generate_tokens(model, [[1]], len(ref["tokens"]) - 1, eos_id=2, max_seq_len=512)
    assert out[0] == ref["tokens"]


@pytest.mark.usefixtures("one_torch_thread")
def test_stories260k_text_through_the_tokenizer(stories):
    path, ref = stories
    model = nakta_model.load(path, "cpu", torch.float32, kernels="reference")
    tok = nakta_model.Tokenizer(path / "tokenizer.model")
    assert (
        tok.encode("Once upon a time, there was a little girl named Lily.", bos=True, eos=False)
        == ref["tokens"][:16]
    )
    text = nakta_model.generate(model, tok, [""], max_gen_len=len(ref["tokens"]) - 1)
    assert text == [ref["text"]]
    # prompt included in the output (LLaMA-1), and the cache is released afterwards
    out = nakta_model.generate(model, tok, ["Once upon a time", "Lily"], max_gen_len=12)
    assert out[0].startswith("Once upon a time, there was a little girl named Lily")
    assert out[1].startswith("Lily")
    assert model.max_seq_len == 0


@pytest.fixture(scope="module")
def tiny():
    args = ModelArgs.from_meta_params(TINY_PARAMS, max_seq_len=48)
    source = state_dict_source(meta_state_dict(TINY_PARAMS, seed=11), args)
    return nakta_model.load(source, "cpu", torch.float32, kernels="reference")


def argmax_continuation(model, prompt, n):
    """Greedy without any cache: a full forward per new token."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq


@pytest.mark.usefixtures("one_torch_thread")
def test_batched_prompts_of_different_lengths_match_one_by_one(tiny):
    prompts = [[1, 5, 9, 200, 7], [1, 44], [1, 8, 8, 8, 120, 33, 2 + 3, 17]]
    out = generate_tokens(tiny, prompts, 9, eos_id=-5)
    for p, o in zip(prompts, out):
        assert o == argmax_continuation(tiny, p, 9)
    # total length is capped at max_seq_len, as Meta does
    capped = generate_tokens(tiny, prompts, 100, eos_id=-5)
    assert [len(o) for o in capped] == [48, 48, 48]
    assert [o[: len(p) + 9] for o, p in zip(capped, prompts)] == out


@pytest.mark.usefixtures("one_torch_thread")
def test_output_is_cut_at_eos(tiny):
    prompt = [1, 17, 23]
    free = generate_tokens(tiny, [prompt], 6, eos_id=-5)[0]
    eos = free[len(prompt) + 3]
    assert eos not in free[: len(prompt) + 3]
    assert generate_tokens(tiny, [prompt], 6, eos_id=eos)[0] == free[: len(prompt) + 3]
    assert generate_tokens(tiny, [prompt], 0, eos_id=eos)[0] == prompt


@pytest.mark.usefixtures("one_torch_thread")
def test_sampling_is_seeded_and_top_p_zero_is_greedy(tiny):
    prompts = [[1, 4, 5], [1, 9]]
    greedy = generate_tokens(tiny, prompts, 8, eos_id=-5)
    assert generate_tokens(tiny, prompts, 8, eos_id=-5, temperature=1.0, top_p=1e-9) == greedy

    def sample(seed):
        g = torch.Generator().manual_seed(seed)
        return generate_tokens(
            tiny, prompts, 8, eos_id=-5, temperature=1.5, top_p=0.95, generator=g
        )

    assert sample(0) == sample(0)
    assert sample(0) != sample(1) or sample(2) != sample(0)


@pytest.mark.usefixtures("one_torch_thread")
def test_generation_errors(tiny, tmp_path):
    with pytest.raises(ValueError, match="at least one token"):
        generate_tokens(tiny, [[1], []], 3, eos_id=2)
    with pytest.raises(ValueError, match="max_gen_len"):
        generate_tokens(tiny, [[1]], -1, eos_id=2)
    with pytest.raises(ValueError, match="top_p"):
        generate_tokens(tiny, [[1]], 1, eos_id=2, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="longest prompt"):
        generate_tokens(tiny, [[1] * 49], 1, eos_id=2)
    tok = nakta_model.Tokenizer(train_tiny_tokenizer(tmp_path))
    with pytest.raises(TypeError, match="list of strings"):
        nakta_model.generate(tiny, tok, "a prompt", 3)
    with pytest.raises(FileNotFoundError):
        nakta_model.Tokenizer(tmp_path / "nope.model")


# ------------------------------------------------------------------------------------------------
# Stop strings cut a continuation exactly where lm-eval's post-hoc split would.
# ------------------------------------------------------------------------------------------------


WORDS = {1: "The", 2: " cat", 3: "\n", 4: "\n", 5: " sat", 6: ".", 7: " Q:"}


def decode(tokens):
    return "".join(WORDS[t] for t in tokens)


def lm_eval_split(text, until):
    for term in until:
        if term:
            text = text.split(term)[0]
    return text


@pytest.mark.parametrize(
    "tokens, until",
    [
        ([1, 2, 5, 6], ["\n\n"]),
        ([1, 2, 3, 4, 5], ["\n\n"]),
        ([1, 2, 7, 3, 4], ["\n\n", " Q:"]),
        ([1, 2, 6, 7, 3, 4], [" Q:", "."]),
        ([1, 2], ["", "x"]),
    ],
)
def test_cut_matches_lm_eval(tokens, until):
    text, stopped = StopStrings(until, decode).cut(tokens)
    want = lm_eval_split(decode(tokens), until)
    assert text == want
    assert stopped == (want != decode(tokens))


def test_a_stop_split_over_two_tokens_is_found():
    assert StopStrings(["\n\n"], decode).cut([1, 3]) == ("The\n", False)
    assert StopStrings(["\n\n"], decode).cut([1, 3, 4, 5]) == ("The", True)


def test_bad_stops():
    with pytest.raises(TypeError, match="strings"):
        StopStrings(["a", 3], decode)
    assert StopStrings("\n", decode).stops == ["\n"]
