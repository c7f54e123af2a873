"""ModelArgs: one dataclass for every LLaMA shape, read from Meta ``params.json`` or HF ``config.json``.

Everything the model, the checkpoint code and the benchmarks need about a shape lives here, so a
wrong config fails once, early, with a message that names the field -- not as a shape error deep
inside a GEMM.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

__all__ = ["META_PARAMS_KEYS", "ModelArgs", "PRESETS", "meta_hidden_dim", "preset"]

# params.json keys that are read without becoming a ModelArgs field: llama_org's runtime batch
# size and the metadata a Nakta checkpoint's params.json carries (see checkpoint.py).
_IGNORED_PARAMS_KEYS = frozenset(
    {"max_batch_size", "tp_size", "format_version", "dtype", "quant"}  # storage, not the model
)


def meta_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None = None) -> int:
    """Meta's FFN width rule: ``int(2 * 4 * dim / 3)``, scaled, rounded up to ``multiple_of``."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """Shape and numerics of a LLaMA model (Meta ``params.json`` names).

    ``hidden_dim`` is derived by Meta's rule unless given (HF configs state it directly).
    ``rope_interleaved`` says how q/k pairs are rotated: True for Meta's adjacent pairs
    ``(x[2j], x[2j+1])`` (Nakta checkpoints always store this layout), False for HF's halves.
    """

    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    n_kv_heads: int | None = None
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    hidden_dim: int | None = None
    rope_interleaved: bool = True
    sliding_window: int | None = None  # Mistral: a query sees its last ``sliding_window`` keys

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.hidden_dim is None:
            _check_positive("dim", self.dim)
            _check_positive("multiple_of", self.multiple_of)
            if self.ffn_dim_multiplier is not None:
                _check_positive_number("ffn_dim_multiplier", self.ffn_dim_multiplier)
            object.__setattr__(
                self,
                "hidden_dim",
                meta_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier),
            )
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (1 without GQA)."""
        return self.n_heads // self.n_kv_heads

    @property
    def qkv_dim(self) -> int:
        """Output rows of the fused ``wqkv`` (unsplit): Q heads, then K heads, then V heads."""
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    def n_params(self) -> int:
        """Parameter count (embedding and LM head counted separately, as Meta does)."""
        d, f, v = self.dim, self.hidden_dim, self.vocab_size
        attn = d * self.qkv_dim + self.n_heads * self.head_dim * d
        ffn = 3 * d * f
        per_layer = attn + ffn + 2 * d
        return self.n_layers * per_layer + 2 * v * d + d

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise ``ValueError`` naming the field when the shape cannot be a LLaMA model."""
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "max_seq_len"):
            _check_positive(name, getattr(self, name))
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int):
            raise ValueError(f"vocab_size must be an int, got {self.vocab_size!r}")
        if self.vocab_size <= 0:
            raise ValueError(
                f"vocab_size must be > 0, got {self.vocab_size} (Meta's params.json uses -1 as a "
                "placeholder: pass vocab_size from the tokenizer or the embedding shape)"
            )
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim = dim / n_heads = {self.head_dim} must be even (RoPE rotates pairs)"
            )
        _check_positive_number("norm_eps", self.norm_eps)
        _check_positive_number("rope_theta", self.rope_theta)
        if self.sliding_window is not None:
            _check_positive("sliding_window", self.sliding_window)
        if not isinstance(self.rope_interleaved, bool):
            raise ValueError(
                f"rope_interleaved must be true or false, got {self.rope_interleaved!r}"
            )

    def check_tp(self, tp_size: int) -> None:
        """Raise ``ValueError`` when ``tp_size`` cannot split heads, KV heads, FFN or vocab."""
        _check_positive("tp_size", tp_size)
        for name, value in (
            ("n_heads", self.n_heads),
            ("n_kv_heads", self.n_kv_heads),
            ("hidden_dim (FFN width)", self.hidden_dim),
            ("vocab_size", self.vocab_size),
        ):
            if value % tp_size:
                raise ValueError(f"tensor-parallel size {tp_size} does not divide {name} = {value}")

    # ------------------------------------------------------------------ readers
    @classmethod
    def from_meta_params(
        cls, params: dict[str, Any], vocab_size: int | None = None, **overrides: Any
    ) -> ModelArgs:
        """From Meta's ``params.json`` dict; ``vocab_size`` replaces Meta's ``-1`` placeholder.

        Known keys: llama_org's ``ModelArgs`` set (Meta's LLaMA-1/2 ``params.json``), Nakta's own
        fields (``hidden_dim``, ``rope_interleaved``) and a Nakta checkpoint's metadata, so its
        ``params.json`` reads back through the same function. Any other key is refused: it means
        a model this code would silently run wrong (e.g. Llama-3.1's ``use_scaled_rope``).
        """
        if not isinstance(params, dict):
            raise TypeError(
                f"params must be a dict (params.json object), got {type(params).__name__}"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - fields - _IGNORED_PARAMS_KEYS)
        if unknown:
            raise ValueError(
                f"params.json has unknown key(s) {unknown}; known keys: {sorted(META_PARAMS_KEYS)}"
            )
        kw = {k: v for k, v in params.items() if k in fields}
        if "dim" not in kw or "n_layers" not in kw or "n_heads" not in kw:
            raise ValueError(
                f"params.json needs dim, n_layers and n_heads; got keys {sorted(params)}"
            )
        stated = kw.get("vocab_size")
        if stated in (None, -1):
            if vocab_size is None:
                raise ValueError(
                    "vocab_size in params.json is -1/missing: pass vocab_size "
                    "(from the tokenizer or the embedding shape)"
                )
            kw["vocab_size"] = vocab_size
        elif vocab_size is not None and vocab_size != stated:
            raise ValueError(
                f"vocab_size {vocab_size} disagrees with params.json vocab_size {stated}"
            )
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], **overrides: Any) -> ModelArgs:
        """From a HF LLaMA ``config.json`` dict. HF checkpoints store q/k permuted for
        rotate-half RoPE; ``layout.unpermute_hf`` undoes that, so the result keeps
        ``rope_interleaved=True`` (Meta pairing) like every Nakta checkpoint."""
        model_type = config.get("model_type", "llama")
        if model_type != "llama":
            raise ValueError(f"config.json model_type must be 'llama', got {model_type!r}")
        if config.get("rope_scaling") not in (None, {}):
            raise ValueError(
                f"config.json rope_scaling={config['rope_scaling']!r} is not supported "
                "(LLaMA-1 uses plain RoPE)"
            )
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if key not in config:
                raise ValueError(f"config.json is missing {key!r}")
        dim, n_heads = config["hidden_size"], config["num_attention_heads"]
        if config.get("head_dim") not in (None, dim // max(n_heads, 1)):
            raise ValueError(
                f"config.json head_dim={config['head_dim']} differs from hidden_size / "
                f"num_attention_heads = {dim // n_heads}; not a LLaMA-1 layout"
            )
        if "intermediate_size" not in config:
            raise ValueError("config.json is missing 'intermediate_size'")
        kw = dict(
            dim=dim,
            n_layers=config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            vocab_size=config["vocab_size"],
            hidden_dim=config["intermediate_size"],
            norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=config.get("rope_theta", 10000.0),
            max_seq_len=config.get("max_position_embeddings", 2048),
        )
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def from_json(cls, path: str | Path, vocab_size: int | None = None) -> ModelArgs:
        """From a ``params.json`` (Meta / Nakta) or ``config.json`` (HF) file."""
        path = Path(path)
        data = json.loads(path.read_text())
        if "hidden_size" in data:
            return cls.from_hf_config(data)
        return cls.from_meta_params(data, vocab_size=vocab_size)

    def to_params(self) -> dict[str, Any]:
        """Meta-style ``params.json`` dict (plus Nakta's derived ``hidden_dim`` and pairing)."""
        return dataclasses.asdict(self)

    def to_meta_params(self) -> dict[str, Any]:
        """``params.json`` as Meta writes it (what llama_org builds from); refuses a shape
        Meta's FFN rule cannot give. An HF config states ``intermediate_size`` but no
        ``multiple_of``: when the stored one does not give ``hidden_dim``, the largest
        ``multiple_of`` that does is written instead (the same shape, in Meta's terms)."""
        multiple_of = self.multiple_of
        if meta_hidden_dim(self.dim, multiple_of, self.ffn_dim_multiplier) != self.hidden_dim:
            fits = [
                m
                for m in range(self.hidden_dim, 0, -1)
                if meta_hidden_dim(self.dim, m, self.ffn_dim_multiplier) == self.hidden_dim
            ]
            if not fits:
                raise ValueError(
                    f"hidden_dim {self.hidden_dim} is not what Meta's rule gives for dim="
                    f"{self.dim} with any multiple_of: llama_org cannot build this shape"
                )
            multiple_of = fits[0]
        params = {
            "dim": self.dim,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads if self.n_kv_heads != self.n_heads else None,
            "vocab_size": self.vocab_size,
            "multiple_of": multiple_of,
            "ffn_dim_multiplier": self.ffn_dim_multiplier,
            "norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
        }
        return {k: v for k, v in params.items() if v is not None}

    def replace(self, **changes: Any) -> ModelArgs:
        return dataclasses.replace(self, **changes)


META_PARAMS_KEYS = frozenset(f.name for f in dataclasses.fields(ModelArgs)) | _IGNORED_PARAMS_KEYS


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_positive_number(name: str, value: object) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


PRESETS: dict[str, ModelArgs] = {
    # LLaMA-1 shapes (Meta's params.json; vocab from the 32000-piece tokenizer).
    "7B": ModelArgs(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, multiple_of=256),
    "13B": ModelArgs(dim=5120, n_layers=40, n_heads=40, vocab_size=32000, multiple_of=256),
    "30B": ModelArgs(dim=6656, n_layers=60, n_heads=52, vocab_size=32000, multiple_of=256),
    "65B": ModelArgs(dim=8192, n_layers=80, n_heads=64, vocab_size=32000, multiple_of=256),
    # Tiny shapes for tests: GQA and plain multi-head, odd-ish FFN width.
    "tiny": ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=256,
        multiple_of=16,
        max_seq_len=128,
        norm_eps=1e-5,
    ),  # fmt: skip
    "tiny-mha": ModelArgs(
        dim=48,
        n_layers=2,
        n_heads=4,
        vocab_size=128,
        multiple_of=8,
        max_seq_len=64,
    ),  # fmt: skip
    # stories260K's shape (real weights in ../shared/data/stories260K).
    "stories260K": ModelArgs(
        dim=64,
        n_layers=5,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=512,
        multiple_of=4,
        norm_eps=1e-5,
        max_seq_len=512,
    ),  # fmt: skip
}


def preset(name: str) -> ModelArgs:
    """A named shape: ``7B``, ``13B``, ``30B``, ``65B``, ``tiny``, ``tiny-mha``, ``stories260K``."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None
