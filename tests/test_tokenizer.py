"""The tokenizer interface against each kind's reference, id for id.

* Meta's Llama-3 tiktoken file (shipped by ``llama-models``) against Meta's own
  ``llama_models.llama3.tokenizer.Tokenizer``;
* a HF Llama-3 ``tokenizer.json`` (built from Meta's file by transformers' ``TikTokenConverter``)
  and HF Mistral v1 / v3 folders (transformers' conversion of ``mistral-common``'s SentencePiece
  models) against ``AutoTokenizer``;
* SentencePiece: the LLaMA tokenizer (``../shared/data``) against sentencepiece itself, Mistral
  v1 / v3 against ``mistral-common``'s tokenizer.

Text: HellaSwag contexts and endings as lm-eval builds them (a leading space before each ending,
and context + ending whole), a 200-task sample by default and all 10,042 tasks in the slow tier.

Here too: the lm-eval speed bench's HF tokenizer folder for Meta's Llama-3 file encodes as Nakta does.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from tokenizer_assets import (
    DATA,
    LLAMA_SP,
    hf_from_sentencepiece,
    hf_llama3_folder,
    meta_llama3_file,
    mistral_sp,
    package_file,
)

from nakta_model.tasks import hellaswag
from nakta_model.tokenizer import (
    HFTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    TokenizerError,
    check_fits_vocab,
    find_tokenizer,
    load_tokenizer,
    tokenizer_files,
)
from speed_bench import lm_eval_weights  # noqa: E402

HELLASWAG = DATA / "hellaswag_val_full.jsonl"
SAMPLE = 200

# strings tokenizers get wrong when they are only nearly right
TRICKY = [
    "",
    " ",
    "Hello world",
    " leading space",
    "trailing space ",
    "  two  spaces\n\n\nnewlines\r\n\ttab",
    "ünïcödé, 日本語, emoji 🦙🦙 and 1234567890",
    "don't I'LL we've THEY'RE",
    "<|begin_of_text|> special text <|eot_id|> inside",
    "<s> </s> [INST]",
    "x" * 3000 + " " * 3000 + "y",
]


def _hellaswag_strings(limit: int | None) -> list[str]:
    """Contexts, endings (leading space) and context + ending, as lm-eval encodes them."""
    if not HELLASWAG.is_file():
        pytest.skip(f"{HELLASWAG} is missing")
    docs = hellaswag.load_jsonl(HELLASWAG)
    if limit is not None:
        docs = random.Random(0).sample(docs, limit)
    out = []
    for doc in docs:
        out.append(doc.query)
        for context, ending in hellaswag.doc_requests(doc):
            out += [ending, context + ending]
    return out


# ------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def meta_file() -> Path:
    return meta_llama3_file()


@pytest.fixture(scope="module")
def meta_ref(meta_file):
    from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer

    return MetaTokenizer(meta_file)


@pytest.fixture(scope="module")
def hf_llama3_dir(meta_ref, tmp_path_factory) -> Path:
    return hf_llama3_folder(tmp_path_factory.mktemp("hf_llama3"))


@pytest.fixture(scope="module", params=["v1", "v3"])
def hf_mistral_dir(request, tmp_path_factory) -> Path:
    sp = mistral_sp(request.param)
    return hf_from_sentencepiece(sp, tmp_path_factory.mktemp(f"hf_mistral_{request.param}"))


# ------------------------------------------------------------------------------- factory


def test_factory_picks_the_kind_from_the_file_or_folder(meta_file, tmp_path):
    if not LLAMA_SP.is_file():
        pytest.skip(f"{LLAMA_SP} is missing")
    assert type(load_tokenizer(LLAMA_SP)) is Tokenizer
    assert type(load_tokenizer(meta_file)) is TiktokenTokenizer
    meta_dir = tmp_path / "meta"
    meta_dir.mkdir()
    shutil.copyfile(meta_file, meta_dir / "tokenizer.model")
    assert find_tokenizer(meta_dir) == meta_dir / "tokenizer.model"
    assert type(load_tokenizer(meta_dir)) is TiktokenTokenizer
    sp_dir = tmp_path / "sp"
    sp_dir.mkdir()
    shutil.copyfile(LLAMA_SP, sp_dir / "tokenizer.model")
    assert type(load_tokenizer(sp_dir)) is Tokenizer
    # a HF folder holding both: tokenizer.json wins, as AutoTokenizer reads it
    hf = hf_from_sentencepiece(LLAMA_SP, tmp_path / "hf")
    shutil.copyfile(LLAMA_SP, hf / "tokenizer.model")
    assert find_tokenizer(hf) == hf / "tokenizer.json"
    tok = load_tokenizer(hf)
    assert type(tok) is HFTokenizer and (tok.bos_id, tok.eos_id, tok.n_words) == (1, 2, 32000)
    assert type(load_tokenizer(hf / "tokenizer.json")) is HFTokenizer


def _refused(path, match: str) -> None:
    with pytest.raises(TokenizerError, match=match) as info:
        load_tokenizer(path)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


def test_factory_refuses_what_it_cannot_read_in_one_line(meta_file, tmp_path):
    _refused(tmp_path, r"no tokenizer.json or tokenizer.model in this folder")
    _refused(tmp_path / "nope", r"nope: no such file or folder")
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"\x00\x01garbage")
    _refused(garbage, r"garbage.model: not a SentencePiece model \(")
    lines = meta_file.read_bytes().splitlines()
    broken = tmp_path / "broken" / "tokenizer.model"
    broken.parent.mkdir()
    broken.write_bytes(b"\n".join(lines[:5] + [b"not base64!! 5"] + lines[6:]))
    _refused(broken.parent, r"not a Llama-3 tiktoken file \(.*line 6 is not 'base64 rank'")
    short = tmp_path / "short.model"
    short.write_bytes(b"\n".join(lines[:1000]))
    _refused(short, r"tiktoken file of 1000 ranks; only Meta's Llama-3 tokenizer \(128000")
    gap = tmp_path / "gap.model"
    gap.write_bytes(b"\n".join(lines[:10] + lines[11:] + [lines[0].split()[0] + b" 999999"]))
    _refused(gap, r"ranks are not 0 \.\. ")
    bad_json = tmp_path / "tokenizer.json"
    bad_json.write_text("{}")
    _refused(bad_json, r"tokenizer.json: not a HF tokenizer.json \(")


def test_llama4_tiktoken_file_is_refused_not_misread():
    llama4 = package_file("llama_models", "llama4", "tokenizer.model")
    _refused(llama4, r"200000 ranks; only Meta's Llama-3 tokenizer")


def test_check_fits_vocab(meta_file):
    tok = load_tokenizer(meta_file)
    check_fits_vocab(tok, 128256)
    check_fits_vocab(tok, 128512)  # a padded embedding is fine
    with pytest.raises(ValueError, match=r"has 128256 tokens, more than the vocab_size 32000 of"):
        check_fits_vocab(tok, 32000, "ckpt")


def test_bad_strings_are_type_errors(meta_file):
    tok = load_tokenizer(meta_file)
    with pytest.raises(TypeError, match="s must be a str, got bytes"):
        tok.encode(b"x", bos=True, eos=False)
    with pytest.raises(TypeError, match="strings must hold str only, got int"):
        tok.encode_many(["a", 3], bos=True, eos=False)
    assert tok.encode_many([], bos=True, eos=True) == []


# --------------------------------------------------------------------- Meta's Llama-3 file


def _check_meta(tok, meta_ref, strings):
    for bos, eos in ((True, False), (False, False), (True, True)):
        want = [meta_ref.encode(s, bos=bos, eos=eos) for s in strings]
        assert tok.encode_many(strings, bos=bos, eos=eos) == want
        got = [tok.encode(s, bos=bos, eos=eos) for s in strings]
        bad = [s for s, g, w in zip(strings, got, want) if g != w]
        assert not bad, f"{len(bad)} strings differ from Meta's, first {bad[0][:80]!r}"
    for s, ids in zip(strings, want):
        assert tok.decode(ids) == meta_ref.decode(ids)
        assert tok.decode(ids[1:-1]) == s  # byte-level BPE round-trips exactly


def test_meta_tiktoken_specials_and_ids_are_metas(meta_file, meta_ref):
    tok = load_tokenizer(meta_file)
    assert tok.special_tokens == meta_ref.special_tokens
    assert (tok.n_words, tok.bos_id, tok.eos_id, tok.pad_id) == (
        meta_ref.n_words,
        meta_ref.bos_id,
        meta_ref.eos_id,
        meta_ref.pad_id,
    )
    assert tok.n_words == 128256 and tok.bos_id == 128000
    assert sorted(tok.stop_ids) == sorted(meta_ref.stop_tokens)
    assert tok.token_id("<|eot_id|>") == 128009 and tok.token_id("<|eom_id|>") == 128008
    assert tok.token_id("<|reserved_special_token_245|>") == 128255
    assert tok.model._pat_str == meta_ref.pat_str
    # special tokens' text in plain text stays text, as Meta encodes by default
    ids = tok.encode("<|eot_id|>", bos=False, eos=False)
    assert 128009 not in ids and ids == meta_ref.encode("<|eot_id|>", bos=False, eos=False)
    assert tok.decode([128000, 128006]) == "<|begin_of_text|><|start_header_id|>"


def test_meta_tiktoken_equals_meta_on_tricky_and_long_strings(meta_file, meta_ref):
    tok = load_tokenizer(meta_file)
    # past Meta's 25,000-character run cut and 400,000-character piece cut
    long = ["a" * 30_000, " " * 26_000 + "b", ("word " * 90_000)[:450_000]]
    _check_meta(tok, meta_ref, TRICKY + long)


def test_meta_tiktoken_equals_meta_on_hellaswag_sample(meta_file, meta_ref):
    _check_meta(load_tokenizer(meta_file), meta_ref, _hellaswag_strings(SAMPLE))


@pytest.mark.slow
def test_meta_tiktoken_equals_meta_on_all_hellaswag(meta_file, meta_ref):
    tok = load_tokenizer(meta_file)
    strings = _hellaswag_strings(None)
    assert len(strings) == 10_042 * 9
    want = [meta_ref.encode(s, bos=True, eos=False) for s in strings]
    assert tok.encode_many(strings, bos=True, eos=False) == want
    assert [tok.encode(s, bos=True, eos=False) for s in strings] == want
    assert all(tok.decode(ids[1:]) == s for s, ids in zip(strings, want))


# ------------------------------------------------------------------------- HF tokenizer.json


def _check_hf(tok, folder: Path, strings) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(folder))
    plain = [ref.encode(s, add_special_tokens=False) for s in strings]
    assert tok.encode_many(strings, bos=False, eos=False) == plain
    assert [tok.encode(s, bos=False, eos=False) for s in strings] == plain
    with_bos = [ref.encode(s) for s in strings]  # HF's own BOS (its post-processor)
    assert tok.encode_many(strings, bos=True, eos=False) == with_bos
    for ids in with_bos:
        assert tok.decode(ids) == ref.decode(ids)
    assert (tok.bos_id, tok.eos_id) == (ref.bos_token_id, ref.eos_token_id)
    assert tok.n_words == len(ref)


def test_hf_llama3_equals_autotokenizer_and_meta(hf_llama3_dir, meta_ref):
    tok = load_tokenizer(hf_llama3_dir)
    assert type(tok) is HFTokenizer
    strings = TRICKY + _hellaswag_strings(SAMPLE)
    _check_hf(tok, hf_llama3_dir, strings)
    assert (tok.bos_id, tok.eos_id, tok.n_words) == (128000, 128009, 128256)
    # generation_config's list first, then the tokenizer's eos
    assert tok.stop_ids == (128001, 128008, 128009)
    # on text without special tokens' text, HF's conversion is Meta's tokenizer
    plain = [s for s in strings if "<|" not in s]
    assert tok.encode_many(plain, bos=True, eos=False) == [
        meta_ref.encode(s, bos=True, eos=False) for s in plain
    ]
    # HF reads a special token's text as the token (a chat template's rendering relies on it)
    assert tok.encode("a<|eot_id|>", bos=False, eos=False) == [64, 128009]


def test_hf_ids_from_config_json_when_tokenizer_config_has_none(hf_llama3_dir, tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(hf_llama3_dir, folder)
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "generation_config.json").unlink()
    (folder / "config.json").write_text(
        json.dumps({"bos_token_id": 128000, "eos_token_id": 128001})
    )
    tok = load_tokenizer(folder)
    assert (tok.bos_id, tok.eos_id, tok.stop_ids) == (128000, 128001, (128001,))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    _refused(folder, r"eos_token '<\|nope\|>' is not in tokenizer.json")


def test_hf_mistral_equals_autotokenizer(hf_mistral_dir):
    tok = load_tokenizer(hf_mistral_dir)
    assert type(tok) is HFTokenizer
    _check_hf(tok, hf_mistral_dir, TRICKY + _hellaswag_strings(SAMPLE))
    assert tok.stop_ids == (2,)


@pytest.mark.parametrize(
    "settings",
    [{}, {"legacy": True}, {"legacy": False}, {"add_prefix_space": False}],
    ids=["default", "legacy", "not-legacy", "no-prefix-space"],
)
def test_hf_sentencepiece_folder_after_special_tokens(hf_mistral_dir, settings, tmp_path):
    """transformers' LlamaTokenizer rebuilds the pipeline of a converted tokenizer.json: what
    follows a special token (``<s>[INST]``) depends on ``legacy`` / ``add_prefix_space``."""
    folder = tmp_path / "hf"
    shutil.copytree(hf_mistral_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, **settings}))
    strings = ["<s>[INST] Hello [/INST]", "</s> after", "a</s>b", " <s>  x", "Hello"]
    _check_hf(load_tokenizer(folder), folder, strings + TRICKY)


@pytest.mark.slow
def test_hf_llama3_equals_autotokenizer_on_all_hellaswag(hf_llama3_dir):
    from transformers import AutoTokenizer

    tok = load_tokenizer(hf_llama3_dir)
    ref = AutoTokenizer.from_pretrained(str(hf_llama3_dir))
    strings = _hellaswag_strings(None)
    assert tok.encode_many(strings, bos=True, eos=False) == [ref.encode(s) for s in strings]


# ---------------------------------------------------------------------------- SentencePiece


def test_llama_sentencepiece_equals_sentencepiece():
    if not LLAMA_SP.is_file():
        pytest.skip(f"{LLAMA_SP} is missing")
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor(model_file=str(LLAMA_SP))
    tok = load_tokenizer(LLAMA_SP)
    assert (tok.n_words, tok.bos_id, tok.eos_id, tok.pad_id, tok.stop_ids) == (
        32000,
        1,
        2,
        -1,
        (2,),
    )
    strings = TRICKY + _hellaswag_strings(SAMPLE)
    want = [[1, *sp.encode(s)] for s in strings]
    assert tok.encode_many(strings, bos=True, eos=False) == want
    assert [tok.encode(s, bos=True, eos=False) for s in strings] == want
    assert all(tok.decode(ids) == sp.decode(ids) for ids in want)


@pytest.mark.parametrize("version", ["v1", "v3"])
def test_mistral_sentencepiece_equals_mistral_common(version):
    pytest.importorskip("mistral_common")
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    from sentencepiece import SentencePieceProcessor

    path = mistral_sp(version)
    ref = MistralTokenizer.from_file(str(path)).instruct_tokenizer.tokenizer
    tok = load_tokenizer(path)
    assert type(tok) is Tokenizer
    assert (tok.n_words, tok.bos_id, tok.eos_id) == (ref.n_words, ref.bos_id, ref.eos_id)
    assert tok.n_words == {"v1": 32000, "v3": 32768}[version]
    strings = TRICKY + _hellaswag_strings(SAMPLE)
    for bos, eos in ((True, False), (False, True)):
        want = [ref.encode(s, bos=bos, eos=eos) for s in strings]
        assert tok.encode_many(strings, bos=bos, eos=eos) == want
    sp = SentencePieceProcessor(model_file=str(path))  # mistral-common's decode trims: sp's
    assert all(tok.decode(ids) == sp.decode(ids) for ids in want)


def test_tokenizer_files_lists_what_a_converter_copies(hf_llama3_dir, tmp_path):
    names = [p.name for p in tokenizer_files(hf_llama3_dir)]
    assert names[0] == "tokenizer.json" and "generation_config.json" in names
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in tokenizer_files(hf_llama3_dir):
        shutil.copyfile(p, copy / p.name)
    a, b = load_tokenizer(hf_llama3_dir), load_tokenizer(copy)
    assert (a.bos_id, a.eos_id, a.stop_ids) == (b.bos_id, b.eos_id, b.stop_ids)
    assert tokenizer_files(tmp_path / "copy" / "nothing") == []


@pytest.mark.slow
@pytest.mark.parametrize("which", ["llama", "mistral-v3"])
def test_sentencepiece_equals_references_on_all_hellaswag(which):
    from sentencepiece import SentencePieceProcessor

    if which == "llama":
        if not LLAMA_SP.is_file():
            pytest.skip(f"{LLAMA_SP} is missing")
        sp = SentencePieceProcessor(model_file=str(LLAMA_SP))
        tok, ref = load_tokenizer(LLAMA_SP), lambda s: [1, *sp.encode(s)]
    else:
        pytest.importorskip("mistral_common")
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        path = mistral_sp(which.split("-")[1])
        mistral = MistralTokenizer.from_file(str(path)).instruct_tokenizer.tokenizer
        tok, ref = load_tokenizer(path), lambda s: mistral.encode(s, bos=True, eos=False)
    strings = _hellaswag_strings(None)
    assert tok.encode_many(strings, bos=True, eos=False) == [ref(s) for s in strings]


# ------------------------------------------------------------------------------------------------
# The lm-eval speed bench's HF tokenizer folder for Meta's Llama-3 file: ``AutoTokenizer`` on it
# encodes HellaSwag as Nakta's tokenizer does (the bench's own agreement check passes) and a
# disagreement is refused.
# ------------------------------------------------------------------------------------------------


def test_llama3_hf_tokenizer_folder_agrees_with_nakta(tmp_path):
    pytest.importorskip("transformers")
    meta = meta_llama3_file()
    hellaswag = DATA / "hellaswag_val_full.jsonl"
    if not hellaswag.is_file():
        pytest.skip(f"{hellaswag} is missing")
    out = lm_eval_weights.write_hf_tokenizer(tmp_path / "hf_tok", meta, 8192)
    assert (out / "tokenizer.json").is_file() and not (out / "tokenizer.model").exists()
    texts = lm_eval_weights._sample_texts(str(hellaswag), n=20)
    lm_eval_weights.check_tokenizers_agree(out, meta, texts)  # raises on any difference
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(out))
    assert (hf.bos_token_id, hf.eos_token_id, len(hf)) == (128000, 128001, 128256)
    llama_sp = DATA / "llama_tokenizer.model"
    if llama_sp.is_file():  # the check is not vacuous: another tokenizer is refused
        with pytest.raises(lm_eval_weights.UsageError, match="disagree on"):
            lm_eval_weights.check_tokenizers_agree(out, llama_sp, texts)
