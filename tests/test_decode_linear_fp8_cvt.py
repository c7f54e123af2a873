"""``CVT=1`` of ``decode_linear``'s FP8 CUDA-core loop: e4m3 codes unpacked by integer ops.

The claim under test (``_decode_linear_kernels._fma_loop``): every code, the subnormal ones and
+-0 included, becomes exactly its value times 2^-120 (NaN codes: +-480 * 2^-120, documented),
and with x times 2^100 and the sums times 2^20 the GEMV is bit for bit the ``CVT=0`` one, so
the tolerances of ``test_decode_linear.py`` against the reference apply unchanged. The weights
here hold every finite code (``quantize_weight`` of random weights rarely makes the subnormal
ones), in strided views whose row padding holds NaN codes (a read past K would show).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import triton
import triton.language as tl
from test_decode_linear import (
    LLAMA7B,
    assert_matches_reference,
    assert_near_fp64,
    expected_fp64,
    make_case,
    run_both,
)

from nakta_model.kernels import _decode_linear_configs as cfgs
from nakta_model.kernels import _decode_linear_kernels as dlk
from nakta_model.kernels import decode_linear as dl
from nakta_model.kernels.fp8_quant import FP8_DTYPE, quantize_weight

NAN_CODES = (0x7F, 0xFF)
FINITE_CODES = [c for c in range(256) if c not in NAN_CODES]


def expected_bits(codes: torch.Tensor) -> torch.Tensor:
    """int32 bits of ``value * 2^-120`` per uint8 code (exact in fp64, then in fp32: the
    subnormal codes' ``mmm * 2^-129`` are fp32 subnormals); NaN codes -> +-480 * 2^-120."""
    v = codes.view(FP8_DTYPE).double()
    nan = torch.isnan(v)
    v[nan] = torch.where(codes[nan] >= 0x80, -480.0, 480.0).double()
    return (v * 2.0**-120).float().view(torch.int32)


@triton.jit
def _unpack_kernel(C, OUT, EMULATE: tl.constexpr):
    offs = tl.arange(0, 4)[:, None] * 256 + tl.arange(0, 256)[None, :]
    tl.store(OUT + offs, dlk._e4m3_scaled(tl.load(C + offs), EMULATE))


def all_codes_every_position(device) -> torch.Tensor:
    """[4, 256] uint8: row r is every code rolled by r, so each code sits at every byte
    position of a 32-bit word (the compiled path unpacks four codes a word)."""
    codes = torch.arange(256, dtype=torch.int32)
    return torch.stack([codes.roll(r) for r in range(4)]).to(torch.uint8).to(device)


@pytest.mark.parametrize(
    "emulate", [True, pytest.param(False, marks=pytest.mark.gpu, id="ptx")], ids=str
)
def test_every_code_unpacks_exactly(emulate, device):
    codes = all_codes_every_position(device)
    out = torch.empty(4, 256, dtype=torch.float32, device=device)
    _unpack_kernel[(1,)](codes.view(FP8_DTYPE), out, EMULATE=emulate)
    got, want = out.view(torch.int32).cpu(), expected_bits(codes.cpu())
    assert torch.equal(got, want), (got != want).nonzero()[:8]
    finite = ~torch.isin(codes.cpu(), torch.tensor(NAN_CODES, dtype=torch.uint8))
    torch.testing.assert_close(  # the codes' values, where torch's cast defines them
        out.cpu()[finite].double() * 2.0**120, codes.cpu()[finite].view(FP8_DTYPE).double(),
        rtol=0, atol=0,
    )  # fmt: skip


def _run_asm(asm: str, word: int) -> list[int]:
    """The four outputs of the compiled unpacking (``E4M3X4_ASM``) on one 32-bit word, by a
    small interpreter of the PTX it is written in (prmt, shr.s32, shl.b32, and.b32)."""
    regs = {"$4": word}

    def val(tok):
        return regs[tok] if tok in regs else int(tok, 0)

    for op, dst, *src in re.findall(r"(\w+\.\w+) ([$\w]+), ([$\w]+)(?:, ([$\w]+))?(?:, (\w+))?;",
                                    asm):  # fmt: skip
        src = [s for s in src if s]
        if op == "prmt.b32":
            pool = [(val(src[0]) >> 8 * i) & 0xFF for i in range(4)]
            pool += [(val(src[1]) >> 8 * i) & 0xFF for i in range(4)]
            out = 0
            for i in range(4):
                nib = (val(src[2]) >> 4 * i) & 0xF
                byte = pool[nib & 7]
                if nib & 8:
                    byte = 0xFF if byte & 0x80 else 0
                out |= byte << 8 * i
        elif op == "shr.s32":
            a = val(src[0])
            out = ((a - (1 << 32) if a & 1 << 31 else a) >> val(src[1])) & 0xFFFFFFFF
        elif op == "shl.b32":
            out = (val(src[0]) << val(src[1])) & 0xFFFFFFFF
        elif op == "and.b32":
            out = val(src[0]) & val(src[1])
        else:
            raise AssertionError(f"unexpected instruction {op}")
        regs[dst] = out
    return [regs[f"${i}"] for i in range(4)]


def test_compiled_unpacking_is_the_same_bit_trick():
    """The PTX the GPU runs, interpreted here on every code at every byte position (the GPU
    test above runs it for real): output i is code i's ``value * 2^-120``."""
    gen = torch.Generator().manual_seed(0)
    for pos in range(4):
        for code in range(256):
            others = torch.randint(0, 256, (4,), generator=gen).tolist()
            others[pos] = code
            word = sum(b << 8 * i for i, b in enumerate(others))
            got = _run_asm(dlk.E4M3X4_ASM.value, word)
            want = expected_bits(torch.tensor(others, dtype=torch.uint8)).long() & 0xFFFFFFFF
            assert got == want.tolist(), (pos, code, [hex(g) for g in got])


# ----------------------------------------------------------------------------------- GEMV


def every_code_weight(n: int, k: int, device, gen: torch.Generator):
    """(strided e4m3 ``[n, k]`` view holding every finite code, random finite codes elsewhere
    and NaN codes in the row padding; fp32 row scales around 1 / (448 sqrt(k)))."""
    pick = torch.tensor(FINITE_CODES, dtype=torch.uint8)
    flat = pick[torch.randint(0, len(pick), (n * k,), generator=gen)]
    flat[: len(pick)] = pick
    flat = flat[torch.randperm(n * k, generator=gen)]
    base = torch.full((n, k + 7), NAN_CODES[0], dtype=torch.uint8)
    base[:, :k] = flat.view(n, k)
    scale = (0.5 + torch.rand(n, generator=gen)) / (448 * k**0.5)
    return base.to(device).view(FP8_DTYPE)[:, :k], scale.to(device)


def cvt_case(variant, batch, dtype, device, k=75):
    x, w, kw, ref_kw = make_case(variant, batch, dtype, device, k=k)
    wq, scale = every_code_weight(w.shape[0], k, device, torch.Generator().manual_seed(batch))
    kw["weight_scale"] = ref_kw["weight_scale"] = scale
    return x, wq, kw, ref_kw, wq.float() * scale[:, None]


def run_cvt(monkeypatch, cvt: int, x, wq, kw, ref_kw, **tune):
    """``run_both`` under ``_TUNE`` with the CUDA-core loop and ``CVT=cvt`` (asserted to
    resolve so), the rope caches of the kernel's call returned too."""
    monkeypatch.setattr(dl, "_TUNE", {"USE_DOT": 0, "CVT": cvt, **tune})
    variant = dl._variant(kw.get("residual"), bool(kw.get("swiglu")), kw.get("rope"))
    n_cols = wq.shape[0] // 2 if variant == "swiglu" else wq.shape[0]
    cfg = dl._config(x.dtype, x.shape[0], n_cols, x.shape[1], variant, x.device, FP8_DTYPE)
    assert cfg["CVT"] == cvt
    if kw.get("rope") is not None:
        for c in (kw["rope"].k_cache, kw["rope"].v_cache):
            c.fill_(float("nan"))
    got, ref = run_both(x, wq, kw, ref_kw)
    caches = (kw["rope"].k_cache.clone(), kw["rope"].v_cache.clone()) if "rope" in kw else ()
    return got, ref, caches


VARIANTS = ["plain", "norm", "residual", "norm_swiglu", "norm_rope", "norm_logits"]
GEMV_CASES = [(v, torch.bfloat16, b) for v in VARIANTS for b in (1, 2)]
GEMV_CASES += [(v, dt, 1) for v in ("norm_swiglu", "residual") for dt in (torch.float16,
                                                                          torch.float32)]  # fmt: skip


@pytest.mark.parametrize("variant, dtype, batch", GEMV_CASES)
@pytest.mark.parametrize("tune", [{"BLOCK_K": 32}, {}], ids=["bk32", "default"])
def test_cvt1_is_cvt0_bit_for_bit(variant, dtype, batch, tune, device, monkeypatch):
    """Odd N and K (a masked K tail; several K steps with BLOCK_K=32), strided x and weight,
    both accumulator shapes (batch 1, batch 2): the outputs (and the rope caches) are
    identical, and match the reference and fp64 as CVT=0 does."""
    x, wq, kw, ref_kw, w_deq = cvt_case(variant, batch, dtype, device)
    got0, ref, caches0 = run_cvt(monkeypatch, 0, x, wq, kw, ref_kw, **tune)
    got0 = got0.clone()
    got1, _, caches1 = run_cvt(monkeypatch, 1, x, wq, kw, ref_kw, **tune)
    assert not torch.isnan(got1).any()
    assert torch.equal(got1.view(torch.int8), got0.view(torch.int8))  # signed zeros too
    for c0, c1 in zip(caches0, caches1):
        assert torch.equal(c0.view(torch.int8), c1.view(torch.int8))
    assert_matches_reference(got1, ref, dtype)
    assert_near_fp64(got1, expected_fp64(x, w_deq, {**kw, "weight_scale": None}), dtype)


def test_cvt1_even_k_and_wide_x_range(device, monkeypatch):
    """An unmasked K (EVEN_K) and activations from 2^-20 to 2^20 (inside |x| < 2^28): the
    scaled products and sums round as the unscaled ones."""
    x, wq, kw, ref_kw, _ = cvt_case("plain", 1, torch.float32, device, k=64)
    x.mul_(torch.pow(2.0, torch.randint(-20, 21, x.shape, device=device)))
    got0 = run_cvt(monkeypatch, 0, x, wq, kw, ref_kw, BLOCK_K=32)[0].clone()
    got1 = run_cvt(monkeypatch, 1, x, wq, kw, ref_kw, BLOCK_K=32)[0]
    assert torch.equal(got1.view(torch.int32), got0.view(torch.int32))


def test_cvt_resolves_only_on_the_fp8_cuda_core_path(monkeypatch):
    """CVT=1 holds for FP8 weights without USE_DOT; tl.dot rows and bf16 weights get 0."""
    cpu = torch.device("cpu")

    def resolved(w_dtype=FP8_DTYPE, **tune):
        monkeypatch.setattr(dl, "_TUNE", {"CVT": 1, "USE_DOT": 0, **tune})
        return dl._config(torch.bfloat16, 1, 4096, 4096, "residual", cpu, w_dtype)["CVT"]

    assert resolved() == 1
    assert resolved(USE_DOT=1, BLOCK_N=16, BLOCK_K=256) == 0
    assert resolved(w_dtype=torch.bfloat16) == 0
    assert resolved(CVT=0) == 0
    monkeypatch.setattr(dl, "_TUNE", {})  # no table row sets it: the default is CVT=0
    for batch in (1, 2, 8, 32):
        assert dl._config(torch.bfloat16, batch, 4096, 4096, "residual", cpu, FP8_DTYPE)["CVT"] == 0


def test_nan_codes_are_never_silently_finite(device, monkeypatch):
    """``quantize_weight`` emits NaN codes only in a row whose scale is NaN / inf: that row's
    output is non-finite under CVT=1 as under CVT=0. A hand-made NaN code with a finite scale
    reads as +-480 under CVT=1 (documented); NAKTA_DEBUG=1 refuses it."""
    x, _, kw, ref_kw, _ = cvt_case("plain", 1, torch.bfloat16, device)
    w = torch.randn(45, 75, device=device)
    w[3, 7], w[9, 2] = float("inf"), float("nan")
    wq, scale = quantize_weight(w)
    assert ((wq.view(torch.uint8) & 0x7F) == 0x7F).any(1).nonzero().flatten().tolist() == [3, 9]
    kw["weight_scale"] = ref_kw["weight_scale"] = scale
    for cvt in (0, 1):
        got = run_cvt(monkeypatch, cvt, x, wq, kw, ref_kw)[0]
        assert (~torch.isfinite(got[0, [3, 9]])).all() and torch.isfinite(got[0, :3]).all()
    wq, scale = every_code_weight(45, 75, device, torch.Generator().manual_seed(3))
    wq[5, 4] = torch.tensor(NAN_CODES[1], dtype=torch.uint8).view(FP8_DTYPE)
    kw["weight_scale"] = ref_kw["weight_scale"] = scale
    got = run_cvt(monkeypatch, 1, x, wq, kw, ref_kw)[0]
    assert torch.isfinite(got).all()
    monkeypatch.setenv("NAKTA_DEBUG", "1")
    with pytest.raises(ValueError, match="NaN codes"):
        dl.decode_linear(x, wq, **kw)
    if device.type == "cuda":  # the interpreter's own e4m3 cast reads NaN codes as +-480 too
        monkeypatch.setattr(dl, "_TUNE", {"USE_DOT": 0, "CVT": 0})
        assert torch.isnan(dl.decode_linear(x, wq, **kw)[0, 5])


def test_tuned_rows_without_cvt_load_as_cvt0(tmp_path):
    """Rows written before the CVT knob load with CVT=0; rows with it keep it."""
    old = dict(USE_DOT=0, BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=3, DOT_F16=0)
    path = tmp_path / "tuned.json"
    k1, k2 = (
        cfgs.fp8_tuned_key(1, "residual", 4096, 4096),
        cfgs.fp8_tuned_key(1, "rope", 12288, 4096),
    )
    entries = {k1: old, k2: {**old, "CVT": 1}}
    path.write_text(json.dumps({"devices": {"h200": {"entries": entries}}}))
    table = cfgs.load_fp8_tuned(path)["h200"]
    assert table[("float8_e4m3fn", 1, "residual", 4096, 4096)] == {**old, "CVT": 0}
    assert table[("float8_e4m3fn", 1, "rope", 12288, 4096)] == {**old, "CVT": 1}


GPU_TILES = [(v, n, k, {}) for v, n, k in LLAMA7B[:4]]  # this GPU's table rows
GPU_TILES += [("residual", 4096, 4096, dict(BLOCK_N=8, BLOCK_K=256, num_warps=2))]


@pytest.mark.gpu
@pytest.mark.parametrize("variant, n, k, tune", GPU_TILES)
def test_gpu_cvt1_is_cvt0_bit_for_bit_llama7b(variant, n, k, tune, monkeypatch):
    """The compiled (PTX) unpacking at 7B shapes, batch 1: the tiles the tables give this GPU
    (tuned rows where there are) and one more."""
    device = torch.device("cuda")
    x, w, kw, ref_kw = make_case(variant, 1, torch.bfloat16, device, k=k, n=n,
                                 heads=(32, 32, 128))  # fmt: skip
    wq, scale = quantize_weight(w)
    kw["weight_scale"] = ref_kw["weight_scale"] = scale
    got0 = run_cvt(monkeypatch, 0, x, wq, kw, ref_kw, **tune)[0].clone()
    got1, ref, _ = run_cvt(monkeypatch, 1, x, wq, kw, ref_kw, **tune)
    assert torch.equal(got1.view(torch.int16), got0.view(torch.int16))
    assert_matches_reference(got1, ref, torch.bfloat16)
