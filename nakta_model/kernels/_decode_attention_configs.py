"""Launch configuration of ``decode_attention.py``: the split rule, the kernels' launch values,
the workspace shape.

Kept apart (the house's ``_<op>_configs.py`` convention, as ``_decode_linear_configs.py``) so the
launcher file stays readable; ``decode_attention`` re-exports ``decode_splits``,
``cascade_splits`` and ``attention_workspace``. ``_TUNE`` here overrides any key (the benchmark
and the tests set it).
"""

from __future__ import annotations

import functools

import torch
import triton

from nakta_model import knobs
from nakta_model.kernels._checks import check_positive_int, sm_count

# Defaults for an H100/H200, to be replaced by ``bench_decode.py`` results: the split rule
# ("splits") and the split kernel's launch values by path, "dot" (tl.dot, the default) or
# "fma" (MHA on the CUDA cores). ``_TUNE`` overrides any key, and USE_DOT=0/1 forces the
# path (set by the benchmark and the tests only).
_CONFIGS: dict[str, dict[str, int]] = {
    "splits": dict(
        PROGRAMS_PER_SM=2,  # split until B * n_kv * n_splits reaches this many programs per SM
        MIN_SPLIT_KEYS=256,  # ... but no split of the full cache shorter than this
        MAX_SPLITS=64,
    ),
    "fma": dict(BLOCK_S=32, num_warps=4, num_stages=3),  # BLOCK_S: keys per step
    "dot": dict(BLOCK_S=64, num_warps=4, num_stages=3),
    # the cascade's prefix kernel: BLOCK_Q (row, head) pairs per tile; its splits of a slot's
    # prefix follow the split rule's shape with their own floor (not measured on a GPU yet)
    "cascade": dict(
        BLOCK_Q=64,
        BLOCK_S=64,
        num_warps=8,
        num_stages=2,
        PROGRAMS_PER_SM=2,
        MIN_SPLIT_KEYS=128,
        MAX_SPLITS=32,
    ),  # fmt: skip
}
_TUNE: dict[str, int] = {}
_DEFAULT_SMS = 132  # H100 SXM / H200; used off the GPU
# A benchmark's override in a fresh process, e.g. "MIN_SPLIT_KEYS=64,BLOCK_S=32": read at each
# launch (a process's captured graphs keep what they were captured with), applied before _TUNE
ENV_TUNE = "NAKTA_DECODE_ATTENTION_TUNE"
_KEYS = frozenset(k for table in _CONFIGS.values() for k in table)


@functools.lru_cache(maxsize=8)
def _parse_env(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or key not in _KEYS or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(
                f"{ENV_TUNE}: expected KEY=positive int pairs with KEY in {sorted(_KEYS)}, "
                f"got {part!r}"
            )
        out[key] = int(value)
    return out


def _config(kind: str) -> dict[str, int]:
    """The table entry ``kind`` ("splits", "fma", "dot" or "cascade"), then ``ENV_TUNE``'s
    keys, then ``_TUNE``."""
    return {**_CONFIGS[kind], **_parse_env(knobs.get_str(ENV_TUNE)), **_TUNE}


def decode_splits(batch: int, n_kv_heads: int, max_seq: int, device: torch.device | str) -> int:
    """The number of sequence splits ``decode_attention`` uses for these shapes: enough
    programs to fill the GPU, no split of the full cache under ``MIN_SPLIT_KEYS`` keys.
    Depends on shapes only, so a captured graph keeps its grid."""
    for name, v in (("batch", batch), ("n_kv_heads", n_kv_heads), ("max_seq", max_seq)):
        check_positive_int(name, v)
    cfg = _config("splits")
    target = cfg["PROGRAMS_PER_SM"] * sm_count(torch.device(device), _DEFAULT_SMS)
    wanted = triton.cdiv(target, batch * n_kv_heads)
    cap = min(cfg["MAX_SPLITS"], triton.cdiv(max_seq, cfg["MIN_SPLIT_KEYS"]))
    return max(1, min(wanted, cap))


def cascade_splits(
    batch: int, n_q_heads: int, n_kv_heads: int, n_slots: int, max_seq: int, device
) -> int:
    """Splits of each slot's prefix keys in the cascade (``prefix_slots``): enough programs
    (slots x KV heads x query tiles x splits) to fill the GPU, no split of a full-length
    prefix under ``MIN_SPLIT_KEYS`` keys. Shapes only (graph capture keeps its grid); the
    workspace then needs ``n_splits + n_slots * cascade_splits(...)`` partials."""
    for name, v in (("batch", batch), ("n_q_heads", n_q_heads), ("n_kv_heads", n_kv_heads),
                    ("n_slots", n_slots), ("max_seq", max_seq)):  # fmt: skip
        check_positive_int(name, v)
    cfg = _config("cascade")
    tiles = triton.cdiv(batch * (n_q_heads // n_kv_heads), cfg["BLOCK_Q"])
    target = cfg["PROGRAMS_PER_SM"] * sm_count(torch.device(device), _DEFAULT_SMS)
    wanted = triton.cdiv(target, n_slots * n_kv_heads * tiles)
    cap = min(cfg["MAX_SPLITS"], triton.cdiv(max_seq, cfg["MIN_SPLIT_KEYS"]))
    return max(1, min(wanted, cap))


def attention_workspace(
    batch: int, n_q_heads: int, head_dim: int, n_splits: int, device: torch.device | str
) -> torch.Tensor:
    """The fp32 partials buffer ``[batch, n_q_heads, n_splits, head_dim + 2]`` (output, max,
    sum per split): allocate once, pass as ``workspace`` on every step."""
    for name, v in (("batch", batch), ("n_q_heads", n_q_heads), ("head_dim", head_dim),
                    ("n_splits", n_splits)):  # fmt: skip
        check_positive_int(name, v)
    return torch.empty(batch, n_q_heads, n_splits, head_dim + 2, dtype=torch.float32, device=device)
