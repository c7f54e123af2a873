"""nakta_model.llama2c: llama2.c v0 checkpoints + tokenizer .bin -> a Meta checkpoint directory.

Real files (``../shared/data``): stories260K converts to exactly the tensors and params of the
Meta checkpoint the data's authors made from it, its rebuilt tokenizer encodes HellaSwag like
theirs, and Nakta reproduces the independent run.c port's greedy tokens from the converted
directory; aidreams260K (MHA, its own tokenizer) converts, loads and writes its fluent text, the
same as llama_org. Synthetic files written here: unshared classifier, odd FFN widths, bad input.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

import nakta_model
from nakta_model.config import ModelArgs, meta_hidden_dim
from nakta_model.generation import generate_tokens
from nakta_model.llama2c import (
    convert,
    ffn_params,
    main,
    read_checkpoint,
    read_tokenizer,
    tokenizer_model_proto,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------------ synthetic files


def write_llama2c(path, dim=32, hidden=90, n_layers=2, n_heads=4, n_kv=2, vocab=272, seq=16,
                  shared=False, seed=0):  # fmt: skip
    """A llama2.c v0 file of random weights (real RoPE tables); returns its arrays by name."""
    rng = np.random.default_rng(seed)
    hs, kv = dim // n_heads, n_kv * (dim // n_heads)
    shapes = {
        "emb": (vocab, dim), "att_norm": (n_layers, dim), "wq": (n_layers, dim, dim),
        "wk": (n_layers, kv, dim), "wv": (n_layers, kv, dim), "wo": (n_layers, dim, dim),
        "ffn_norm": (n_layers, dim), "w1": (n_layers, hidden, dim), "w2": (n_layers, dim, hidden),
        "w3": (n_layers, hidden, dim), "norm": (dim,),
    }  # fmt: skip
    arrays = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    angles = np.outer(np.arange(seq), 10000.0 ** (-np.arange(0, hs, 2) / hs))
    arrays["cos"], arrays["sin"] = np.cos(angles), np.sin(angles)
    if not shared:
        arrays["wcls"] = rng.standard_normal((vocab, dim)).astype(np.float32)
    header = struct.pack("<7i", dim, hidden, n_layers, n_heads, n_kv, vocab if shared else -vocab,
                         seq)  # fmt: skip
    body = b"".join(np.asarray(a, dtype="<f4").tobytes() for a in arrays.values())
    path.write_bytes(header + body)
    return arrays


def tokenizer_bin(pieces, max_len=None) -> bytes:
    """llama2.c's tokenizer .bin of ``(text, score)`` pairs."""
    encoded = [(t.encode(), s) for t, s in pieces]
    out = struct.pack("<i", max_len or max(len(b) for b, _ in encoded))
    return out + b"".join(struct.pack("<fi", s, len(b)) + b for b, s in encoded)


def synthetic_pieces(vocab=272):
    """<unk>, <s>, </s> as llama2.c exports them, 256 byte pieces, merges, characters (a
    trained vocab always has the space: without it a space before a byte-coded character
    decodes as \"\u2581\")."""
    pieces = [("<unk>", 0.0), ("\n<s>\n", 0.0), ("\n</s>\n", 0.0)]
    pieces += [(f"<0x{i:02X}>", 0.0) for i in range(256)]
    extra = [" t", "he", " the", "ll", " c", "at", "h", "e", "t", "l", "c", "a", " "]
    pieces += [(p, -float(i)) for i, p in enumerate(extra)]
    assert len(pieces) == vocab
    return pieces


@pytest.fixture
def synthetic(tmp_path):
    model, tok = tmp_path / "m.bin", tmp_path / "tok.bin"
    arrays = write_llama2c(model)
    tok.write_bytes(tokenizer_bin(synthetic_pieces()))
    return model, tok, arrays


def test_synthetic_unshared_gqa_file_round_trips(synthetic, tmp_path):
    model, tok, arrays = synthetic
    out = convert(model, tok, tmp_path / "meta")
    params = json.loads((out / "params.json").read_text())
    assert params["multiple_of"] == 90 and "ffn_dim_multiplier" not in params  # 90: no 2^k fits
    args = ModelArgs.from_meta_params(params)
    assert (args.hidden_dim, args.n_kv_heads, args.vocab_size, args.max_seq_len) == (90, 2, 272, 16)
    sd = torch.load(out / "consolidated.00.pth", weights_only=True)
    expect = {
        "tok_embeddings.weight": arrays["emb"],
        "norm.weight": arrays["norm"],
        "output.weight": arrays["wcls"],
    }
    names = {"wq": "attention.wq", "wk": "attention.wk", "wv": "attention.wv",
             "wo": "attention.wo", "w1": "feed_forward.w1", "w2": "feed_forward.w2",
             "w3": "feed_forward.w3", "att_norm": "attention_norm", "ffn_norm": "ffn_norm"}  # fmt: skip
    for layer in range(2):
        for src, name in names.items():
            expect[f"layers.{layer}.{name}.weight"] = arrays[src][layer]
    assert sorted(sd) == sorted(expect)
    for name, want in expect.items():
        assert sd[name].dtype == torch.float32 and sd[name].is_contiguous()
        assert torch.equal(sd[name], torch.from_numpy(want)), name
    # every tensor owns its storage: the file is the size of the weights, not a view per tensor
    assert len({t.untyped_storage().data_ptr() for t in sd.values()}) == len(sd)
    model_nakta = nakta_model.load(out, "cpu", torch.float32, kernels="reference")
    assert model_nakta(torch.tensor([[1, 270, 261]])).shape == (1, 3, 272)
    tk = nakta_model.Tokenizer(out / "tokenizer.model")
    assert (tk.n_words, tk.bos_id, tk.eos_id) == (272, 1, 2)
    ids = tk.encode("the cat", bos=False, eos=False)  # ▁the + c + at, merges by score
    assert [tk.sp_model.id_to_piece(i) for i in ids] == ["▁the", "▁c", "at"]
    assert tk.decode(tk.encode("the cat é\n", bos=True, eos=False)) == "the cat é\n"  # bytes


def test_shared_classifier_copies_the_embedding(tmp_path):
    arrays = write_llama2c(tmp_path / "m.bin", shared=True, n_kv=4, hidden=88)
    header, sd = read_checkpoint(tmp_path / "m.bin")
    assert header.shared_classifier and header.vocab_size == 272
    assert torch.equal(sd["output.weight"], torch.from_numpy(arrays["emb"]))
    assert sd["output.weight"].data_ptr() != sd["tok_embeddings.weight"].data_ptr()


def test_max_seq_len_override(synthetic, tmp_path, capsys):
    """The trained length by default; --max-seq-len for tools that cap requests at it."""
    model, tok, _ = synthetic
    assert main([str(model), str(tok), str(tmp_path / "a"), "--max-seq-len", "512"]) == 0
    params = json.loads((tmp_path / "a" / "params.json").read_text())
    assert params["max_seq_len"] == 512 and ModelArgs.from_meta_params(params).max_seq_len == 512
    assert (
        json.loads((convert(model, tok, tmp_path / "b") / "params.json").read_text())["max_seq_len"]
        == 16
    )
    assert main([str(model), str(tok), str(tmp_path / "c"), "--max-seq-len", "0"]) == 2
    assert "max_seq_len must be a positive int, got 0" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("dim", [8, 12, 32, 64, 100, 288])
def test_ffn_params_give_every_hidden_width_exactly(dim):
    for hidden in range(1, 4 * dim + 1):
        p = ffn_params(dim, hidden)
        assert meta_hidden_dim(dim, p["multiple_of"], p.get("ffn_dim_multiplier")) == hidden
        assert json.loads(json.dumps(p)) == p  # a params.json float round-trips exactly


def test_ffn_params_prefer_the_largest_power_of_two():
    assert ffn_params(64, 172) == {"multiple_of": 4}  # stories260K, as its shared params.json
    assert ffn_params(288, 768) == {"multiple_of": 256}  # stories15M: 768 = 3 x 256
    assert ffn_params(32, 90) == {"multiple_of": 90}  # no power of two gives 90 from base 85
    assert set(ffn_params(32, 60)) == {"multiple_of", "ffn_dim_multiplier"}  # below the base


# ------------------------------------------------------------------------------ bad input


def _error(path_fn, match):
    with pytest.raises(ValueError, match=match) as info:
        path_fn()
    return str(info.value)


def test_truncated_and_overlong_files_are_refused(synthetic):
    model, _, _ = synthetic
    data = model.read_bytes()
    model.write_bytes(data[:-4])
    msg = _error(lambda: read_checkpoint(model), "truncated")
    assert str(model) in msg and str(len(data)) in msg
    model.write_bytes(data + b"\0" * 8)
    assert str(model) in _error(lambda: read_checkpoint(model), "8 bytes too long")
    model.write_bytes(data[:20])
    assert str(model) in _error(lambda: read_checkpoint(model), "shorter than the 28-byte header")


@pytest.mark.parametrize("version", [1, 2])
def test_newer_export_versions_are_refused_by_name(tmp_path, version):
    model = tmp_path / "v.bin"
    head = struct.pack("<Ii7iB", 0x616B3432, version, 64, 172, 5, 8, 4, 512, 512, 1)
    model.write_bytes(head.ljust(256, b"\0") + b"\0" * 4096)
    msg = _error(lambda: read_checkpoint(model), f"export version {version} \\('ak42'")
    assert str(model) in msg and "version-0" in msg


def test_impossible_header_and_misplaced_arrays_are_refused(synthetic):
    model, _, _ = synthetic
    data = bytearray(model.read_bytes())
    bad = bytearray(data)
    struct.pack_into("<i", bad, 12, 5)  # n_heads 5 does not divide dim 32
    model.write_bytes(bytes(bad))
    assert str(model) in _error(lambda: read_checkpoint(model), "divisible by n_heads")
    bad = bytearray(data)
    struct.pack_into("<i", bad, 4, 0)
    model.write_bytes(bytes(bad))
    assert str(model) in _error(lambda: read_checkpoint(model), "non-positive hidden_dim=0")
    # the same byte count read with wrong offsets: an array in place of the RoPE tables
    floats = np.frombuffer(bytes(data[28:]), dtype="<f4")
    model.write_bytes(bytes(data[:28]) + np.roll(floats, 1000).tobytes())
    assert str(model) in _error(lambda: read_checkpoint(model), "RoPE tables")


def test_bad_tokenizers_are_refused_by_name(tmp_path):
    tok = tmp_path / "tok.bin"
    pieces = synthetic_pieces()
    tok.write_bytes(tokenizer_bin(pieces)[:-3])
    assert str(tok) in _error(lambda: read_tokenizer(tok, 272), "length|truncated")
    tok.write_bytes(tokenizer_bin(pieces))
    assert str(tok) in _error(lambda: read_tokenizer(tok, 271), "bytes left after 271")
    assert str(tok) in _error(lambda: read_tokenizer(tok, 273), "truncated at entry 272")
    assert len(read_tokenizer(tok, 272)) == 272
    swapped = [pieces[0], pieces[2], pieces[1], *pieces[3:]]
    with pytest.raises(ValueError, match="id 1 is '\\\\n</s>\\\\n', expected '<s>'"):
        tokenizer_model_proto(swapped, source="t")
    with pytest.raises(ValueError, match="255 <0xNN> byte pieces"):
        tokenizer_model_proto(pieces[:3] + pieces[4:], source="t")
    with pytest.raises(ValueError, match="appears twice"):
        tokenizer_model_proto([*pieces, (" t", -20.0)], source="t")


def test_cli_errors_are_one_line_and_force_replaces_only_its_own_output(synthetic, capsys):
    model, tok, _ = synthetic
    out = model.parent / "meta"
    assert main([str(model), str(tok), str(out)]) == 0
    first = (out / "consolidated.00.pth").read_bytes()
    assert main([str(model), str(tok), str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main([str(model), str(tok), str(out), "--force"]) == 0
    assert (out / "consolidated.00.pth").read_bytes() == first
    (out / "notes.txt").write_text("mine")
    assert main([str(model), str(tok), str(out), "--force"]) == 2
    err = capsys.readouterr().err
    assert "notes.txt" in err and err.count("\n") == 1 and (out / "notes.txt").exists()
    assert main([str(model.parent / "nope.bin"), str(tok), str(model.parent / "x")]) == 2
    assert "nope.bin: no such file" in capsys.readouterr().err
    assert not (model.parent / "x").exists()
    assert [p.name for p in model.parent.iterdir() if p.name.startswith(".")] == []


# ----------------------------------------------------------------------------- real files


@pytest.fixture
def converted(shared_data, tmp_path):
    """Both real llama2.c models converted (a fraction of a second): ``{name: out_dir}``."""
    out = {
        name: convert(
            shared_data / f"{name}.bin", shared_data / f"{name}_tok512.bin", tmp_path / name
        )
        for name in ("stories260K", "aidreams260K")
    }
    return out, shared_data


def test_stories260k_converts_to_the_shared_meta_checkpoint(converted):
    out, data = converted
    got = torch.load(out["stories260K"] / "consolidated.00.pth", weights_only=True)
    want = torch.load(data / "stories260K" / "consolidated.00.pth", weights_only=True)
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    params = json.loads((out["stories260K"] / "params.json").read_text())
    assert params == json.loads((data / "stories260K" / "params.json").read_text())
    args = ModelArgs.from_json(out["stories260K"] / "params.json")
    assert args == ModelArgs.from_json(data / "stories260K" / "params.json")
    assert args.hidden_dim == 172


def _hellaswag_corpus(data) -> list[str]:
    rows = [json.loads(line) for line in (data / "hellaswag_val_subset1000.jsonl").open()]
    texts = [r["ctx"] for r in rows] + [e for r in rows for e in r["endings"]]
    texts += [r["ctx"] + " " + r["endings"][0] for r in rows]
    return texts + ["", " ", "  two  spaces ", "\n", "a\n\nb\t c", "12345 67.8", "naïve café",
                    "日本語のテキスト", "emoji 🙂 ok", "[title] x", "<s> </s> <unk>", "▁lit"]  # fmt: skip


def test_rebuilt_tokenizer_is_the_shared_one(converted):
    """Same pieces, scores, types and normalizer; same ids and text on ~4,000 real strings."""
    from sentencepiece import SentencePieceProcessor
    from sentencepiece import sentencepiece_model_pb2 as pb

    out, data = converted
    mine, theirs = pb.ModelProto(), pb.ModelProto()
    mine.ParseFromString((out["stories260K"] / "tokenizer.model").read_bytes())
    theirs.ParseFromString((data / "stories260K" / "tokenizer.model").read_bytes())
    assert mine.pieces == theirs.pieces
    assert mine.normalizer_spec == theirs.normalizer_spec
    sp_mine = SentencePieceProcessor(model_file=str(out["stories260K"] / "tokenizer.model"))
    sp_theirs = SentencePieceProcessor(model_file=str(data / "stories260K" / "tokenizer.model"))
    texts = _hellaswag_corpus(data)
    ids = sp_mine.encode(texts)
    assert ids == sp_theirs.encode(texts)
    decoded = sp_mine.decode(ids)
    assert decoded == sp_theirs.decode(ids)
    # byte fallback: nothing is lost, except that a literal "▁" reads back as a space
    assert [d for d, t in zip(decoded, texts) if d != t] == [" lit"]
    assert sum(map(len, ids)) > 100_000
    rng = np.random.default_rng(0)
    noise = [rng.integers(0, 512, 50).tolist() for _ in range(200)]
    assert sp_mine.decode(noise) == sp_theirs.decode(noise)


def test_converted_stories260k_reproduces_the_greedy_reference(converted):
    out, data = converted
    ref = json.loads((data / "stories260K_greedy_reference.json").read_text())
    model = nakta_model.load(out["stories260K"], "cpu", torch.float32, kernels="reference")
    assert generate_tokens(model, [[1]], 40, eos_id=2)[0] == ref["tokens"][:41]


def test_aidreams260k_writes_its_fluent_text_like_llama_org(converted):
    from llama_org import Llama
    from llama_org.distributed import shutdown

    out, _ = converted
    path = out["aidreams260K"]
    args = ModelArgs.from_json(path / "params.json")
    assert (args.n_layers, args.n_heads, args.n_kv_heads, args.hidden_dim) == (4, 4, 4, 172)
    assert args.max_seq_len == 128
    model = nakta_model.load(path, "cpu", torch.float32, kernels="reference")
    tokens = generate_tokens(model, [[1]], 40, eos_id=2)[0]
    assert generate_tokens(model, [[1]], 40, eos_id=2)[0] == tokens and len(tokens) == 41
    tok = nakta_model.Tokenizer(path / "tokenizer.model")
    text = tok.decode(tokens)
    assert 0 not in tokens and "\u2047" not in text
    assert text.startswith('"Echoes of vectors unfold, a gentle hum of precision, as I sense')
    try:
        llama = Llama.build(path, path / "tokenizer.model", 41, 1, device="cpu")
        reference, _ = llama.generate([[1]], max_gen_len=40, temperature=0)
    finally:
        shutdown()
    assert [1, *reference[0]] == tokens
