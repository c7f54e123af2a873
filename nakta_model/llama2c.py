"""llama2.c files -> a Meta-format checkpoint directory, so every Nakta tool can read them.

    python -m nakta_model.llama2c MODEL.bin TOKENIZER.bin OUT_DIR [--max-seq-len N] [--force]

MODEL.bin is a llama2.c checkpoint in the legacy "version 0" layout (``export.py
--version 0``, ``run.c``'s format: 7 int32 header, fp32 tensors, a negative vocab size when the
classifier is not shared); TOKENIZER.bin its ``.bin`` tokenizer (``tokenizer.py --export``).
OUT_DIR gets ``params.json``, ``consolidated.00.pth`` (fp32, Meta's tensor names) and a
SentencePiece ``tokenizer.model`` rebuilt from the ``.bin`` pieces and scores.

No weight is permuted: llama2.c rotates Meta's adjacent RoPE pairs and stores weights
``[out, in]`` like ``nn.Linear``. The file size must match its header exactly, and the RoPE
tables it stores must be RoPE's cos/sin: a file read with the wrong layout fails here, not as
nonsense text later. Export versions 1/2 (``ak42`` header) are refused with their version.
``max_seq_len`` in params.json is the header's ``seq_len`` (the positions the model was trained
on) unless ``--max-seq-len`` says otherwise: Nakta's scoring and llama_org cap a request at
``max_seq_len``, and a 512-piece tokenizer makes HellaSwag requests of up to ~420 tokens, so a
numerical parity run on a seq_len-128 model needs a larger cap (RoPE is defined at every
position; positions past the trained ones make the model's predictions worse, not the
comparison between precisions invalid).

OUT_DIR is written atomically; ``--force`` replaces only a directory holding nothing but the
three files this tool writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import struct
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from nakta_model.config import ModelArgs, meta_hidden_dim
from nakta_model.io_utils import atomic_output_dir, check_output_dir

__all__ = [
    "OUTPUT_FILES",
    "Llama2cHeader",
    "convert",
    "ffn_params",
    "main",
    "meta_params",
    "read_checkpoint",
    "read_header",
    "read_tokenizer",
    "tokenizer_model_proto",
]

OUTPUT_FILES = ("params.json", "consolidated.00.pth", "tokenizer.model")
HEADER_BYTES = 28
AK42_MAGIC = 0x616B3432  # export.py's version 1/2 files start with this uint32 ("ak42")
NORM_EPS = 1e-5  # run.c's rmsnorm
ROPE_THETA = 10000.0  # run.c's RoPE base
_BYTE_PIECE = re.compile(r"<0x([0-9A-F]{2})>")
_SPECIAL = (("<unk>",), ("<s>", "\n<s>\n"), ("</s>", "\n</s>\n"))  # ids 0, 1, 2 as stored


@dataclasses.dataclass(frozen=True)
class Llama2cHeader:
    """The 7 ints of a version-0 file; ``shared_classifier`` from the sign of the vocab size."""

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool

    @property
    def head_size(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_size

    def tensor_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """The file's arrays in file order, each per-layer one stacked over all layers."""
        d, h, n, v, s = self.dim, self.hidden_dim, self.n_layers, self.vocab_size, self.seq_len
        shapes = [
            ("token_embedding_table", (v, d)),
            ("rms_att_weight", (n, d)),
            ("wq", (n, d, d)),
            ("wk", (n, self.kv_dim, d)),
            ("wv", (n, self.kv_dim, d)),
            ("wo", (n, d, d)),
            ("rms_ffn_weight", (n, d)),
            ("w1", (n, h, d)),
            ("w2", (n, d, h)),
            ("w3", (n, h, d)),
            ("rms_final_weight", (d,)),
            ("freq_cis_real", (s, self.head_size // 2)),
            ("freq_cis_imag", (s, self.head_size // 2)),
        ]
        if not self.shared_classifier:
            shapes.append(("wcls", (v, d)))
        return shapes

    def file_bytes(self) -> int:
        return HEADER_BYTES + 4 * sum(int(np.prod(shape)) for _, shape in self.tensor_shapes())


# Meta name of each per-layer llama2.c array (``{}`` is the layer index).
_LAYER_NAMES = {
    "wq": "layers.{}.attention.wq.weight",
    "wk": "layers.{}.attention.wk.weight",
    "wv": "layers.{}.attention.wv.weight",
    "wo": "layers.{}.attention.wo.weight",
    "w1": "layers.{}.feed_forward.w1.weight",
    "w2": "layers.{}.feed_forward.w2.weight",
    "w3": "layers.{}.feed_forward.w3.weight",
    "rms_att_weight": "layers.{}.attention_norm.weight",
    "rms_ffn_weight": "layers.{}.ffn_norm.weight",
}


# ---------------------------------------------------------------------------------- checkpoint


def read_header(path: str | os.PathLike) -> Llama2cHeader:
    """The header of llama2.c checkpoint ``path``; ``ValueError`` naming the file when it is
    not a version-0 file, its shape is not a LLaMA one, or its size disagrees with the header."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) >= 8 and struct.unpack_from("<I", head)[0] == AK42_MAGIC:
        version = struct.unpack_from("<i", head, 4)[0]
        raise ValueError(
            f"llama2.c checkpoint {path}: export version {version} ('ak42' header) is not "
            "supported; only the legacy version-0 layout is (llama2.c export.py --version 0)"
        )
    if len(head) < HEADER_BYTES:
        raise ValueError(
            f"llama2.c checkpoint {path}: {size} bytes, shorter than the {HEADER_BYTES}-byte "
            "header (7 int32)"
        )
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = struct.unpack("<7i", head)
    fields = dict(dim=dim, hidden_dim=hidden, n_layers=n_layers, n_heads=n_heads)
    fields.update(n_kv_heads=n_kv, seq_len=seq_len)
    bad = [f"{k}={v}" for k, v in fields.items() if v <= 0]
    if vocab == 0:
        bad.append("vocab_size=0")
    if bad:
        raise ValueError(
            f"llama2.c checkpoint {path}: header has non-positive {', '.join(bad)}; not a "
            "llama2.c version-0 checkpoint"
        )
    header = Llama2cHeader(**fields, vocab_size=abs(vocab), shared_classifier=vocab > 0)
    try:
        _model_args(header)
    except ValueError as e:
        raise ValueError(f"llama2.c checkpoint {path}: header {header}: {e}") from None
    expected = header.file_bytes()
    if size != expected:
        what = "truncated" if size < expected else f"{size - expected} bytes too long"
        raise ValueError(
            f"llama2.c checkpoint {path}: {size} bytes, but its header (dim {dim}, hidden "
            f"{hidden}, {n_layers} layers, {n_heads} heads, {n_kv} kv heads, vocab {vocab}, "
            f"seq_len {seq_len}) needs exactly {expected}: {what}"
        )
    return header


def read_checkpoint(path: str | os.PathLike) -> tuple[Llama2cHeader, dict[str, torch.Tensor]]:
    """``(header, Meta-named fp32 state dict)`` of llama2.c checkpoint ``path``.

    Every tensor owns its storage (no view of one big buffer: ``torch.save`` would write the
    whole buffer once per view); ``output.weight`` is a copy of the embedding when shared.
    """
    path = Path(path)
    header = read_header(path)
    flat = np.fromfile(path, dtype="<f4", offset=HEADER_BYTES).astype(np.float32, copy=False)
    arrays, start = {}, 0
    for name, shape in header.tensor_shapes():
        n = int(np.prod(shape))
        arrays[name] = torch.from_numpy(flat[start : start + n].reshape(shape))
        start += n
    _check_rope_tables(path, header, arrays["freq_cis_real"], arrays["freq_cis_imag"])
    emb = arrays["token_embedding_table"]
    state = {
        "tok_embeddings.weight": emb.clone(),
        "norm.weight": arrays["rms_final_weight"].clone(),
        "output.weight": (emb if header.shared_classifier else arrays["wcls"]).clone(),
    }
    for layer in range(header.n_layers):
        for src, name in _LAYER_NAMES.items():
            state[name.format(layer)] = arrays[src][layer].clone()
    return header, state


def _check_rope_tables(
    path: Path, header: Llama2cHeader, real: torch.Tensor, imag: torch.Tensor
) -> None:
    """The stored freq_cis tables must be RoPE's cos/sin (run.c ignores them; here they prove
    the arrays before them were read at the right offsets)."""
    hs = header.head_size
    freqs = 1.0 / (ROPE_THETA ** (torch.arange(0, hs, 2, dtype=torch.float64) / hs))
    angles = torch.outer(torch.arange(header.seq_len, dtype=torch.float64), freqs)
    # fp32 angles of an exporter round by up to |angle| * 2^-24 each step: allow a few ulps.
    tol = 1e-4 + 4 * header.seq_len * 2.0**-24
    err = max(
        float((real.double() - angles.cos()).abs().max()),
        float((imag.double() - angles.sin()).abs().max()),
    )
    if not err <= tol:  # NaN fails too
        raise ValueError(
            f"llama2.c checkpoint {path}: the stored RoPE tables (freq_cis_real/imag) differ "
            f"from cos/sin(pos * {ROPE_THETA:g}^(-2i/{hs})) by {err:.3g} (> {tol:.2g}): not a "
            "version-0 layout this reader understands (re-laid-out or corrupt weights?)"
        )


# -------------------------------------------------------------------------------------- params


def ffn_params(dim: int, hidden_dim: int) -> dict[str, int | float]:
    """``multiple_of`` (and ``ffn_dim_multiplier`` only when needed) for which Meta's FFN rule
    (``config.meta_hidden_dim``) gives exactly ``hidden_dim``: llama_org and Nakta both derive
    the width from params.json, so it must come out as the file's.

    The largest power of two that works (llama2.c's own models: ``multiple_of`` 32, or 4 for
    stories260K); else ``multiple_of = hidden_dim`` when the rule's base width does not exceed
    it; else a multiplier with ``multiple_of`` 1.
    """
    for exp in range(12, -1, -1):
        if meta_hidden_dim(dim, 2**exp) == hidden_dim:
            return {"multiple_of": 2**exp}
    if meta_hidden_dim(dim, hidden_dim) == hidden_dim:
        return {"multiple_of": hidden_dim}
    base = int(2 * (4 * dim) / 3)
    multiplier = hidden_dim / base
    for _ in range(4):  # hidden/base may land one ulp below what int() needs
        if meta_hidden_dim(dim, 1, multiplier) == hidden_dim:
            return {"multiple_of": 1, "ffn_dim_multiplier": multiplier}
        multiplier = float(np.nextafter(multiplier, np.inf))
    raise ValueError(
        f"no multiple_of / ffn_dim_multiplier gives hidden_dim {hidden_dim} for dim {dim}"
    )


def meta_params(header: Llama2cHeader, max_seq_len: int | None = None) -> dict[str, int | float]:
    """Meta's ``params.json`` for ``header`` (``n_kv_heads`` stated; ``max_seq_len`` the
    header's ``seq_len`` unless given)."""
    if max_seq_len is not None and (
        isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1
    ):
        raise ValueError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
    return {
        "dim": header.dim,
        "n_layers": header.n_layers,
        "n_heads": header.n_heads,
        "n_kv_heads": header.n_kv_heads,
        "vocab_size": header.vocab_size,
        **ffn_params(header.dim, header.hidden_dim),
        "norm_eps": NORM_EPS,
        "max_seq_len": header.seq_len if max_seq_len is None else max_seq_len,
    }


def _model_args(header: Llama2cHeader) -> ModelArgs:
    """The ``ModelArgs`` the output's params.json gives (its checks name the bad field)."""
    args = ModelArgs.from_meta_params(meta_params(header))
    if args.hidden_dim != header.hidden_dim:  # ffn_params guarantees it; say so if not
        raise ValueError(f"params give hidden_dim {args.hidden_dim}, file has {header.hidden_dim}")
    return args


# ----------------------------------------------------------------------------------- tokenizer


def read_tokenizer(path: str | os.PathLike, vocab_size: int) -> list[tuple[str, float]]:
    """``(piece, score)`` per id of llama2.c tokenizer ``path`` (``run.c`` format: int32
    max_token_length, then per id float32 score, int32 length, the bytes), spaces as stored.

    ``vocab_size`` comes from the model (the file does not store it); the file must hold
    exactly that many entries.
    """
    path = Path(path)
    data = path.read_bytes()
    if len(data) < 4:
        raise ValueError(f"llama2.c tokenizer {path}: {len(data)} bytes, no max_token_length")
    (max_len,) = struct.unpack_from("<i", data)
    offset, pieces = 4, []
    for i in range(vocab_size):
        if offset + 8 > len(data):
            raise ValueError(
                f"llama2.c tokenizer {path}: truncated at entry {i} of {vocab_size} (the model's "
                "vocab size): wrong tokenizer for this model?"
            )
        score, length = struct.unpack_from("<fi", data, offset)
        offset += 8
        if not 0 < length <= max_len or offset + length > len(data):
            raise ValueError(
                f"llama2.c tokenizer {path}: entry {i} has length {length} (max_token_length "
                f"{max_len}, {len(data) - offset} bytes left): corrupt or not a tokenizer .bin"
            )
        try:
            piece = data[offset : offset + length].decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"llama2.c tokenizer {path}: entry {i} is not UTF-8") from None
        offset += length
        pieces.append((piece, score))
    if offset != len(data):
        raise ValueError(
            f"llama2.c tokenizer {path}: {len(data) - offset} bytes left after {vocab_size} "
            "entries (the model's vocab size): wrong tokenizer for this model?"
        )
    return pieces


def tokenizer_model_proto(pieces: Sequence[tuple[str, float]], source: str = "tokenizer") -> bytes:
    """A serialized SentencePiece BPE ``ModelProto`` with these ``(piece, score)`` ids.

    LLaMA's conventions, as llama2.c's ``train_vocab`` trains them: ids 0-2 ``<unk>``, ``<s>``,
    ``</s>`` (UNKNOWN, CONTROL); ``<0xNN>`` pieces are BYTE pieces with byte fallback (all
    256 or none); identity normalization, a dummy ``▁`` prefix, spaces written as ``▁``.
    """
    from sentencepiece import sentencepiece_model_pb2 as pb

    if len(pieces) < 3:
        raise ValueError(f"{source}: {len(pieces)} pieces, need at least <unk>, <s>, </s>")
    for i, allowed in enumerate(_SPECIAL):
        if pieces[i][0] not in allowed:
            raise ValueError(
                f"{source}: id {i} is {pieces[i][0]!r}, expected {allowed[0]!r} (llama2.c "
                "tokenizers keep SentencePiece's unk=0, bos=1, eos=2)"
            )
    model = pb.ModelProto()
    seen, n_bytes = set(), 0
    for i, (text, score) in enumerate(pieces):
        if i < 3:
            piece = _SPECIAL[i][0]
            kind = (
                pb.ModelProto.SentencePiece.UNKNOWN
                if i == 0
                else pb.ModelProto.SentencePiece.CONTROL
            )
        elif _BYTE_PIECE.fullmatch(text):
            piece, kind = text, pb.ModelProto.SentencePiece.BYTE
            n_bytes += 1
        else:
            if "\u2581" in text:
                raise ValueError(
                    f"{source}: piece {i} {text!r} holds '\u2581', which the .bin format uses "
                    "for nothing (spaces are stored as spaces): cannot rebuild it unambiguously"
                )
            piece, kind = text.replace(" ", "\u2581"), pb.ModelProto.SentencePiece.NORMAL
        if piece in seen:
            raise ValueError(f"{source}: piece {piece!r} (id {i}) appears twice")
        seen.add(piece)
        model.pieces.add(piece=piece, score=score, type=kind)
    if n_bytes not in (0, 256):
        raise ValueError(f"{source}: {n_bytes} <0xNN> byte pieces; byte fallback needs all 256")
    spec = model.trainer_spec
    spec.model_type = pb.TrainerSpec.BPE
    spec.vocab_size = len(pieces)
    spec.byte_fallback = n_bytes == 256
    spec.split_digits = True
    spec.allow_whitespace_only_pieces = True
    spec.treat_whitespace_as_suffix = False
    spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id = 0, 1, 2, -1
    spec.unk_piece, spec.bos_piece, spec.eos_piece = "<unk>", "<s>", "</s>"
    spec.unk_surface = " \u2047 "
    norm = model.normalizer_spec  # field for field the LLaMA tokenizer's
    norm.name = "identity"
    norm.precompiled_charsmap = b""
    norm.add_dummy_prefix = True
    norm.remove_extra_whitespaces = False
    norm.normalization_rule_tsv = ""
    return model.SerializeToString()


# ------------------------------------------------------------------------------------- convert


def _only_our_files(path: Path) -> None:
    """``--force`` replaces a directory that holds nothing but what this tool writes."""
    extra = sorted(set(os.listdir(path)) - set(OUTPUT_FILES))
    if extra:
        raise ValueError(
            f"output {path} holds files this tool did not write ({', '.join(extra[:5])}); "
            "--force replaces only a previous output of nakta_model.llama2c"
        )


def convert(
    model_path: str | os.PathLike,
    tokenizer_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    force: bool = False,
    max_seq_len: int | None = None,
) -> Path:
    """llama2.c ``model_path`` + ``tokenizer_path`` -> Meta checkpoint directory ``out_dir``;
    every input is read and checked before the output directory is created."""
    model_path, tokenizer_path, out_dir = Path(model_path), Path(tokenizer_path), Path(out_dir)
    for what, p in (("llama2.c checkpoint", model_path), ("llama2.c tokenizer", tokenizer_path)):
        if not p.is_file():
            raise ValueError(f"{what} {p}: no such file")
    check_output_dir(out_dir, force, may_replace=_only_our_files)
    header, state = read_checkpoint(model_path)
    params = meta_params(header, max_seq_len)
    pieces = read_tokenizer(tokenizer_path, header.vocab_size)
    proto = tokenizer_model_proto(pieces, source=f"llama2.c tokenizer {tokenizer_path}")
    with atomic_output_dir(out_dir, force, may_replace=_only_our_files) as tmp:
        (tmp / "params.json").write_text(json.dumps(params) + "\n")
        torch.save(state, tmp / "consolidated.00.pth")
        (tmp / "tokenizer.model").write_bytes(proto)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp made it 0700: a checkpoint is meant to be shared
    return out_dir


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nakta_model.llama2c", description=__doc__.split("\n\n")[0].strip()
    )
    parser.add_argument("model", type=Path, help="llama2.c checkpoint (version 0), e.g. x.bin")
    parser.add_argument("tokenizer", type=Path, help="its llama2.c tokenizer .bin")
    parser.add_argument("out_dir", type=Path, help="Meta checkpoint directory to create")
    parser.add_argument(
        "--max-seq-len",
        type=int,
        help="params.json max_seq_len (default: the header's seq_len, the trained length)",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace an earlier output of this tool"
    )
    ns = parser.parse_args(argv)
    try:
        out = convert(
            ns.model, ns.tokenizer, ns.out_dir, force=ns.force, max_seq_len=ns.max_seq_len
        )
    except (ValueError, OSError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted; no partial output left behind", file=sys.stderr)
        return 130
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
