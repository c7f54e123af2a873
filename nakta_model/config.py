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

__all__ = [
    "META_LLAMA3_SCALING",
    "META_PARAMS_KEYS",
    "ModelArgs",
    "PRESETS",
    "RopeScaling",
    "SUPPORTED_MODEL_TYPES",
    "SUPPORTED_ROPE_TYPES",
    "meta_hidden_dim",
    "preset",
]

# ---------------------------------------------------------------- what a config holds beyond the shape
# Llama-3.1's RoPE scaling (from Meta's ``use_scaled_rope`` or any HF spelling) and the HF keys that
# change the math, refused unless they hold what Nakta implements.


def check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_positive_number(name: str, value: object) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


# RoPE types built into the cos/sin tables (``rope_type`` / ``type`` in HF configs).
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1's RoPE frequency scaling (HF ``rope_type: llama3``).

    Wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` keep their
    frequency, longer than ``original_max_position_embeddings / low_freq_factor`` are divided by
    ``factor``, and the band between is interpolated (``kernels/rope.rope_frequencies``).
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"

    def __post_init__(self) -> None:
        if self.rope_type != "llama3":
            raise ValueError(
                f"rope_type {self.rope_type!r} is not supported; supported: "
                f"{list(SUPPORTED_ROPE_TYPES)}"
            )
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            check_positive_number(f"rope_scaling.{name}", getattr(self, name))
        check_positive(
            "rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings
        )
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"rope_scaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                f"low_freq_factor ({self.low_freq_factor})"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any], what: str = "rope_scaling") -> RopeScaling:
        """From a ``{"rope_type": "llama3", "factor": ...}`` dict (a Nakta ``params.json``)."""
        if not isinstance(d, dict):
            raise ValueError(f"{what} must be an object, got {d!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{what} has unknown key(s) {unknown}; known: {sorted(known)}")
        missing = sorted(k for k in known - {"rope_type"} if k not in d)
        if missing:
            raise ValueError(f"{what} is missing {missing}")
        return cls(**d)


# Meta's ``use_scaled_rope: true`` (llama_models/llama3/model.py ``apply_scaling``): these
# constants are in Meta's reference code, not in its params.json.
META_LLAMA3_SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


# HF config keys that change the math, and the values Nakta implements (the reference's default).
_HF_MATH_KEYS: dict[str, tuple[Any, ...]] = {
    "attention_bias": (False, None),
    "mlp_bias": (False, None),
    "hidden_act": ("silu", None),
    "hidden_activation": ("silu", None),
    "partial_rotary_factor": (1.0, 1, None),
    "quantization_config": (None,),
    "qk_norm": (False, None),
    "use_qk_norm": (False, None),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "logits_scaling": (None, 1, 1.0),
    "layer_types": (None,),
}
_ROPE_KEYS = frozenset(
    {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
     "original_max_position_embeddings", "partial_rotary_factor"}
)  # fmt: skip


def refuse_hf_keys(config: dict[str, Any]) -> None:
    for key, allowed in _HF_MATH_KEYS.items():
        if key in config and config[key] not in allowed:
            raise ValueError(
                f"config.json {key}={config[key]!r} changes the model's math and is not "
                f"implemented (supported: {allowed[0]!r})"
            )


def check_head_dim(head_dim: object, dim: int, n_heads: int, what: str) -> None:
    if head_dim is None or not isinstance(n_heads, int) or n_heads <= 0:
        return
    if head_dim != dim // n_heads or dim % n_heads:
        raise ValueError(
            f"{what} head_dim={head_dim} differs from dim / n_heads = {dim}/{n_heads}: "
            "head_dim != dim / n_heads is not supported"
        )


def hf_rope(config: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` from ``rope_parameters`` (transformers 5), ``rope_scaling``
    (``type`` or ``rope_type``) and ``rope_theta``: every place a value is stated must agree."""
    thetas: dict[str, Any] = {}
    kinds: dict[str, dict[str, Any]] = {}
    if config.get("rope_theta") is not None:
        thetas["rope_theta"] = config["rope_theta"]
    for key in ("rope_parameters", "rope_scaling"):
        d = config.get(key)
        if d is None or d == {}:
            continue
        if not isinstance(d, dict):
            raise ValueError(f"config.json {key} must be an object, got {d!r}")
        unknown = sorted(set(d) - _ROPE_KEYS)
        if unknown:  # e.g. per-layer-type dicts, mrope sections: not a Llama RoPE
            raise ValueError(
                f"config.json {key} has key(s) {unknown} this RoPE does not implement; "
                f"supported rope types: {list(SUPPORTED_ROPE_TYPES)}"
            )
        if d.get("rope_theta") is not None:
            thetas[f"{key}.rope_theta"] = d["rope_theta"]
        if d.get("partial_rotary_factor") not in (None, 1, 1.0):
            raise ValueError(
                f"config.json {key}.partial_rotary_factor={d['partial_rotary_factor']!r} is "
                "not supported (RoPE over the whole head)"
            )
        kinds[key] = d
    if len({float(v) for v in thetas.values() if isinstance(v, (int, float))}) > 1:
        raise ValueError(f"config.json states different RoPE thetas: {thetas}")
    theta = next(iter(thetas.values()), 10000.0)
    scalings = []
    for key, d in kinds.items():
        rope_type = d.get("rope_type", d.get("type", "default"))
        if "rope_type" in d and "type" in d and d["rope_type"] != d["type"]:
            raise ValueError(
                f"config.json {key} has type {d['type']!r} and rope_type {rope_type!r}"
            )
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"config.json {key} rope type {rope_type!r} is not supported; supported: "
                f"{list(SUPPORTED_ROPE_TYPES)}"
            )
        if rope_type == "default":
            extra = sorted(set(d) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
            if extra:
                raise ValueError(f"config.json {key} (default RoPE) has scaling key(s) {extra}")
            scalings.append(None)
            continue
        fields = {
            k: d.get(k)
            for k in ("factor", "low_freq_factor", "high_freq_factor")
        }  # fmt: skip
        missing = sorted(k for k, v in fields.items() if v is None)
        if missing:
            raise ValueError(f"config.json {key} (llama3 RoPE) is missing {missing}")
        original = d.get("original_max_position_embeddings")
        if original is None:  # transformers falls back to the model's context
            original = config.get("max_position_embeddings")
        try:
            scalings.append(RopeScaling(**fields, original_max_position_embeddings=original))
        except ValueError as e:
            raise ValueError(f"config.json {key}: {e}") from None
    if len(set(scalings)) > 1:
        raise ValueError(f"config.json rope_parameters and rope_scaling disagree: {kinds}")
    return theta, (scalings[0] if scalings else None)


# ---------------------------------------------------------------- ModelArgs
# params.json keys that are read without becoming a ModelArgs field: llama_org's runtime batch
# size and the metadata a Nakta checkpoint's params.json carries (see checkpoint.py).
_IGNORED_PARAMS_KEYS = frozenset(
    {"max_batch_size", "tp_size", "format_version", "dtype", "quant"}  # storage, not the model
)
# params.json keys read into other fields: Llama-3's flag for Meta's RoPE scaling, Mistral's
# explicit head_dim (checked against dim / n_heads).
_META_ONLY_KEYS = frozenset({"use_scaled_rope", "head_dim"})


# HF ``model_type`` values read (same math; Mistral adds ``sliding_window``).
SUPPORTED_MODEL_TYPES = ("llama", "mistral")


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
    ``rope_scaling`` None is plain RoPE; a :class:`RopeScaling` is Llama-3.1's. ``max_seq_len``
    is the context the config states: nothing is allocated for it (the rope tables grow with the
    positions a run uses; the KV pool bounds memory). ``tie_word_embeddings``: the LM head is
    the embedding (Llama-3.2); ``sliding_window`` None is full attention, else each query sees
    the last ``sliding_window`` keys (Mistral).
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
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # a params.json read back
            object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.hidden_dim is None:
            check_positive("dim", self.dim)
            check_positive("multiple_of", self.multiple_of)
            if self.ffn_dim_multiplier is not None:
                check_positive_number("ffn_dim_multiplier", self.ffn_dim_multiplier)
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
            check_positive(name, getattr(self, name))
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
        check_positive_number("norm_eps", self.norm_eps)
        check_positive_number("rope_theta", self.rope_theta)
        if not isinstance(self.rope_interleaved, bool):
            raise ValueError(
                f"rope_interleaved must be true or false, got {self.rope_interleaved!r}"
            )
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"rope_scaling must be None or a RopeScaling, got {self.rope_scaling!r}"
            )
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(
                f"tie_word_embeddings must be true or false, got {self.tie_word_embeddings!r}"
            )
        if self.sliding_window is not None:
            check_positive("sliding_window", self.sliding_window)

    def check_tp(self, tp_size: int) -> None:
        """Raise ``ValueError`` when ``tp_size`` cannot split heads, FFN or vocab. KV heads split
        when ``tp_size`` divides them and are replicated when they divide ``tp_size`` (each rank
        holds the one KV head its query heads use, as vLLM does)."""
        check_positive("tp_size", tp_size)
        for name, value in (
            ("n_heads", self.n_heads),
            ("hidden_dim (FFN width)", self.hidden_dim),
            ("vocab_size", self.vocab_size),
        ):
            if value % tp_size:
                raise ValueError(f"tensor-parallel size {tp_size} does not divide {name} = {value}")
        if self.n_kv_heads % tp_size and tp_size % self.n_kv_heads:
            raise ValueError(
                f"tensor-parallel size {tp_size} neither divides n_kv_heads = {self.n_kv_heads} "
                "nor is a multiple of it (KV heads are split or replicated whole)"
            )

    def local_kv_heads(self, tp_size: int) -> int:
        """KV heads one rank holds at ``tp_size``: split, or one replicated head when
        ``tp_size`` exceeds ``n_kv_heads``."""
        return max(1, self.n_kv_heads // tp_size)

    def kv_head_start(self, tp_rank: int, tp_size: int) -> int:
        """The first (unsplit) KV head of rank ``tp_rank``: the one its query heads use."""
        return tp_rank * self.n_kv_heads // tp_size if tp_size <= self.n_kv_heads else (
            tp_rank * (self.n_heads // tp_size) // self.n_rep
        )  # fmt: skip

    # ------------------------------------------------------------------ readers
    @classmethod
    def from_meta_params(
        cls, params: dict[str, Any], vocab_size: int | None = None, **overrides: Any
    ) -> ModelArgs:
        """From Meta's ``params.json`` dict; ``vocab_size`` replaces Meta's ``-1`` placeholder.

        Known keys: llama_org's ``ModelArgs`` set (Meta's LLaMA-1/2 ``params.json``), Llama-3's
        ``use_scaled_rope`` (Meta's constants, :data:`META_LLAMA3_SCALING`), Mistral's
        ``head_dim`` / ``sliding_window``, Nakta's own fields (``hidden_dim``,
        ``rope_interleaved``, ``rope_scaling``, ...) and a Nakta checkpoint's metadata, so its
        ``params.json`` reads back through the same function. Any other key is refused: it
        means a model this code would silently run wrong.
        """
        if not isinstance(params, dict):
            raise TypeError(
                f"params must be a dict (params.json object), got {type(params).__name__}"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - fields - _IGNORED_PARAMS_KEYS - _META_ONLY_KEYS)
        if unknown:
            raise ValueError(
                f"params.json has unknown key(s) {unknown}; known keys: {sorted(META_PARAMS_KEYS)}"
            )
        kw = {k: v for k, v in params.items() if k in fields}
        if "dim" not in kw or "n_layers" not in kw or "n_heads" not in kw:
            raise ValueError(
                f"params.json needs dim, n_layers and n_heads; got keys {sorted(params)}"
            )
        scaled = params.get("use_scaled_rope", False)
        if not isinstance(scaled, bool):
            raise ValueError(f"use_scaled_rope must be true or false, got {scaled!r}")
        if scaled:
            if kw.get("rope_scaling") is not None:
                raise ValueError("params.json has both use_scaled_rope and rope_scaling")
            kw["rope_scaling"] = META_LLAMA3_SCALING
        check_head_dim(params.get("head_dim"), kw["dim"], kw["n_heads"], "params.json")
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
        """From a HF ``config.json`` dict (``model_type`` llama or mistral). HF checkpoints
        store q/k permuted for rotate-half RoPE; ``layout.unpermute_hf`` undoes that, so the
        result keeps ``rope_interleaved=True`` (Meta pairing) like every Nakta checkpoint.

        RoPE is read from every spelling transformers writes (``rope_theta`` + ``rope_scaling``
        with ``type`` or ``rope_type``; transformers 5's ``rope_parameters``), and any key that
        changes the math and is not implemented (biases, another activation, another RoPE type,
        a quantization) is a ``ValueError`` naming it: never a model run silently wrong.
        """
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict (config.json object), got {type(config)}")
        model_type = config.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json model_type {model_type!r} is not supported; supported: "
                f"{list(SUPPORTED_MODEL_TYPES)}"
            )
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if key not in config:
                raise ValueError(f"config.json is missing {key!r}")
        if "intermediate_size" not in config:
            raise ValueError("config.json is missing 'intermediate_size'")
        refuse_hf_keys(config)
        dim, n_heads = config["hidden_size"], config["num_attention_heads"]
        check_head_dim(config.get("head_dim"), dim, n_heads, "config.json")
        theta, scaling = hf_rope(config)
        window = config.get("sliding_window")
        if model_type == "llama" and window is not None:
            raise ValueError(
                f"config.json sliding_window={window!r} with model_type 'llama': transformers' "
                "Llama ignores it; refusing rather than guessing which was meant"
            )
        if model_type == "mistral" and config.get("use_sliding_window") is False:
            window = None
        kw = dict(
            dim=dim,
            n_layers=config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            vocab_size=config["vocab_size"],
            hidden_dim=config["intermediate_size"],
            norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_seq_len=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            sliding_window=window,
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
        for name in ("rope_scaling", "sliding_window"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"{name}={getattr(self, name)!r}: llama_org (LLaMA-1) implements plain RoPE "
                    "and full attention, it cannot build this model"
                )
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

    def to_hf_config(self, rope_style: str = "v5", model_type: str | None = None) -> dict[str, Any]:
        """The ``config.json`` transformers reads for this model; :meth:`from_hf_config` reads
        it back to these args (up to ``rope_interleaved``: HF folders store q/k permuted).
        ``model_type``: ``"mistral"`` when there is a sliding window, else ``"llama"`` (a
        Mistral config may state no window; a Llama one cannot state one). ``rope_style``
        ``"v5"``: one ``rope_parameters`` object (what transformers 5 writes); ``"v4"``:
        ``rope_theta`` plus ``rope_scaling`` when scaled."""
        if model_type is None:
            model_type = "llama" if self.sliding_window is None else "mistral"
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type must be one of {list(SUPPORTED_MODEL_TYPES)}, got {model_type!r}"
            )
        if model_type == "llama" and self.sliding_window is not None:
            raise ValueError(
                f"sliding_window={self.sliding_window}: transformers' Llama has none; "
                "model_type 'mistral' states it"
            )
        cfg: dict[str, Any] = {
            "architectures": [f"{model_type.capitalize()}ForCausalLM"],
            "model_type": model_type,
            "hidden_size": self.dim,
            "intermediate_size": self.hidden_dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.norm_eps,
            "max_position_embeddings": self.max_seq_len,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
        }
        scaling = None
        if self.rope_scaling is not None:
            scaling = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        if rope_style == "v5":
            cfg["rope_parameters"] = {
                **(scaling or {"rope_type": "default"}),
                "rope_theta": self.rope_theta,
            }
        elif rope_style == "v4":
            cfg["rope_theta"] = self.rope_theta
            if scaling is not None:
                cfg["rope_scaling"] = scaling
        else:
            raise ValueError(f"rope_style must be 'v4' or 'v5', got {rope_style!r}")
        if model_type == "mistral":
            cfg["sliding_window"] = self.sliding_window
        return cfg

    def replace(self, **changes: Any) -> ModelArgs:
        return dataclasses.replace(self, **changes)


META_PARAMS_KEYS = (
    frozenset(f.name for f in dataclasses.fields(ModelArgs))
    | _IGNORED_PARAMS_KEYS
    | _META_ONLY_KEYS
)


def _hf_preset(
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    intermediate: int,
    vocab: int,
    theta: float,
    context: int,
    *,
    scaling: RopeScaling | None = None,
    tie: bool = False,
    window: int | None = None,
) -> ModelArgs:
    """A preset from a published HF config (rms_norm_eps 1e-5 in every one of them)."""
    return ModelArgs(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, vocab_size=vocab,
        hidden_dim=intermediate, norm_eps=1e-5, rope_theta=theta, max_seq_len=context,
        rope_scaling=scaling, tie_word_embeddings=tie, sliding_window=window,
    )  # fmt: skip


# meta-llama/Llama-3.1-8B and Llama-3.2-1B/3B config.json rope_scaling (rope_type llama3).
_LLAMA31_SCALING = RopeScaling(8.0, 1.0, 4.0, 8192)
_LLAMA32_SCALING = RopeScaling(32.0, 1.0, 4.0, 8192)

PRESETS: dict[str, ModelArgs] = {
    # LLaMA-1 shapes (Meta's params.json; vocab from the 32000-piece tokenizer).
    "7B": ModelArgs(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, multiple_of=256),
    "13B": ModelArgs(dim=5120, n_layers=40, n_heads=40, vocab_size=32000, multiple_of=256),
    "30B": ModelArgs(dim=6656, n_layers=60, n_heads=52, vocab_size=32000, multiple_of=256),
    "65B": ModelArgs(dim=8192, n_layers=80, n_heads=64, vocab_size=32000, multiple_of=256),
    # Today's families, as their published HF config.json files state them (vocab, width,
    # heads, KV heads, intermediate_size, rope theta / scaling, context, tied head, window).
    "llama2-7B": _hf_preset(4096, 32, 32, 32, 11008, 32000, 10000.0, 4096),
    "llama2-70B": _hf_preset(8192, 80, 64, 8, 28672, 32000, 10000.0, 4096),
    "llama3-8B": _hf_preset(4096, 32, 32, 8, 14336, 128256, 500000.0, 8192),
    "llama3-70B": _hf_preset(8192, 80, 64, 8, 28672, 128256, 500000.0, 8192),
    "llama3.1-8B": _hf_preset(
        4096, 32, 32, 8, 14336, 128256, 500000.0, 131072, scaling=_LLAMA31_SCALING
    ),
    "llama3.2-1B": _hf_preset(
        2048, 16, 32, 8, 8192, 128256, 500000.0, 131072, scaling=_LLAMA32_SCALING, tie=True
    ),
    "llama3.2-3B": _hf_preset(
        3072, 28, 24, 8, 8192, 128256, 500000.0, 131072, scaling=_LLAMA32_SCALING, tie=True
    ),
    "mistral-7B": _hf_preset(4096, 32, 32, 8, 14336, 32000, 10000.0, 32768, window=4096),
    "tinyllama-1.1B": _hf_preset(2048, 22, 32, 4, 5632, 32000, 10000.0, 2048),
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
    """A named shape (``sorted(PRESETS)``): LLaMA-1 ``7B`` .. ``65B``, ``llama2-7B``,
    ``llama3-8B``, ``llama3.2-1B``, ``mistral-7B``, ``tinyllama-1.1B``, ..., and the tiny test
    shapes ``tiny``, ``tiny-mha``, ``stories260K``."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None
