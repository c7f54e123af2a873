"""The decode matmuls ``bench_decode`` measures and tunes: the LLaMA shapes,
one input set per (shape, batch), the paths that run them and the bytes a perfect kernel moves.

A lower layer of its own: ``bench_decode`` (its sweep and its ``--tune``), ``bench_decode_gemm``,
``bench_fp8`` and ``tune_fp8_decode`` all build their points from it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nakta_model.config import preset
from nakta_model.kernels.decode_linear import RopeArgs, decode_linear, decode_linear_reference
from nakta_model.kernels.rmsnorm import rms_norm
from nakta_model.kernels.rope import apply_rope_qkv_, build_rope_cache
from nakta_model.kernels.swiglu import swiglu

EPS = 1e-5
BATCHES = (1, 2, 4, 8, 16, 32)
KINDS = ("wqkv", "wo", "w13", "w2", "head")


@dataclass(frozen=True)
class Model:
    dim: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    vocab: int
    head_dim: int = 128


def _preset_model(name: str) -> Model:
    """A family preset's decode shapes (GQA, its FFN width, its vocabulary, its head size)."""
    a = preset(name)
    return Model(a.dim, a.hidden_dim, a.n_heads, a.n_kv_heads, a.vocab_size,
                 head_dim=a.dim // a.n_heads)  # fmt: skip


MODELS = {
    "7B": Model(4096, 11008, 32, 32, 32000),
    "13B": Model(5120, 13824, 40, 40, 32000),
    "65B": Model(8192, 22016, 64, 64, 32000),
    # the families whose batch-1 decode runs on untuned shapes (issue 40)
    **{name: _preset_model(name) for name in ("llama3-8B", "llama3.2-1B")},
}
TINY = Model(32, 24, 2, 1, 48, head_dim=16)  # CPU smoke runs (interpreter)


@dataclass(frozen=True)
class LinearShape:
    """One decode matmul: ``n x k`` weight and what is fused around it."""

    model: str
    kind: str
    n: int
    k: int
    heads: tuple[int, int, int] | None = None  # (n_q, n_kv, head_dim) for wqkv

    @property
    def variant(self) -> str:
        return {"wqkv": "rope", "wo": "residual", "w13": "swiglu", "w2": "residual"}.get(
            self.kind, "plain"
        )

    @property
    def norm(self) -> bool:
        return self.kind in ("wqkv", "w13", "head")

    @property
    def n_out(self) -> int:
        if self.kind == "wqkv":
            return self.heads[0] * self.heads[2]
        return self.n // 2 if self.kind == "w13" else self.n

    @property
    def n_cols(self) -> int:
        """Columns the launch config is chosen for (``decode_linear._config``)."""
        return self.n // 2 if self.kind == "w13" else self.n

    def label(self) -> str:
        return f"{self.model} {self.kind} {self.n}x{self.k}"


def linear_shapes(name: str, m: Model) -> list[LinearShape]:
    qkv_rows = (m.n_heads + 2 * m.n_kv_heads) * m.head_dim
    heads = (m.n_heads, m.n_kv_heads, m.head_dim)
    return [
        LinearShape(name, "wqkv", qkv_rows, m.dim, heads),
        LinearShape(name, "wo", m.dim, m.n_heads * m.head_dim),
        LinearShape(name, "w13", 2 * m.hidden, m.dim),
        LinearShape(name, "w2", m.dim, m.hidden),
        LinearShape(name, "head", m.vocab, m.dim),
    ]


# ------------------------------------------------------------------------------ linear inputs


def make_linear_set(shape: LinearShape, batch: int, dtype, device, seed: int) -> dict:
    """One input set of a decode matmul (weight included, so sets defeat L2)."""
    g = torch.Generator(device=device).manual_seed(seed)
    n, k = shape.n, shape.k
    t = {
        "x": torch.randn(batch, k, generator=g, device=device).to(dtype),
        "w": (torch.randn(n, k, generator=g, device=device) / math.sqrt(k)).to(dtype),
    }
    if shape.norm:
        t["nw"] = (1 + 0.1 * torch.randn(k, generator=g, device=device)).to(dtype)
    if shape.variant == "residual":
        t["residual"] = torch.randn(batch, n, generator=g, device=device).to(dtype)
    if shape.variant == "rope":
        nq, nkv, hd = shape.heads
        cos, sin = build_rope_cache(4096, hd, device=device)
        t["rope"] = RopeArgs(
            positions=torch.arange(batch, device=device) * 7 + 100,
            cos=cos,
            sin=sin,
            n_q_heads=nq,
            n_kv_heads=nkv,
            head_dim=hd,
            k_cache=torch.zeros(batch, nkv, hd, dtype=dtype, device=device),
            v_cache=torch.zeros(batch, nkv, hd, dtype=dtype, device=device),
            cache_slots=torch.arange(batch, device=device),
        )
    out_dtype = torch.float32 if shape.kind == "head" else dtype
    t["out"] = torch.empty(batch, shape.n_out, dtype=out_dtype, device=device)
    return t


def linear_kwargs(shape: LinearShape, t: dict) -> dict:
    kw = {}
    if shape.norm:
        kw |= {"norm_weight": t["nw"], "eps": EPS}
    if shape.variant == "residual":
        kw["residual"] = t["residual"]
    elif shape.variant == "swiglu":
        kw["swiglu"] = True
    elif shape.variant == "rope":
        kw["rope"] = t["rope"]
    if shape.kind == "head":
        kw["out_dtype"] = torch.float32
    return kw


def nakta_call(shape: LinearShape, t: dict) -> Callable[[], object]:
    kw = linear_kwargs(shape, t)
    return lambda: decode_linear(t["x"], t["w"], **kw, out=t["out"])


def cublas_call(shape: LinearShape, t: dict) -> Callable[[], object]:
    return lambda: F.linear(t["x"], t["w"])


def unfused_call(shape: LinearShape, t: dict) -> Callable[[], object]:
    """The model's path today: Nakta's RMSNorm, cuBLAS, then Nakta's SwiGLU / RoPE kernel or
    eager's residual add."""
    x, w = t["x"], t["w"]

    def call():
        h = rms_norm(x, t["nw"], EPS) if shape.norm else x
        y = F.linear(h, w)
        if shape.variant == "residual":
            return t["residual"] + y
        if shape.variant == "swiglu":
            return swiglu(y)
        if shape.variant == "rope":
            r = t["rope"]
            apply_rope_qkv_(
                y, r.positions, r.cos, r.sin, r.n_q_heads, r.n_kv_heads, r.head_dim,
                interleaved=True, k_cache=r.k_cache, v_cache=r.v_cache, cache_slots=r.cache_slots,
            )  # fmt: skip
            return y
        return y.float() if shape.kind == "head" else y

    return call


LINEAR_PATHS = {"nakta": nakta_call, "cublas": cublas_call, "unfused": unfused_call}


def linear_bytes(shape: LinearShape, batch: int, e: int) -> int:
    """Bytes a perfect kernel moves: weight, x, norm weight, residual, output, K/V writes."""
    nbytes = (shape.n * shape.k + batch * shape.k) * e
    nbytes += shape.k * e if shape.norm else 0
    nbytes += batch * shape.n * e if shape.variant == "residual" else 0
    nbytes += batch * shape.n_out * (4 if shape.kind == "head" else e)
    if shape.variant == "rope":
        nbytes += 2 * batch * shape.heads[1] * shape.heads[2] * e
    return nbytes


def linear_mismatch(shape: LinearShape, t: dict) -> float:
    """Fraction of the outputs Nakta's timed calls left in ``t["out"]`` that differ in any bit
    from the eager reference (run on its own caches)."""
    kw = linear_kwargs(shape, t)
    if "rope" in kw:
        r = kw["rope"]
        kw["rope"] = RopeArgs(
            **{**r.__dict__, "k_cache": r.k_cache.clone(), "v_cache": r.v_cache.clone()}
        )
    with torch.no_grad():
        ref = decode_linear_reference(t["x"], t["w"], **kw)
    got = t["out"]
    if got.dtype != t["x"].dtype:  # fp32 logits: any summation order differs in the last bits
        got, ref = got.to(t["x"].dtype), ref.to(t["x"].dtype)
    return (got != ref).float().mean().item()


# ---------------------------------------------------------------------------------- timing


def cpu_us(call: Callable[[], object]) -> float:
    """One wall-clock call: the CPU run is a smoke test of the script (the interpreter is far
    too slow for repeated timing), not a measurement."""
    t0 = time.perf_counter()
    call()
    return (time.perf_counter() - t0) * 1e6
