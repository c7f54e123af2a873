"""RMSNorm (+ fused residual add), forward and backward, rounding like Meta's LLaMA.

Meta's ``RMSNorm.forward`` is ``self._norm(x.float()).type_as(x) * self.weight``: normalize in
fp32, round to the input dtype, THEN multiply by the weight (in fp32 from the rounded operands,
rounded to the promoted dtype). ``cast="meta"`` (default) reproduces that order (so does HF's
``LlamaRMSNorm``); ``cast="fp32"`` multiplies the fp32 normalized row by the weight and rounds
once (Gemma / Liger's ``casting_mode="gemma"``), for parity studies. Output dtype, both modes:
``torch.promote_types(x.dtype, weight.dtype)``, as PyTorch's ``type_as(x) * weight`` gives.
With ``residual``, ``h = x + residual`` rounded to x's dtype (as PyTorch's add) is computed in
the same pass and returned: ``(rms_norm(h), h)``.

FP8 output (``rms_norm_fp8``): the same kernel and row layout, with the normalized row (rounded
to the output dtype, as stored above) quantized by ``fp8_quant.py``'s row rule instead of stored:
e4m3 codes + one fp32 scale per row; rows held in registers take their amax there, looped rows
take one more pass over the row (from L2). Equal bit for bit to ``quantize_rows`` of
``rms_norm``'s output; to ``rms_norm_fp8_reference`` within ``rms_norm``'s own tolerance.

Backward: gradients for x, weight and residual; the weight gradient is summed in fp32 per
program into a ``[programs, N]`` buffer reduced once (deterministic, no atomics). Rounding inside
the forward is treated as identity (straight-through), as autograd on the reference does.

Row layouts (``_layout``): a row up to MAX_SINGLE_BLOCK columns is held in registers as up to
three power-of-2 column chunks ``C0 >= C1 >= C2`` (5120 = 4096 + 1024, no padded 8192 block);
wider rows, and forward rows of three chunks without residual, loop over column blocks. The
Triton kernels are in ``_rmsnorm_kernels.py``; this file chooses their layout and launch values
(``_config``) and holds the launchers, the autograd function, ``rms_norm`` and its reference.
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
    sm_count,
)
from nakta_model.kernels._rmsnorm_kernels import _rms_norm_bwd_kernel, _rms_norm_fwd_kernel
from nakta_model.kernels.fp8_quant import (
    FP8_DTYPE,
    MIN_AMAX,
    QuantRows,
    quantize_rows_reference,
)

CAST_MODES = ("meta", "fp32")
MAX_SINGLE_BLOCK = 16384  # widest row held in registers at once; wider rows loop over blocks
MULTI_BLOCK_N = 4096  # column block used when a row does not fit in one block
MAX_HIDDEN = 65536
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


# ----------------------------------------------------------------------------------------------
# 1. Row layout and launch configuration
# ----------------------------------------------------------------------------------------------

MIN_CHUNK = 256  # smallest column chunk of a split row
# Forward rows that need three chunks (e.g. 6656 = 4096 + 2048 + 512) and no residual loop
# over column blocks of this width instead, in two passes (the second reads the row back from
# L2): 3% faster at 6656 on an H200 and level with torch.compile's looped kernel, where every
# chunked launch configuration measured slower (docs/experiments.md). With the
# residual add the chunked rows stay (97-99% of copy bandwidth at 6656 in the sweep); the loop
# was not measured with the residual, where its second pass re-reads x and the residual.
LOOPED_THREE_CHUNK_BLOCK = 2048


def column_chunks(n_cols: int) -> tuple[int, int, int]:
    """Up to three power-of-2 column chunks, largest first, that hold a row of ``n_cols``.

    Why: one power-of-2 block pads 5120 to 8192 (and 6656 to 8192), so registers and threads
    are spent on masked lanes; 4096 + 1024 (and 4096 + 2048 + 512) cover those rows exactly.
    Widths are rounded up to MIN_CHUNK; a remainder needing more than three chunks is padded.
    """
    m = -(-n_cols // MIN_CHUNK) * MIN_CHUNK
    chunks = []
    while m and len(chunks) < 2:
        c = 1 << (m.bit_length() - 1)
        chunks.append(c)
        m -= c
    if m:
        chunks.append(triton.next_power_of_2(m))
    if n_cols <= MIN_CHUNK:
        chunks = [triton.next_power_of_2(n_cols)]
    return tuple(chunks + [0] * (3 - len(chunks)))


def _layout(
    n_cols: int, block_n: int | None, split_rows: bool = True
) -> tuple[tuple[int, int, int], bool]:
    """``((C0, C1, C2), single)``: the chunks of a row held at once, or (block, 0, 0) and
    False when the kernels loop over column blocks. ``block_n`` forces one block of that size;
    ``split_rows=False`` holds the row in one padded power-of-2 block.
    """
    if block_n is not None:
        return (block_n, 0, 0), block_n >= n_cols
    full = triton.next_power_of_2(n_cols)
    if full > MAX_SINGLE_BLOCK:
        return (MULTI_BLOCK_N, 0, 0), False
    return (column_chunks(n_cols) if split_rows else (full, 0, 0)), True


def _fwd_layout(
    n_cols: int, block_n: int | None, has_residual: bool
) -> tuple[tuple[int, int, int], bool]:
    """The forward's layout: ``_layout``, except that rows of three chunks without a residual
    loop over LOOPED_THREE_CHUNK_BLOCK-wide blocks (see above)."""
    chunks, single = _layout(n_cols, block_n)
    if block_n is None and single and chunks[2] and not has_residual:
        return (LOOPED_THREE_CHUNK_BLOCK, 0, 0), False
    return chunks, single


# Launch configurations by (kernel, row width held = sum of the column chunks), chosen by
# ``kernel_benchmark/bench_rmsnorm.py --tune`` on an NVIDIA H200 (16K rows, bf16); the forward
# at 4096 from interleaved A/B runs (one 1-D row per program, 8 warps, beat the [2, 4096] tile
# by ~1.5%). The bench rewrites these entries for its own run; the values kept
# here are the ones its published results used. Other widths follow ``_rule``. ``_TUNE``
# overrides BLOCK_M / num_warps / PROGRAMS_PER_SM, and sets BLOCK_N (rows laid out as one
# column block of that width) and PROGRAMS (backward grid); set by the benchmark and tests only.
_CONFIGS: dict[tuple[str, int], dict[str, int]] = {
    ("fwd", 4096): dict(BLOCK_M=1, num_warps=8),
    ("fwd", 5120): dict(BLOCK_M=1, num_warps=4),
    ("fwd", 6656): dict(BLOCK_M=1, num_warps=4),
    ("fwd", 8192): dict(BLOCK_M=2, num_warps=16),
    ("bwd", 4096): dict(BLOCK_M=2, num_warps=8, PROGRAMS_PER_SM=2),
    ("bwd", 8192): dict(BLOCK_M=2, num_warps=16, PROGRAMS_PER_SM=1),
}
_TUNE: dict[str, int] = {}


def _rule(kernel: str, held: int, single: bool) -> dict[str, int]:
    """The configuration of a row width the table does not hold (or of the column loop)."""
    if not single:
        block_m, num_warps, per_sm = 1, 8, 4
    elif held >= 8192:
        block_m, num_warps, per_sm = 1, 16, 2
    elif held >= 2048:
        block_m, num_warps, per_sm = 1, 8, 2
    else:
        block_m, num_warps, per_sm = max(1, 2048 // held), 4, 4
    cfg = dict(BLOCK_M=block_m, num_warps=num_warps)
    return (cfg | dict(PROGRAMS_PER_SM=per_sm)) if kernel == "bwd" else cfg


def _config(kernel: str, n_cols: int, has_residual: bool = False) -> dict[str, int]:
    """Row layout (C0, C1, C2, SINGLE_BLOCK) and launch values of the ``"fwd"`` or ``"bwd"``
    kernel for rows of ``n_cols``: the table entry of the width held, else ``_rule``, then
    ``_TUNE``. The backward holds a row in one padded block (C1 = C2 = 0): on an H200 (16K
    rows, bf16) rows split into chunks as in the forward were no faster at 5120 (196 vs
    200 us) and slower at 6656 (248 vs 213 us), so that variant was removed."""
    block_n = _TUNE.get("BLOCK_N")
    if kernel == "fwd":
        chunks, single = _fwd_layout(n_cols, block_n, has_residual)
    else:
        chunks, single = _layout(n_cols, block_n, split_rows=False)
    cfg = dict(_CONFIGS.get((kernel, sum(chunks)), {})) if single else {}
    cfg = {**(cfg or _rule(kernel, sum(chunks), single)), **_TUNE}
    cfg["BLOCK_M"] = cfg["BLOCK_M"] if single else 1
    return cfg | dict(C0=chunks[0], C1=chunks[1], C2=chunks[2], SINGLE_BLOCK=single)


# ----------------------------------------------------------------------------------------------
# 2. Input checks and launchers
# ----------------------------------------------------------------------------------------------


def _check_cast(cast: object) -> bool:
    """True for Meta's rounding order, False for all-fp32."""
    if cast not in CAST_MODES:
        raise ValueError(f"cast must be one of {CAST_MODES}, got {cast!r}")
    return cast == "meta"


def _check_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    return float(eps)


def _rows_view(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, N]`` (``rows_view``), with a non-empty last dimension."""
    if t.dim() < 1 or t.shape[-1] == 0:
        raise ValueError(f"{name} must have a non-empty last dimension, got shape {tuple(t.shape)}")
    return rows_view(name, t, "hidden")


def _check_args(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Validate a forward call; returns x and residual as ``[rows, N]`` views."""
    check_tensor("x", x)
    check_tensor("weight", weight)
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("weight", weight, FLOAT_DTYPES)
    n = x.shape[-1] if x.dim() else 0
    if weight.dim() != 1 or weight.shape[0] != n:
        raise ValueError(
            f"weight must have shape ({n},) to match the last dim of x {tuple(x.shape)}, "
            f"got {tuple(weight.shape)}"
        )
    if not 1 <= n <= MAX_HIDDEN:
        raise ValueError(f"x last dim must be in [1, {MAX_HIDDEN}], got {n}")
    if residual is not None:
        check_tensor("residual", residual)
        if residual.shape != x.shape:
            raise ValueError(
                f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}"
            )
        if residual.dtype != x.dtype:
            raise TypeError(f"residual must have the dtype of x ({x.dtype}), got {residual.dtype}")
    check_same_device(x=x, weight=weight, residual=residual)
    check_triton_device("x", x)
    x2 = _rows_view("x", x)
    r2 = _rows_view("residual", residual) if residual is not None else None
    return x2, r2


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
    residual: torch.Tensor | None = None, cast: str = "meta", store_rstd: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """Launch the forward kernel: ``(y, h or None, rstd or None)``."""
    cast_meta = _check_cast(cast)
    eps = _check_eps(eps)
    x2, r2 = _check_args(x, weight, residual)
    n_rows = x2.shape[0]
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device) if r2 is not None else None
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device) if store_rstd else None
    _launch_fwd(x2, r2, weight, y, h, rstd, None, eps, cast_meta)
    return y, h, rstd


def rms_norm_fp8_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
    residual: torch.Tensor | None = None, cast: str = "meta",
) -> tuple[QuantRows, torch.Tensor | None]:  # fmt: skip
    """Launch the forward kernel with FP8 output: ``(QuantRows(q [M, N], scale [M]), h or
    None)``; the row layout (so the sum order of 1/rms) is the one ``rms_norm_forward`` uses."""
    cast_meta = _check_cast(cast)
    eps = _check_eps(eps)
    x2, r2 = _check_args(x, weight, residual)
    q = torch.empty(x2.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device) if r2 is not None else None
    _launch_fwd(x2, r2, weight, q, h, None, scale, eps, cast_meta)
    return QuantRows(q, scale), h


def _launch_fwd(
    x2: torch.Tensor, r2: torch.Tensor | None, weight: torch.Tensor, y: torch.Tensor,
    h: torch.Tensor | None, rstd: torch.Tensor | None, scale: torch.Tensor | None, eps: float,
    cast_meta: bool,
) -> None:  # fmt: skip
    """The forward kernel into ``y`` (the normalized rows; FP8 codes when ``scale`` is given)."""
    n_rows, n_cols = x2.shape
    if n_rows == 0:
        return
    cfg = _config("fwd", n_cols, r2 is not None)
    y2 = y.view(-1, n_cols)
    h2 = h.view(-1, n_cols) if h is not None else y2
    interp = interpreter_enabled()
    y_dtype = _TL_DTYPES[torch.promote_types(x2.dtype, weight.dtype)]
    _rms_norm_fwd_kernel[(triton.cdiv(n_rows, cfg["BLOCK_M"]),)](
        x2, r2 if r2 is not None else x2, weight, y2, h2, rstd if rstd is not None else y2,
        scale if scale is not None else y2,
        n_rows, n_cols, x2.stride(0), r2.stride(0) if r2 is not None else 0, weight.stride(0),
        y2.stride(0), h2.stride(0), eps, 1.0 / n_cols,
        HAS_RESIDUAL=r2 is not None, STORE_RSTD=rstd is not None, CAST_META=cast_meta,
        BLOCK_M=cfg["BLOCK_M"], C0=cfg["C0"], C1=cfg["C1"], C2=cfg["C2"],
        SINGLE_BLOCK=cfg["SINGLE_BLOCK"], ACCURATE=not interp, EMULATE_RNE=interp,
        QUANT=scale is not None, Y_DTYPE=y_dtype, MIN_AMAX=MIN_AMAX, num_warps=cfg["num_warps"],
    )  # fmt: skip


def rms_norm_backward(
    dy: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
    dh_out: torch.Tensor | None = None, cast: str = "meta",
    need_dx: bool = True, need_dr: bool = False, need_dw: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """Launch the backward kernel: ``(dx, dresidual, dweight)`` (None where not needed).

    ``h`` is the normalized input (x, or x + residual), ``rstd`` the forward's fp32 1/rms per
    row, ``dh_out`` the gradient flowing into the returned ``h`` (residual variant only).
    """
    cast_meta = _check_cast(cast)
    h2 = _rows_view("h", h)
    dy2 = _rows_view("dy", dy)
    if dy.shape != h.shape:
        raise ValueError(f"dy must have shape {tuple(h.shape)}, got {tuple(dy.shape)}")
    dho2 = _rows_view("dh_out", dh_out) if dh_out is not None else None
    n_rows, n_cols = h2.shape
    dx = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    dr = torch.empty(h.shape, dtype=h.dtype, device=h.device) if need_dr else None
    cfg = _config("bwd", n_cols)
    single, block_m = cfg["SINGLE_BLOCK"], cfg["BLOCK_M"]
    programs = cfg.get("PROGRAMS") or sm_count(h.device, 4) * cfg["PROGRAMS_PER_SM"]
    # single block: row tiles interleaved over programs; else contiguous chunks of rows
    programs = max(1, min(programs, triton.cdiv(n_rows, block_m)))
    rpp = triton.cdiv(n_rows, programs)
    if not single:
        programs = triton.cdiv(n_rows, rpp) if n_rows else 0
    elif n_rows == 0:
        programs = 0
    f32 = dict(dtype=torch.float32, device=h.device)
    dw_partial = torch.empty((programs, n_cols), **f32) if need_dw else None
    dot = torch.empty(n_rows, **f32) if not single else None
    dx2 = dx.view(-1, n_cols)
    dr2 = dr.view(-1, n_cols) if dr is not None else dx2
    if programs:
        _rms_norm_bwd_kernel[(programs,)](
            dy2, h2, weight, rstd, dho2 if dho2 is not None else dy2, dx2, dr2,
            dw_partial if dw_partial is not None else rstd, dot if dot is not None else rstd,
            n_rows, n_cols, dy2.stride(0), h2.stride(0), weight.stride(0),
            dho2.stride(0) if dho2 is not None else 0, dx2.stride(0), dr2.stride(0),
            1.0 / n_cols, rpp,
            HAS_DH_OUT=dho2 is not None, HAS_DR=dr is not None, CAST_META=cast_meta,
            COMPUTE_DW=need_dw, BLOCK_M=block_m, BLOCK_N=cfg["C0"], SINGLE_BLOCK=single,
            EMULATE_RNE=interpreter_enabled(), num_warps=cfg["num_warps"],
        )  # fmt: skip
    dw = None
    if need_dw:
        dw = dw_partial.sum(0).to(weight.dtype) if programs else torch.zeros_like(weight)
    return (dx if need_dx else None), dr, dw


# ----------------------------------------------------------------------------------------------
# 3. Autograd
# ----------------------------------------------------------------------------------------------


class RMSNormFunction(torch.autograd.Function):
    """``rms_norm`` with a Triton backward; returns ``y`` or ``(y, h)`` with a residual."""

    @staticmethod
    def forward(ctx, x, weight, residual, eps, cast):
        y, h, rstd = rms_norm_forward(x, weight, eps, residual, cast, store_rstd=True)
        ctx.cast = cast
        ctx.has_residual = residual is not None
        ctx.save_for_backward(h if h is not None else x, weight, rstd)
        return y if h is None else (y, h)

    @staticmethod
    def backward(ctx, dy, dh_out=None):
        h, weight, rstd = ctx.saved_tensors
        need_x, need_w, need_r = ctx.needs_input_grad[:3]
        if dy is None:  # only h was used downstream
            dy = torch.zeros(
                h.shape, dtype=torch.promote_types(h.dtype, weight.dtype), device=h.device
            )
        dy, dh_out = grad_rows(dy), grad_rows(dh_out)
        dx, dr, dw = rms_norm_backward(
            dy, h, weight, rstd, dh_out, ctx.cast, need_dx=need_x or need_r,
            need_dr=need_x and need_r, need_dw=need_w,
        )  # fmt: skip
        if need_r and not need_x:
            dr, dx = dx, None
        return dx, dw, dr, None, None


# ----------------------------------------------------------------------------------------------
# 4. Public function
# ----------------------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    cast: str = "meta",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim; with ``residual`` returns ``(rms_norm(x + residual), x + residual)``.

    Rounds like Meta's LLaMA with ``cast="meta"``; see the module docstring for ``cast="fp32"``.
    """
    tensors = (x, weight) if residual is None else (x, weight, residual)
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    )
    if needs_grad:
        return RMSNormFunction.apply(x, weight, residual, eps, cast)
    y, h, _ = rms_norm_forward(x, weight, eps, residual, cast)
    return y if h is None else (y, h)


def rms_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    cast: str = "meta",
) -> QuantRows | tuple[QuantRows, torch.Tensor]:
    """``rms_norm`` whose output leaves the kernel as FP8: ``QuantRows(q [M, N] e4m3, scale [M]
    fp32)``, ``M`` the product of x's leading dims; with ``residual``, ``(QuantRows, h)`` with
    ``h = x + residual`` in x's dtype as ``rms_norm`` returns it. The codes are
    ``fp8_quant``'s rule applied to the values ``rms_norm`` would store (rounded to its output
    dtype), so the bf16 ``[M, N]`` output is never written. Forward only (no autograd)."""
    q, h = rms_norm_fp8_forward(x, weight, eps, residual, cast)
    return q if h is None else (q, h)


# ----------------------------------------------------------------------------------------------
# 5. Reference
# ----------------------------------------------------------------------------------------------


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    cast: str = "meta",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch with the same semantics (Meta's code for ``cast="meta"``); any device.

    Computes in fp32 (fp64 for fp64 inputs, which the kernel does not accept but which makes
    this a high-precision reference for gradient checks).
    """
    cast_meta = _check_cast(cast)
    h = x if residual is None else x + residual
    compute = torch.promote_types(h.dtype, torch.float32)
    hf = h.to(compute)
    n = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if cast_meta:
        y = n.type_as(h) * weight
    else:
        y = (weight.to(compute) * n).to(torch.promote_types(h.dtype, weight.dtype))
    return y if residual is None else (y, h)


def rms_norm_fp8_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    cast: str = "meta",
) -> QuantRows | tuple[QuantRows, torch.Tensor]:
    """``quantize_rows_reference(rms_norm_reference(...))``; any device."""
    out = rms_norm_reference(x, weight, eps, residual, cast)
    if residual is None:
        return quantize_rows_reference(out)
    y, h = out
    return quantize_rows_reference(y), h
