"""One tokenizer interface over the three kinds a LLaMA-family checkpoint ships.

* :class:`Tokenizer`: a SentencePiece ``tokenizer.model`` (LLaMA-1/2, TinyLlama, Mistral v1/v3);
* :class:`TiktokenTokenizer`: Meta's Llama-3 ``tokenizer.model``, a tiktoken BPE rank file
  (``base64 rank`` a line), with Meta's 256 special tokens after its ranks and Meta's
  pre-tokenizer regex, as ``llama_models/llama3/tokenizer.py`` defines them;
* :class:`HFTokenizer`: a HF ``tokenizer.json`` (the ``tokenizers`` package), its BOS / EOS and
  stop ids from ``tokenizer_config.json``, ``generation_config.json`` and ``config.json`` beside it.

Every kind has Meta's interface: ``encode(s, bos, eos)``, ``encode_many``, ``decode``,
``bos_id``, ``eos_id``, ``pad_id`` (-1: none), ``n_words`` (ids run ``0 .. n_words - 1``) and
``stop_ids`` (every id that ends a generation). :func:`load_tokenizer` picks the kind from what a
file or a checkpoint folder holds. Meta's and HF's code are re-implemented here, not imported:
``nakta_model`` never imports the reference it is checked against.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "HFTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "TokenizerBase",
    "TokenizerError",
    "check_fits_vocab",
    "find_tokenizer",
    "load_tokenizer",
    "tokenizer_files",
]

HF_TOKENIZER = "tokenizer.json"
MODEL_FILE = "tokenizer.model"
# what a converted checkpoint must carry for load_tokenizer to read the same tokenizer (the
# configs give an HF folder's BOS / EOS / stop ids and chat template)
TOKENIZER_FILES = (
    HF_TOKENIZER,
    MODEL_FILE,
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


class TokenizerError(ValueError):
    """A tokenizer that cannot be read: ``reason`` says why, without the path (a CLI puts its
    option name and the path in front)."""

    def __init__(self, path: str | os.PathLike, reason: str):
        super().__init__(f"tokenizer {path}: {reason}")
        self.path, self.reason = str(path), reason


def _check_strings(strings: Sequence[str], name: str) -> list[str]:
    strings = list(strings)
    for s in strings:
        if type(s) is not str:
            raise TypeError(f"{name} must hold str only, got {type(s).__name__}")
    return strings


class TokenizerBase:
    """What every kind provides (see the module doc). ``kind``: ``"sentencepiece"``,
    ``"tiktoken"`` or ``"hf"``; ``special_tokens``: text -> id of the tokens a chat format or a
    stop list names (empty for SentencePiece); ``chat_template``: an HF folder's jinja template
    (None elsewhere)."""

    kind: str = ""
    path: str
    n_words: int
    bos_id: int
    eos_id: int
    pad_id: int
    stop_ids: tuple[int, ...]
    special_tokens: dict[str, int]
    chat_template: str | None = None
    template_tokens: dict[str, str] = {}  # noqa: RUF012 - what a chat template sees (HF only)

    def _encode_plain(self, s: str) -> list[int]:
        raise NotImplementedError

    def _encode_plain_many(self, strings: list[str], num_threads: int) -> list[list[int]]:
        return [self._encode_plain(s) for s in strings]

    def encode(self, s: str, bos: bool, eos: bool) -> list[int]:
        """``s``'s ids, BOS first when ``bos``, EOS last when ``eos``."""
        if type(s) is not str:
            raise TypeError(f"s must be a str, got {type(s).__name__}")
        t = self._encode_plain(s)
        if bos:
            t = [self._bos()] + t
        if eos:
            t = t + [self.eos_id]
        return t

    def encode_many(
        self, strings: Sequence[str], bos: bool, eos: bool, num_threads: int = -1
    ) -> list[list[int]]:
        """``[encode(s, bos, eos) for s in strings]`` in one batched call over ``num_threads``
        threads (-1: every core): lm-eval's request tokenization encodes thousands of few-shot
        contexts, and one string per call is the slow way."""
        strings = _check_strings(strings, "strings")
        if not strings:
            return []
        out = self._encode_plain_many(strings, num_threads)
        head, tail = [self._bos()] if bos else [], [self.eos_id] if eos else []
        if head or tail:
            out = [head + t + tail for t in out]
        return out

    def encode_special(self, text: str) -> list[int]:
        """``text`` with the text of special tokens read as those tokens (a rendered chat
        prompt), no BOS added; for SentencePiece, plain :meth:`encode`."""
        if type(text) is not str:
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self._encode_plain(text)

    def decode(self, t: Sequence[int]) -> str:
        raise NotImplementedError

    def token_id(self, text: str) -> int | None:
        """The id of special token ``text`` (``"<|eot_id|>"``), None when it has none."""
        return self.special_tokens.get(text)

    def _bos(self) -> int:
        if self.bos_id < 0:
            raise ValueError(f"tokenizer {self.path} has no BOS token: encode with bos=False")
        return self.bos_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, n_words={self.n_words})"


# ------------------------------------------------------------------------------ SentencePiece


class Tokenizer(TokenizerBase):
    """A SentencePiece model with Meta's LLaMA interface; ``pad_id`` is -1 for LLaMA (no pad
    piece) and ``stop_ids`` is ``(eos_id,)``."""

    kind = "sentencepiece"

    def __init__(self, model_path: str | os.PathLike):
        from sentencepiece import SentencePieceProcessor

        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"tokenizer model_path {str(model_path)!r} is not a file")
        self.path = self.model_path = str(model_path)
        self.sp_model = SentencePieceProcessor(model_file=self.model_path)
        self.n_words: int = self.sp_model.vocab_size()
        self.bos_id: int = self.sp_model.bos_id()
        self.eos_id: int = self.sp_model.eos_id()
        self.pad_id: int = self.sp_model.pad_id()
        self.stop_ids = (self.eos_id,) if self.eos_id >= 0 else ()
        self.special_tokens = {}
        if self.sp_model.vocab_size() != self.sp_model.get_piece_size():
            raise ValueError(f"tokenizer {model_path}: vocab_size != piece count")

    def _encode_plain(self, s: str) -> list[int]:
        return self.sp_model.encode(s)

    def _encode_plain_many(self, strings: list[str], num_threads: int) -> list[list[int]]:
        return self.sp_model.encode(strings, num_threads=num_threads)

    def decode(self, t: Sequence[int]) -> str:
        return self.sp_model.decode(list(t))


SentencePieceTokenizer = Tokenizer


# ------------------------------------------------------------------------- Meta's tiktoken BPE

# Meta's Llama-3 special tokens, in id order after the BPE ranks (llama_models/llama3/tokenizer.py),
# then reserved ones up to 256 in all
LLAMA3_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",  # end of message (a tool call)
    "<|eot_id|>",  # end of turn
    "<|python_tag|>",
    "<|image|>",
)
LLAMA3_NUM_SPECIAL = 256
LLAMA3_NUM_RANKS = 128_000
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Meta's limits around tiktoken (its Rust core panics on longer runs): a string is encoded in
# pieces of at most 400,000 characters, each cut where a run of whitespace or non-whitespace
# passes 25,000 characters; the same cuts keep the ids identical to Meta's
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000
_RANK_LINE = re.compile(rb"[A-Za-z0-9+/]+={0,2} \d+")


def _llama3_special_names() -> list[str]:
    reserved = [
        f"<|reserved_special_token_{2 + i}|>"
        for i in range(LLAMA3_NUM_SPECIAL - len(LLAMA3_SPECIAL_TOKENS))
    ]
    return list(LLAMA3_SPECIAL_TOKENS) + reserved


def _is_tiktoken_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` starts like a tiktoken rank file (``base64 rank`` lines); a
    SentencePiece model is a binary protobuf and never does."""
    with open(path, "rb") as f:
        first = f.readline(4096).rstrip(b"\r\n")
    return _RANK_LINE.fullmatch(first) is not None


def read_tiktoken_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """A tiktoken rank file as ``{token bytes: rank}``; every line must read and the ranks must
    be ``0 .. n - 1`` (the special tokens' ids follow them)."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            if _RANK_LINE.fullmatch(line) is None:
                raise ValueError(f"{path}: line {lineno} is not 'base64 rank'")
            token, rank = line.split()
            try:
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except binascii.Error as e:
                raise ValueError(f"{path}: line {lineno}: bad base64 ({e})") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: the {len(ranks)} ranks are not 0 .. {len(ranks) - 1}")
    return ranks


def _split_runs(s: str, max_run: int) -> Iterator[str]:
    """Meta's ``_split_whitespaces_or_nonwhitespaces``: pieces of ``s`` with no run of
    whitespace or of non-whitespace longer than ``max_run`` characters."""
    run = 0
    is_space = s[0].isspace() if s else False
    start = 0
    for i, ch in enumerate(s):
        now = ch.isspace()
        if is_space ^ now:
            run, is_space = 1, now
        else:
            run += 1
            if run > max_run:
                yield s[start:i]
                start, run = i, 1
    yield s[start:]


def _meta_pieces(s: str) -> list[str]:
    return [
        piece
        for i in range(0, len(s), _MAX_ENCODE_CHARS)
        for piece in _split_runs(s[i : i + _MAX_ENCODE_CHARS], _MAX_RUN_CHARS)
    ]


class TiktokenTokenizer(TokenizerBase):
    """Meta's Llama-3 tokenizer: a tiktoken BPE rank file, Meta's 256 special tokens after the
    ranks and Meta's regex. Text is encoded as plain text (a special token's text in it is
    not that token), as Meta's ``encode`` does by default; ``stop_ids`` are Meta's
    ``<|end_of_text|>``, ``<|eom_id|>`` and ``<|eot_id|>``."""

    kind = "tiktoken"

    def __init__(self, model_path: str | os.PathLike):
        import tiktoken

        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"tokenizer model_path {str(model_path)!r} is not a file")
        self.path = str(model_path)
        ranks = read_tiktoken_ranks(model_path)
        if len(ranks) != LLAMA3_NUM_RANKS:
            # Llama-4's file (200,000 ranks) has other specials and another regex
            raise ValueError(
                f"{model_path}: a tiktoken file of {len(ranks)} ranks; only Meta's Llama-3 "
                f"tokenizer ({LLAMA3_NUM_RANKS} ranks) is supported"
            )
        n = len(ranks)
        self.special_tokens = {name: n + i for i, name in enumerate(_llama3_special_names())}
        self.model = tiktoken.Encoding(
            name=Path(model_path).name,
            pat_str=LLAMA3_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.n_words = n + len(self.special_tokens)
        self.bos_id = self.special_tokens["<|begin_of_text|>"]
        self.eos_id = self.special_tokens["<|end_of_text|>"]
        self.pad_id = self.special_tokens["<|finetune_right_pad_id|>"]
        self.eot_id = self.special_tokens["<|eot_id|>"]
        self.eom_id = self.special_tokens["<|eom_id|>"]
        self.stop_ids = (self.eos_id, self.eom_id, self.eot_id)
        self._special_re = re.compile(
            "(" + "|".join(re.escape(t) for t in self.special_tokens) + ")"
        )

    def _encode_plain(self, s: str) -> list[int]:
        out: list[int] = []
        for piece in _meta_pieces(s):
            out.extend(self.model.encode_ordinary(piece))
        return out

    def _encode_plain_many(self, strings: list[str], num_threads: int) -> list[list[int]]:
        pieces, owner = [], []
        for i, s in enumerate(strings):
            for piece in _meta_pieces(s):
                pieces.append(piece)
                owner.append(i)
        threads = num_threads if num_threads > 0 else (os.cpu_count() or 1)
        encoded = self.model.encode_ordinary_batch(pieces, num_threads=threads)
        out: list[list[int]] = [[] for _ in strings]
        for i, ids in zip(owner, encoded):
            out[i].extend(ids)
        return out

    def encode_special(self, text: str) -> list[int]:
        """``text`` with its special tokens' text read as those tokens (a rendered chat
        prompt); plain text in between is encoded as :meth:`encode` does, except that the
        ``"\n\n"`` after ``<|end_header_id|>`` is encoded apart from what follows, as Meta's
        ``ChatFormat`` encodes a header: a rendered dialog reads back to Meta's ids."""
        if type(text) is not str:
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        out: list[int] = []
        after_header = False
        for part in self._special_re.split(text):
            if part in self.special_tokens:
                out.append(self.special_tokens[part])
                after_header = part == "<|end_header_id|>"
                continue
            if after_header and part.startswith("\n\n"):
                out.extend(self._encode_plain("\n\n"))
                part = part[2:]
            if part:
                out.extend(self._encode_plain(part))
            after_header = False
        return out

    def decode(self, t: Sequence[int]) -> str:
        return self.model.decode(list(t))


# ---------------------------------------------------------------------------- HF tokenizer.json


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any) -> str | None:
    """A tokenizer_config token entry: a string, or an AddedToken dict with ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """The folder's default chat template: ``chat_template.jinja`` (transformers >= 4.43 writes
    it apart) else tokenizer_config.json's ``chat_template`` (a string, or a list of named
    templates of which ``default`` is used)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


_LLAMA_CLASSES = ("LlamaTokenizer", "LlamaTokenizerFast")


def _llama_pipeline(model, tok_config: dict[str, Any]) -> None:
    """What transformers (5.x) ``LlamaTokenizer`` does to a SentencePiece-converted
    tokenizer.json (Llama-2, TinyLlama, Mistral folders): it keeps the file's BPE but replaces
    the text pipeline by a Metaspace pre-tokenizer whose word-start ``▁`` goes before the first
    piece only (``legacy: false``, its default) or after every special token too
    (``legacy: true``), none with ``add_prefix_space: false``. Without it, text right after a
    special token (``<s>[INST]``) would get another ``▁`` than AutoTokenizer gives it."""
    from tokenizers import decoders, pre_tokenizers

    add_prefix_space = tok_config.get("add_prefix_space")
    add_prefix_space = True if add_prefix_space is None else bool(add_prefix_space)
    scheme = "never"
    if add_prefix_space:
        scheme = "always" if tok_config.get("legacy", False) else "first"
    model.normalizer = None
    model.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme=scheme, split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))
    model.decoder = decoders.Sequence(steps)


class HFTokenizer(TokenizerBase):
    """A HF ``tokenizer.json``, as ``AutoTokenizer`` reads it: text is split on its added
    tokens (a special token's text in the input IS that token, as in HF), decoding keeps the
    special tokens. ``bos_id`` / ``eos_id`` come from ``tokenizer_config.json``'s ``bos_token`` /
    ``eos_token`` (else ``config.json``'s, ``generation_config.json``'s ids); ``stop_ids`` are
    ``generation_config.json``'s ``eos_token_id`` (one id or a list, else ``config.json``'s)
    with ``eos_id``, what HF's ``generate`` stops on."""

    kind = "hf"

    def __init__(self, tokenizer_json: str | os.PathLike):
        from tokenizers import Tokenizer as RustTokenizer

        path = Path(tokenizer_json)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {str(path)!r} is not a file")
        self.path = str(path)
        try:
            self.model = RustTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the Rust side raises its own exception types
            raise ValueError(f"{path}: the tokenizers package cannot read it ({e})") from e
        folder = path.parent
        tok_config = _read_json(folder / "tokenizer_config.json")
        gen_config = _read_json(folder / "generation_config.json")
        config = _read_json(folder / "config.json")
        if tok_config.get("tokenizer_class") in _LLAMA_CLASSES:
            _llama_pipeline(self.model, tok_config)
        vocab = self.model.get_vocab(with_added_tokens=True)
        self.n_words = max(vocab.values()) + 1 if vocab else 0
        added = self.model.get_added_tokens_decoder()
        self.special_tokens = {t.content: i for i, t in added.items() if t.special}

        def config_id(key: str) -> int:
            text = _token_text(tok_config.get(key))
            if text is not None:
                tid = self.model.token_to_id(text)
                if tid is None:
                    raise ValueError(
                        f"{folder / 'tokenizer_config.json'}: {key} {text!r} is not in {path.name}"
                    )
                return tid
            for source in (config, gen_config):
                ids = _id_list(source.get(f"{key}_id"))
                if ids:
                    return ids[0]
            return -1

        self.bos_id = config_id("bos_token")
        self.eos_id = config_id("eos_token")
        self.pad_id = config_id("pad_token")
        stops = _id_list(gen_config.get("eos_token_id")) or _id_list(config.get("eos_token_id"))
        if self.eos_id >= 0:
            stops.append(self.eos_id)
        self.stop_ids = tuple(dict.fromkeys(stops))
        self.chat_template = _chat_template(folder, tok_config)
        # what a chat template sees besides the messages (transformers passes these)
        self.template_tokens = {
            key: text
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (text := _token_text(tok_config.get(key))) is not None
        }

    def _encode_plain(self, s: str) -> list[int]:
        return self.model.encode(s, add_special_tokens=False).ids

    def _encode_plain_many(self, strings: list[str], num_threads: int) -> list[list[int]]:
        # threads: the tokenizers package's own pool (RAYON_NUM_THREADS)
        return [e.ids for e in self.model.encode_batch(strings, add_special_tokens=False)]

    def decode(self, t: Sequence[int]) -> str:
        return self.model.decode(list(t), skip_special_tokens=False)


# ------------------------------------------------------------------------------------ factory


def find_tokenizer(folder: str | os.PathLike) -> Path | None:
    """The tokenizer file a folder holds: ``tokenizer.json`` (a HF folder: what AutoTokenizer
    reads, even beside a ``tokenizer.model``), else ``tokenizer.model``; None when neither."""
    folder = Path(folder)
    for name in (HF_TOKENIZER, MODEL_FILE):
        if (folder / name).is_file():
            return folder / name
    return None


def tokenizer_files(folder: str | os.PathLike) -> list[Path]:
    """The tokenizer files of ``folder`` (:data:`TOKENIZER_FILES` present in it), what a
    converter copies beside the weights."""
    return [Path(folder) / n for n in TOKENIZER_FILES if (Path(folder) / n).is_file()]


def load_tokenizer(path: str | os.PathLike) -> TokenizerBase:
    """The tokenizer of ``path``: a checkpoint folder (its :func:`find_tokenizer` file), a
    ``*.json`` (HF ``tokenizer.json``; its configs read from its folder) or a
    ``tokenizer.model`` (Meta's tiktoken rank file when it reads as one, else SentencePiece).
    Anything else, or a file that does not read, is a one-line :class:`TokenizerError`."""
    p = Path(path)
    if p.is_dir():
        found = find_tokenizer(p)
        if found is None:
            raise TokenizerError(
                p,
                f"no {HF_TOKENIZER} or {MODEL_FILE} in this folder (expected a HF "
                "tokenizer.json, a SentencePiece model or a Llama-3 tiktoken file)",
            )
        p = found
    elif not p.exists():
        raise TokenizerError(p, "no such file or folder")
    elif not p.is_file():
        raise TokenizerError(p, "not a file or folder")
    if p.suffix == ".json":
        kind, what = HFTokenizer, "not a HF tokenizer.json"
    elif _is_tiktoken_file(p):
        kind, what = TiktokenTokenizer, "not a Llama-3 tiktoken file"
    else:
        kind, what = Tokenizer, "not a SentencePiece model"
    try:
        return kind(p)
    except (OSError, RuntimeError, ValueError) as e:
        detail = " ".join(str(e).split()).removeprefix(f"{p}: ")  # the path is said once
        raise TokenizerError(p, f"{what} ({detail})") from e


def check_fits_vocab(tokenizer: TokenizerBase, vocab_size: int, checkpoint: object = "") -> None:
    """A tokenizer whose ids run past the model's embedding is another model's: one line with
    both sizes. (A smaller tokenizer is fine: vocabularies padded for the GPU are common.)"""
    if tokenizer.n_words > vocab_size:
        where = f" of checkpoint {checkpoint}" if checkpoint else ""
        raise ValueError(
            f"tokenizer {tokenizer.path} has {tokenizer.n_words} tokens, more than the "
            f"vocab_size {vocab_size}{where}: not this model's tokenizer"
        )
