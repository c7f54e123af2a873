"""llama_org on a REAL pretrained checkpoint: stories260K (GQA 8/4 heads) in Meta's format.

The expected tokens and logits come from an independent NumPy port of llama2.c's run.c
(``stories260K_greedy_reference.json``), so this pins the reference to real weights.
"""

from __future__ import annotations

import json

import pytest
import torch

from llama_org import Llama, Tokenizer
from llama_org.distributed import shutdown


@pytest.fixture(scope="module", autouse=True)
def _single_thread_and_cleanup():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    shutdown()


@pytest.fixture
def stories(shared_data):
    ckpt = shared_data / "stories260K"
    llama = Llama.build(
        ckpt, ckpt / "tokenizer.model", max_seq_len=257, max_batch_size=2, device="cpu"
    )
    ref = json.loads((shared_data / "stories260K_greedy_reference.json").read_text())
    return llama, ref


def test_greedy_from_bos_reproduces_the_256_reference_tokens(stories):
    llama, ref = stories
    assert len(ref["tokens"]) == 257 and ref["tokens"][0] == 1
    out, _ = llama.generate([[1]], max_gen_len=256, temperature=0)
    assert out[0] == ref["tokens"][1:]
    assert llama.tokenizer.decode(out[0]) == ref["text"]


def test_position0_logits_match_the_reference(stories):
    llama, ref = stories
    logits = llama.model(torch.tensor([[1]]), 0)[0, 0]
    values, indices = torch.topk(logits, 5)
    assert indices.tolist() == [t for t, _ in ref["pos0_logits_top5"]]
    assert values.tolist() == pytest.approx([v for _, v in ref["pos0_logits_top5"]], abs=1e-3)
    assert float(logits.sum()) == pytest.approx(ref["pos0_logits_sum"], abs=1e-2)


def test_one_prefill_over_the_reference_text_predicts_every_next_token(stories):
    """All-position logits from a single 256-token prefill (causal mask, no cache reuse)."""
    llama, ref = stories
    tokens = torch.tensor([ref["tokens"][:-1]])
    logits = llama.model(tokens, 0)
    assert logits.shape == (1, 256, 512)
    assert logits[0].argmax(-1).tolist() == ref["tokens"][1:]


def test_batched_prompts_of_different_lengths(stories):
    """Rows of a batch do not leak into each other; prompt tokens are kept."""
    llama, ref = stories
    prompt_a = ref["tokens"][:3]
    prompt_b = ref["tokens"][:9]
    out, _ = llama.generate([prompt_a, prompt_b], max_gen_len=20, temperature=0)
    assert out[0] == ref["tokens"][3:23]
    assert out[1] == ref["tokens"][9:29]


def test_example_cli_completes_the_reference_story(shared_data, capsys):
    from llama_org.example_text_completion import main

    ckpt = shared_data / "stories260K"
    ref = json.loads((shared_data / "stories260K_greedy_reference.json").read_text())
    argv = ["--ckpt_dir", str(ckpt), "--tokenizer_path", str(ckpt / "tokenizer.model")]
    argv += ["--prompt", "Once upon a time", "--temperature", "0", "--max_gen_len", "30"]
    (generation,) = main(argv)
    llama_tok = Tokenizer(ckpt / "tokenizer.model")
    assert llama_tok.encode("Once upon a time", bos=True, eos=False) == ref["tokens"][:5]
    assert generation == llama_tok.decode(ref["tokens"][5:35])
    assert generation in capsys.readouterr().out
