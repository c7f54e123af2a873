"""What ModelArgs reads out of a config beyond the shape: Llama-3.1's RoPE scaling (from Meta's
``use_scaled_rope`` or any HF spelling) and the HF keys that change the math, refused unless
they hold what Nakta implements. Split from ``config.py``, which re-exports the public names.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = [
    "META_LLAMA3_SCALING",
    "SUPPORTED_ROPE_TYPES",
    "RopeScaling",
    "check_head_dim",
    "check_positive",
    "check_positive_number",
    "hf_rope",
    "refuse_hf_keys",
]


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
