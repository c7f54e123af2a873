"""SwiGLU: ``silu(gate) * up``, forward and backward, rounding exactly like PyTorch eager.

PyTorch's ``F.silu(a) * b`` in a half dtype computes ``a / (1 + exp(-a))`` in fp32, rounds it
to the dtype, then multiplies the two rounded operands in fp32 and rounds again. The kernel
does the same steps, in fp16/fp32 with the same functions on the GPU (libdevice ``expf`` and
IEEE division, which is what PyTorch's CUDA kernel compiles to), in bf16 with faster ones that
round the same (below), so outputs match bit for bit.

The backward repeats the roundings of autograd on ``F.silu(a) * b``:
``d_silu = round(dout * up)``, ``d_up = round(dout * round(silu(gate)))``,
``d_gate = round(d_silu * s * (1 + gate * (1 - s)))`` with ``s = 1 / (1 + exp(-gate))``.

Which arithmetic gives PyTorch's bits depends on the dtype, because a half-precision gate has
only 65,536 values and every one can be checked. For bf16 the fast arithmetic (the hardware
``ex2`` and an approximate division, what Liger-Kernel's sigmoid uses) rounds to the same bf16
silu as eager on every gate: it was found so on an H200 by exhaustion, and the GPU test
``test_gpu_exact_forward_every_half_gate`` re-checks all of them on whatever GPU runs it. So
bf16 always runs the fast kernel (16K x 11008: 102.6% of copy bandwidth vs 99.3% with the IEEE
division, Liger 101.8%). fp16 (2 of 65,536 gates differ by one ulp)
and fp32 keep libdevice ``expf`` and IEEE ``div.rn`` unless ``exact=False`` is asked for.

``exact=False`` (forward only) then uses the fast arithmetic for every dtype: in fp16
``silu(gate)`` differs from eager's by at most one ulp (where the fp32 value sits next to a
rounding midpoint), so ``silu * up`` by at most two. In fp32 the bound is 2^-16 relative: the
hardware exp reduces its argument as ``x * log2(e)`` in fp32, an error that grows with |x| up
to ~2^-17.5 at |x| ~ 88. The division is the cost of the exact path: a branch-free correctly
rounded division (reciprocal + Newton + residual with exact 2^-64 scaling, equal to ``div.rn``
on all 2^32 fp32 gates) had fewer instructions but ran at 90%, because ptxas then interleaves
the loads with the arithmetic instead of issuing them all first (docs/experiments.md).

``swiglu_fp8(gate_up)``: the forward's values quantized per row (``fp8_quant.py``'s rule) in
the same kernel, e4m3 codes + one fp32 scale per row, bit for bit ``swiglu_fp8_reference``. A row
of F <= 16384 (padded) is held whole by one program, so gate and up are read once; wider rows
take two passes (the second from L2, recomputing the SiLU).

``swiglu(gate_up)`` takes the fused ``[..., 2F]`` projection (gate first, up second) and reads
the two halves as strided views: no split copies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nakta_model.kernels._checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_same_device,
    check_tensor,
    check_triton_device,
    grad_rows,
    interpreter_enabled,
    rows_view,
)
from nakta_model.kernels._triton_math import exp, fp8_codes, fp8_row_scales, round_to, silu
from nakta_model.kernels.fp8_quant import (
    FP8_DTYPE,
    MIN_AMAX,
    QuantRows,
    quantize_rows_reference,
)

# Dtypes whose silu the fast arithmetic rounds like eager on every input (module docstring).
FAST_IS_EXACT_DTYPES = (torch.bfloat16,)

# ----------------------------------------------------------------------------------------------
# 1. Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tile(n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's ``[BLOCK_M, BLOCK_N]`` tile: row indices ``[BLOCK_M, 1]`` (int64), column
    indices ``[1, BLOCK_N]`` and the in-bounds mask. One program per (row tile, column block),
    column blocks fastest: the programs running at one moment read consecutive addresses of
    the same rows, which keeps DRAM streaming."""
    pid = tl.program_id(0).to(tl.int64)
    col_blocks = tl.cdiv(n_cols, BLOCK_N)
    rows = (pid // col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return rows[:, None], cols[None, :], mask


# The row/token count is not specialised on: every batch size runs one compiled kernel.
@triton.jit(do_not_specialize=["n_rows"])
def _silu_mul_fwd_kernel(
    G, U, OUT, n_rows, n_cols, stride_g, stride_u, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FAST_SILU: tl.constexpr,
    ACCURATE: tl.constexpr, EMULATE_RNE: tl.constexpr,
):  # fmt: skip
    """``OUT = round(round(silu(G)) * U)``; ``FAST_SILU``: hardware ex2 + approximate division
    (PyTorch's bits in bf16, every gate checked), else libdevice expf + IEEE division (PyTorch's
    bits in fp16 and fp32)."""
    r, c, mask = _tile(n_rows, n_cols, BLOCK_M, BLOCK_N)
    g = tl.load(G + r * stride_g + c, mask=mask, other=0.0)
    u = tl.load(U + r * stride_u + c, mask=mask, other=0.0)
    g = g.to(tl.float32)
    u = u.to(tl.float32)
    dtype = OUT.dtype.element_ty
    s = round_to(silu(g, FAST_SILU, ACCURATE), dtype, EMULATE_RNE)
    out = round_to(s.to(tl.float32) * u, dtype, EMULATE_RNE)
    tl.store(OUT + r * stride_out + c, out, mask=mask)


@triton.jit
def _swiglu_values(G, U, row, c, mask, stride_g, stride_u, FAST_SILU: tl.constexpr,
                   ACCURATE: tl.constexpr, EMULATE_RNE: tl.constexpr, EVICT: tl.constexpr):  # fmt: skip
    """``round(round(silu(g)) * u)`` of columns ``c`` of ``row``, in fp32 (the forward's bits)."""
    g = tl.load(G + row * stride_g + c, mask=mask, other=0.0, eviction_policy=EVICT)
    u = tl.load(U + row * stride_u + c, mask=mask, other=0.0, eviction_policy=EVICT)
    dtype = G.dtype.element_ty
    s = round_to(silu(g.to(tl.float32), FAST_SILU, ACCURATE), dtype, EMULATE_RNE)
    return round_to(s.to(tl.float32) * u.to(tl.float32), dtype, EMULATE_RNE).to(tl.float32)


# The row/token count is not specialised on: every batch size runs one compiled kernel.
@triton.jit(do_not_specialize=["n_rows"])
def _swiglu_fp8_kernel(
    G, U, Q, S, n_rows, n_cols, stride_g, stride_u, stride_q,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
    FAST_SILU: tl.constexpr, ACCURATE: tl.constexpr, EMULATE_RNE: tl.constexpr,
    MIN_AMAX: tl.constexpr,
):  # fmt: skip
    """The forward's values quantized per row (``fp8_quant.py``'s rule): ``BLOCK_M`` whole
    rows held in registers, or one row in two passes over column blocks (the second reads the
    row back from L2 and recomputes the SiLU)."""
    pid = tl.program_id(0).to(tl.int64)
    if SINGLE_BLOCK:
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
        cols = tl.arange(0, BLOCK_N)[None, :]
        mask = (rows < n_rows) & (cols < n_cols)
        y = _swiglu_values(G, U, rows, cols, mask, stride_g, stride_u, FAST_SILU, ACCURATE,
                           EMULATE_RNE, "")  # fmt: skip
        inv, scale = fp8_row_scales(tl.max(tl.abs(y), axis=1), MIN_AMAX)
        tl.store(Q + rows * stride_q + cols, fp8_codes(y, inv[:, None], EMULATE_RNE), mask=mask)
        r = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(S + r, scale, mask=r < n_rows)
    else:
        cols = tl.arange(0, BLOCK_N)
        amax = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            y = _swiglu_values(G, U, pid, c, c < n_cols, stride_g, stride_u, FAST_SILU,
                               ACCURATE, EMULATE_RNE, "evict_last")  # fmt: skip
            amax = tl.maximum(amax, tl.abs(y))
        inv, scale = fp8_row_scales(tl.max(amax, axis=0), MIN_AMAX)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            y = _swiglu_values(G, U, pid, c, c < n_cols, stride_g, stride_u, FAST_SILU,
                               ACCURATE, EMULATE_RNE, "evict_first")  # fmt: skip
            tl.store(Q + pid * stride_q + c, fp8_codes(y, inv, EMULATE_RNE), mask=c < n_cols)
        tl.store(S + pid, scale)


@triton.jit
def _silu_mul_bwd_kernel(
    DOUT, G, U, DG, DU, n_rows, n_cols, stride_dout, stride_g, stride_u, stride_dg, stride_du,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACCURATE: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):  # fmt: skip
    """The gradients of autograd on ``F.silu(g) * u``, with its roundings (module docstring)."""
    r, c, mask = _tile(n_rows, n_cols, BLOCK_M, BLOCK_N)
    dout = tl.load(DOUT + r * stride_dout + c, mask=mask, other=0.0)
    g = tl.load(G + r * stride_g + c, mask=mask, other=0.0)
    u = tl.load(U + r * stride_u + c, mask=mask, other=0.0)
    dout = dout.to(tl.float32)
    g = g.to(tl.float32)
    u = u.to(tl.float32)
    dtype = DG.dtype.element_ty
    e = exp(-g, ACCURATE)
    s = round_to(tl.math.div_rn(g, 1.0 + e), dtype, EMULATE_RNE).to(tl.float32)
    sig = tl.math.div_rn(1.0, 1.0 + e)
    d_silu = round_to(dout * u, dtype, EMULATE_RNE).to(tl.float32)
    du = round_to(dout * s, dtype, EMULATE_RNE)
    dg = round_to(d_silu * sig * (1.0 + g * (1.0 - sig)), dtype, EMULATE_RNE)
    tl.store(DG + r * stride_dg + c, dg, mask=mask)
    tl.store(DU + r * stride_du + c, du, mask=mask)


# ----------------------------------------------------------------------------------------------
# 2. Launch configuration, launchers and input checks
# ----------------------------------------------------------------------------------------------

# Launch configurations per kernel (BLOCK_M rows x BLOCK_N columns per program, num_warps) on
# an NVIDIA H200 (16K tokens, bf16): the forwards from interleaved A/B runs over 7 tiles at
# F = 11008 and 22016 (one-warp 1x512 tiles best for both), the backward from
# ``kernel_benchmark/bench_swiglu.py --tune``. ``--tune`` rewrites these for its own run; the values kept here are the
# ones the published results used. ``_TUNE`` overrides any key (benchmark and tests only).
_CONFIGS: dict[str, dict[str, int]] = {
    "fwd": dict(BLOCK_M=1, BLOCK_N=512, num_warps=1),  # exact: libdevice expf, div.rn
    "fwd_fast": dict(BLOCK_M=1, BLOCK_N=512, num_warps=1),  # FAST_SILU
    "bwd": dict(BLOCK_M=1, BLOCK_N=1024, num_warps=4),
}
# The FP8 forward needs each row's amax: rows up to FP8_MAX_SINGLE_BLOCK columns (padded to a
# power of two) are held whole by one program, ~32 fp32 values a thread (11008 -> 16384, 16
# warps); wider rows loop in two passes of FP8_LOOP_BLOCK_N. Not tuned on a GPU yet:
# ``bench_fp8.py`` times the held row against the two-pass loop (``_FP8_TUNE["BLOCK_N"]``).
FP8_MAX_SINGLE_BLOCK = 16384
FP8_LOOP_BLOCK_N = 4096
_FP8_TUNE: dict[str, int] = {}
_TUNE: dict[str, int] = {}


def _config(kernel: str, n_cols: int) -> dict[str, int]:
    """The table entry of ``kernel``, then ``_TUNE``; unless tuned, a narrow row gets a block
    no wider than the row, and no more warps than 256 elements each."""
    cfg = {**_CONFIGS[kernel], **_TUNE}
    if "BLOCK_N" not in _TUNE:
        cfg["BLOCK_N"] = min(cfg["BLOCK_N"], triton.next_power_of_2(n_cols))
    if "num_warps" not in _TUNE:
        cfg["num_warps"] = min(cfg["num_warps"], max(1, cfg["BLOCK_M"] * cfg["BLOCK_N"] // 256))
    return cfg


def _check_args(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate gate and up; returns them as ``[rows, F]`` views."""
    check_tensor("gate", gate)
    check_tensor("up", up)
    check_dtype("gate", gate, FLOAT_DTYPES)
    check_dtype("up", up, FLOAT_DTYPES)
    if gate.shape != up.shape:
        raise ValueError(
            f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}"
        )
    if gate.dtype != up.dtype:
        raise TypeError(f"gate and up must have the same dtype, got {gate.dtype} and {up.dtype}")
    check_same_device(gate=gate, up=up)
    check_triton_device("gate", gate)
    return rows_view("gate", gate), rows_view("up", up)


def _split_gate_up(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_tensor("gate_up", gate_up)
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(
            f"gate_up must have an even last dim ([..., 2F], gate first), got {tuple(gate_up.shape)}"
        )
    f = gate_up.shape[-1] // 2
    return gate_up[..., :f], gate_up[..., f:]


def silu_mul_forward(
    gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None, *, exact: bool = True
) -> torch.Tensor:
    """Launch the forward kernel; ``out`` (optional) must be a fresh ``[..., F]`` tensor.

    ``exact=False`` trades PyTorch's bits for speed in fp16/fp32; bf16 is exact either way
    (see the module docstring)."""
    if not isinstance(exact, bool):
        raise TypeError(f"exact must be a bool, got {type(exact).__name__}")
    g2, u2 = _check_args(gate, up)
    if out is None:
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    o2 = rows_view("out", out)
    n_rows, n_cols = g2.shape
    if n_rows == 0 or n_cols == 0:
        return out
    fast = not exact or gate.dtype in FAST_IS_EXACT_DTYPES
    cfg = _config("fwd_fast" if fast else "fwd", n_cols)
    interp = interpreter_enabled()
    grid = (triton.cdiv(n_rows, cfg["BLOCK_M"]) * triton.cdiv(n_cols, cfg["BLOCK_N"]),)
    _silu_mul_fwd_kernel[grid](
        g2, u2, o2, n_rows, n_cols, g2.stride(0), u2.stride(0), o2.stride(0),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], FAST_SILU=fast, ACCURATE=not interp,
        EMULATE_RNE=interp, num_warps=cfg["num_warps"],
    )  # fmt: skip
    return out


def _fp8_config(n_cols: int) -> dict[str, int]:
    """``BLOCK_M``, ``BLOCK_N``, ``SINGLE_BLOCK``, ``num_warps`` of the FP8 forward."""
    full = triton.next_power_of_2(max(1, n_cols))
    if "BLOCK_N" in _FP8_TUNE:
        bn = _FP8_TUNE["BLOCK_N"]
        cfg = dict(BLOCK_M=1, BLOCK_N=bn, SINGLE_BLOCK=bn >= n_cols, num_warps=8)
    elif full > FP8_MAX_SINGLE_BLOCK:
        cfg = dict(BLOCK_M=1, BLOCK_N=FP8_LOOP_BLOCK_N, SINGLE_BLOCK=False, num_warps=8)
    else:
        block_m = max(1, 2048 // full)
        warps = max(1, min(16, block_m * full // 1024))
        cfg = dict(BLOCK_M=block_m, BLOCK_N=full, SINGLE_BLOCK=True, num_warps=warps)
    cfg.update({k: v for k, v in _FP8_TUNE.items() if k != "BLOCK_N"})
    if not cfg["SINGLE_BLOCK"]:
        cfg["BLOCK_M"] = 1
    return cfg


def swiglu_fp8_forward(gate: torch.Tensor, up: torch.Tensor) -> QuantRows:
    """Launch the FP8 forward on ``gate``/``up`` ``[..., F]`` (strided row views)."""
    g2, u2 = _check_args(gate, up)
    n_rows, n_cols = g2.shape
    q = torch.empty((n_rows, n_cols), dtype=FP8_DTYPE, device=gate.device)
    scale = torch.ones(n_rows, dtype=torch.float32, device=gate.device)  # K = 0: as the reference
    if n_rows == 0 or n_cols == 0:
        return QuantRows(q, scale)
    cfg = _fp8_config(n_cols)
    interp = interpreter_enabled()
    _swiglu_fp8_kernel[(triton.cdiv(n_rows, cfg["BLOCK_M"]),)](
        g2, u2, q, scale, n_rows, n_cols, g2.stride(0), u2.stride(0), q.stride(0),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], SINGLE_BLOCK=cfg["SINGLE_BLOCK"],
        FAST_SILU=gate.dtype in FAST_IS_EXACT_DTYPES, ACCURATE=not interp, EMULATE_RNE=interp,
        MIN_AMAX=MIN_AMAX, num_warps=cfg["num_warps"],
    )  # fmt: skip
    return QuantRows(q, scale)


def silu_mul_backward(
    dout: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    dgate: torch.Tensor | None = None,
    dup: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel: ``(d_gate, d_up)``, written into ``dgate``/``dup`` if given."""
    g2, u2 = _check_args(gate, up)
    if dout.shape != gate.shape:
        raise ValueError(f"dout must have shape {tuple(gate.shape)}, got {tuple(dout.shape)}")
    d2 = rows_view("dout", dout)
    if dgate is None:
        dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if dup is None:
        dup = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    dg2, du2 = rows_view("dgate", dgate), rows_view("dup", dup)
    n_rows, n_cols = g2.shape
    if n_rows == 0 or n_cols == 0:
        return dgate, dup
    cfg = _config("bwd", n_cols)
    interp = interpreter_enabled()
    grid = (triton.cdiv(n_rows, cfg["BLOCK_M"]) * triton.cdiv(n_cols, cfg["BLOCK_N"]),)
    _silu_mul_bwd_kernel[grid](
        d2, g2, u2, dg2, du2, n_rows, n_cols,
        d2.stride(0), g2.stride(0), u2.stride(0), dg2.stride(0), du2.stride(0),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], ACCURATE=not interp,
        EMULATE_RNE=interp, num_warps=cfg["num_warps"],
    )  # fmt: skip
    return dgate, dup


# ----------------------------------------------------------------------------------------------
# 3. Autograd
# ----------------------------------------------------------------------------------------------


class SiluMulFunction(torch.autograd.Function):
    """``silu(gate) * up`` with the Triton backward."""

    @staticmethod
    def forward(ctx, gate, up, exact=True):
        ctx.save_for_backward(gate, up)
        return silu_mul_forward(gate, up, exact=exact)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        return (*silu_mul_backward(grad_rows(dout), gate, up), None)


class SwiGLUFunction(torch.autograd.Function):
    """``swiglu(gate_up)``; the gradient is one ``[..., 2F]`` tensor written half by half."""

    @staticmethod
    def forward(ctx, gate_up, exact=True):
        gate, up = _split_gate_up(gate_up)
        ctx.save_for_backward(gate_up)
        return silu_mul_forward(gate, up, exact=exact)

    @staticmethod
    def backward(ctx, dout):
        (gate_up,) = ctx.saved_tensors
        gate, up = _split_gate_up(gate_up)
        d_gate_up = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
        dgate, dup = _split_gate_up(d_gate_up)
        silu_mul_backward(grad_rows(dout), gate, up, dgate, dup)
        return d_gate_up, None


# ----------------------------------------------------------------------------------------------
# 4. Public functions
# ----------------------------------------------------------------------------------------------


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    )


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, exact: bool = True) -> torch.Tensor:
    """``silu(gate) * up`` rounded like PyTorch eager (``exact=False``: fp16/fp32 within 1 ulp,
    faster; bf16 is exact either way); gate/up may be strided row views."""
    if _needs_grad(gate, up):
        return SiluMulFunction.apply(gate, up, exact)
    return silu_mul_forward(gate, up, exact=exact)


def swiglu(gate_up: torch.Tensor, *, exact: bool = True) -> torch.Tensor:
    """``silu(gate_up[..., :F]) * gate_up[..., F:]`` on the fused ``[..., 2F]`` projection."""
    if _needs_grad(gate_up):
        return SwiGLUFunction.apply(gate_up, exact)
    gate, up = _split_gate_up(gate_up)
    return silu_mul_forward(gate, up, exact=exact)


def swiglu_fp8(gate_up: torch.Tensor) -> QuantRows:
    """``swiglu(gate_up)`` leaving the kernel as FP8: ``QuantRows(q [M, F] e4m3, scale [M]
    fp32)``, ``M`` the product of the leading dims; the codes are ``fp8_quant``'s rule applied
    to the values ``swiglu`` would store (eager's bits), which are never written. Forward only."""
    gate, up = _split_gate_up(gate_up)
    return swiglu_fp8_forward(gate, up)


# ----------------------------------------------------------------------------------------------
# 5. Reference
# ----------------------------------------------------------------------------------------------


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """PyTorch eager, the expression LLaMA's FeedForward uses."""
    return torch.nn.functional.silu(gate) * up


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = _split_gate_up(gate_up)
    return silu_mul_reference(gate, up)


def swiglu_fp8_reference(gate_up: torch.Tensor) -> QuantRows:
    """``quantize_rows_reference(swiglu_reference(gate_up))``; any device."""
    return quantize_rows_reference(swiglu_reference(gate_up))
