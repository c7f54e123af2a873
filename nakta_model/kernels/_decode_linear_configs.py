"""Launch-configuration tables of ``decode_linear.py`` (read by its ``_config``).

Kept apart so the launcher file stays readable. Keys: ``(dtype name, batch bucket)`` and per
shape ``(dtype name, bucket, variant, N, K)``, where the dtype is the weight's when it is FP8
(``"float8_e4m3fn"``: the weight dtype sets the bytes per K step, so its best ``BLOCK_K``
differs) and x's otherwise.
"""

from __future__ import annotations

from pathlib import Path

import triton

from nakta_model.kernels._tuned_tables import read_tuned

# Configurations per (dtype, batch bucket = next power of two of B), and per-shape entries
# keyed (dtype, bucket, variant, N, K) from ``bench_decode.py --tune`` (LLaMA-7B's five decode
# GEMVs at batch 1, 8 and 32 on an H100),
# applied over the bucket's; variant is "plain", "residual", "swiglu" or "rope" (``_variant``).
# ``BLOCK_N`` is left to ``_block_n`` (fill the GPU) and ``BLOCK_K`` to ``_block_k`` (registers)
# unless given. ``_TUNE`` overrides every key (set by the benchmark and the tests).
_HALF: dict[int, dict[str, int]] = {
    1: dict(USE_DOT=0, num_warps=4, num_stages=4),
    2: dict(USE_DOT=1, BLOCK_K=256, num_warps=4, num_stages=4),
    4: dict(USE_DOT=1, BLOCK_K=256, num_warps=4, num_stages=4),
    8: dict(USE_DOT=1, BLOCK_K=256, num_warps=4, num_stages=4),
    16: dict(USE_DOT=1, BLOCK_K=256, num_warps=4, num_stages=4),
    32: dict(USE_DOT=1, BLOCK_K=128, num_warps=4, num_stages=4),
    64: dict(USE_DOT=1, BLOCK_K=128, num_warps=4, num_stages=3),
}
_CONFIGS: dict[tuple, dict[str, int]] = {
    **{("bfloat16", b): c for b, c in _HALF.items()},
    **{("float16", b): c for b, c in _HALF.items()},
    **{  # fp32: half the K tile (same bytes per weight row)
        ("float32", b): {**c, "BLOCK_K": c["BLOCK_K"] // 2} if "BLOCK_K" in c else dict(c)
        for b, c in _HALF.items()
    },
    # H100 --tune winners (% of copy bandwidth, default -> tuned: e.g. b32 head 66.5 -> 84.4,
    # b32 w13 51.4 -> 79.2, b1 w2 83.5 -> 86.1); batch 1 head and w13 keep the defaults.
    ("bfloat16", 1, "plain", 32000, 4096): dict(
        USE_DOT=0, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4
    ),
    ("bfloat16", 1, "residual", 4096, 11008): dict(
        USE_DOT=0, BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=3
    ),
    ("bfloat16", 1, "residual", 4096, 4096): dict(
        USE_DOT=0, BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=4
    ),
    ("bfloat16", 1, "rope", 12288, 4096): dict(
        USE_DOT=0, BLOCK_N=16, BLOCK_K=256, num_warps=2, num_stages=5
    ),
    ("bfloat16", 1, "swiglu", 11008, 4096): dict(
        USE_DOT=0, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4
    ),
    ("bfloat16", 8, "plain", 32000, 4096): dict(
        USE_DOT=1, BLOCK_N=128, BLOCK_K=256, num_warps=4, num_stages=3
    ),
    ("bfloat16", 8, "residual", 4096, 11008): dict(
        USE_DOT=1, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=5
    ),
    ("bfloat16", 8, "residual", 4096, 4096): dict(
        USE_DOT=1, BLOCK_N=32, BLOCK_K=256, num_warps=2, num_stages=5
    ),
    ("bfloat16", 8, "rope", 12288, 4096): dict(
        USE_DOT=1, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=5
    ),
    ("bfloat16", 8, "swiglu", 11008, 4096): dict(
        USE_DOT=1, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=4
    ),
    ("bfloat16", 32, "plain", 32000, 4096): dict(
        USE_DOT=1, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4
    ),
    ("bfloat16", 32, "residual", 4096, 11008): dict(
        USE_DOT=1, BLOCK_N=16, BLOCK_K=256, num_warps=2, num_stages=5
    ),
    ("bfloat16", 32, "residual", 4096, 4096): dict(
        USE_DOT=1, BLOCK_N=16, BLOCK_K=256, num_warps=2, num_stages=4
    ),
    ("bfloat16", 32, "rope", 12288, 4096): dict(
        USE_DOT=1, BLOCK_N=32, BLOCK_K=128, num_warps=2, num_stages=3
    ),
    ("bfloat16", 32, "swiglu", 11008, 4096): dict(
        USE_DOT=1, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=4
    ),
}
# Per-device overrides of the entries above, by a word of the device name: the H200's batch-1
# --tune winners (% of copy bandwidth, H100 entry -> tuned, this run: wqkv 79.2 -> 89.7, w2
# 89.0 -> 89.7; head, w13 and wo keep theirs).
_DEVICE_CONFIGS: dict[str, dict[tuple, dict[str, int]]] = {
    "h200": {
        ("bfloat16", 1, "rope", 12288, 4096): dict(
            USE_DOT=0, BLOCK_N=8, BLOCK_K=256, num_warps=2, num_stages=4
        ),
        ("bfloat16", 1, "residual", 4096, 11008): dict(
            USE_DOT=0, BLOCK_N=4, BLOCK_K=512, num_warps=4, num_stages=2
        ),
    },
}

_FP8 = "float8_e4m3fn"
_FMA_ACC_MAX = 16384  # fp32 accumulator elements per program an FP8 entry may grow to


def _fp8_entry(cfg: dict[str, int], rows_per_col: int, bucket: int) -> dict[str, int]:
    """An FP8-weight row derived from a bf16 one, where no tuned row exists: the same bytes of
    each weight row per K step (``BLOCK_K`` doubled) unless the CUDA-core accumulator
    (``TILE_N x BLOCK_M x BLOCK_K``) would pass ``_FMA_ACC_MAX``; ``tl.dot`` rows of batch
    >= 16 keep bf16's ``BLOCK_K``: their bf16 x tile (``BLOCK_M x BLOCK_K``) is as large as
    before and outweighs the weight tile, and doubling it cost shared memory and occupancy
    (H100, batch 32: 0.44-0.93x bf16 with it doubled)."""
    out = dict(cfg)
    if "BLOCK_K" in cfg:
        acc = rows_per_col * cfg.get("BLOCK_N", 16) * bucket * 2 * cfg["BLOCK_K"]
        if (cfg["USE_DOT"] and bucket < 16) or (not cfg["USE_DOT"] and acc <= _FMA_ACC_MAX):
            out["BLOCK_K"] = 2 * cfg["BLOCK_K"]
    return out


_CONFIGS.update(
    {
        (_FP8, *key[1:]): _fp8_entry(cfg, 2 if len(key) == 5 and key[2] == "swiglu" else 1, key[1])
        for key, cfg in list(_CONFIGS.items())
        if key[0] == "bfloat16"
    }
)
for _table in _DEVICE_CONFIGS.values():
    _table.update(
        {
            (_FP8, *key[1:]): _fp8_entry(cfg, 2 if key[2] == "swiglu" else 1, key[1])
            for key, cfg in list(_table.items())
            if key[0] == "bfloat16"
        }
    )


# ------------------------------------------------------------------ tuned FP8 rows (a file)
# ``kernel_benchmark/tune_fp8_decode.py`` writes its winners, per device family, to this file
# beside the module; when present its rows go over the derived FP8 rows above (committing the
# file is the whole step). Format: {"devices": {family: {"entries": {"dtype/bucket/variant/N/K":
# {knob: int}}, ...}}}; a row written before a knob existed takes its FP8_KNOB_DEFAULTS value
# (a row without PREFETCH: 0); anything else raises here, naming the file.
FP8_TUNED_JSON = Path(__file__).with_name("_decode_linear_fp8_tuned.json")
FP8_KNOBS = ("USE_DOT", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "DOT_F16", "PREFETCH")
FP8_KNOB_DEFAULTS = {"PREFETCH": 0}  # knobs added after rows were written: a row without one


def fp8_tuned_key(bucket: int, variant: str, n_cols: int, k: int) -> str:
    """The file's key of one per-shape FP8 row (``_config``'s table key, joined by "/")."""
    return f"{_FP8}/{bucket}/{variant}/{n_cols}/{k}"


def load_fp8_tuned(path: Path) -> dict[str, dict[tuple, dict[str, int]]]:
    """``{family: {table key: config}}`` of a tuned-FP8 JSON; {} when the file is absent."""

    def key(text: str) -> tuple:
        dtype, bucket, variant, n, k = text.split("/")
        if dtype != _FP8:
            raise ValueError(f"entry {text!r}: expected {_FP8} rows")
        return dtype, int(bucket), variant, int(n), int(k)

    return read_tuned(path, "tuned-FP8 decode", key, FP8_KNOBS, FP8_KNOB_DEFAULTS)


for _family, _rows in load_fp8_tuned(FP8_TUNED_JSON).items():
    _DEVICE_CONFIGS.setdefault(_family, {}).update(_rows)


# ------------------------------------------------------------------ the RMSNorm prologue

# The RMSNorm prologue's pass over x (``_row_rstd``) runs before any weight load, one L2 round
# trip per ``NORM_BLOCK`` elements: with ``BLOCK_K`` (256-512 at batch 1) that was 8-16 trips
# in a row, the few microseconds by which the normed GEMVs (wqkv, w13, the LM head) trailed
# the others at batch 1. ``NORM_BLOCK`` takes the whole row in one or two loads instead, up to
# ``NORM_ELEMS_PER_THREAD`` fp32 squares a thread (never fewer than ``BLOCK_K``).
NORM_ELEMS_PER_THREAD = 32


def norm_block(k: int, block_m: int, block_k: int, num_warps: int) -> int:
    """Elements of x a program reads per step of the RMSNorm prologue (a power of two)."""
    widest = NORM_ELEMS_PER_THREAD * 32 * num_warps // block_m
    return max(block_k, min(triton.next_power_of_2(k), widest))
