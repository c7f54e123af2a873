"""quant="fp8" end to end on the CPU (reference kernels, the exact fp32 FP8 GEMM): the model is
the bf16 model with its block matrices and their inputs quantized by the FP8 rule, nothing else;
FP8 checkpoints round-trip; mismatches and unsupported devices fail clearly. At a few rows (a
short prompt's prefill) the W8A8 products run the decode step's ``fp8_decode_gemm``
(``_Ops.fp8_matmul``): the same function, summation order only."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_factory import TINY_PARAMS, write_meta_checkpoint

import convert
from nakta_model import checkpoint as ck
from nakta_model.config import ModelArgs
from nakta_model.fp8 import Fp8Linear, check_fp8_device, check_quant, quantize_state
from nakta_model.kernels import fp8_decode_gemm as fdg
from nakta_model.kernels import fp8_gemm
from nakta_model.kernels.fp8_gemm import fp8_matmul, fp8_matmul_reference
from nakta_model.kernels.fp8_quant import (
    FP8_DTYPE,
    dequantize_rows,
    quantize_rows_reference,
    quantize_weight,
)
from nakta_model.layout import CheckpointError
from nakta_model.loading import load, random_model
from nakta_model.model import _Ops
from nakta_model.parallel import ParallelContext

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=16)


def _tokens(n=2, s=9, vocab=96, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, s), generator=g)


def test_quantize_rows_reference_rule():
    x = torch.randn(7, 45, dtype=torch.bfloat16) * torch.logspace(-3, 3, 7)[:, None]
    x[3] = 0
    q, s = quantize_rows_reference(x)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32 and q.shape == (7, 45)
    amax = x.float().abs().amax(1)
    assert torch.equal(s[amax > 0], (amax / 448)[amax > 0])
    assert q.float().abs().amax(1)[amax > 0].eq(448).all()  # the largest value maps to 448
    assert q[3].float().eq(0).all()
    rel = (dequantize_rows(q, s) - x.float()).abs() / amax.clamp_min(1e-30)[:, None]
    assert rel.max() <= 2**-4 + 1e-6  # half an e4m3 ulp at the top binade, relative to amax


def test_quantize_weight_per_channel_and_fp8_matmul():
    w = torch.randn(40, 48) * torch.linspace(0.01, 10, 40)[:, None]
    wq, ws = quantize_weight(w)
    ref_q, ref_s = quantize_rows_reference(w)
    assert torch.equal(wq.float(), ref_q.float()) and torch.equal(ws, ref_s)
    x = torch.randn(5, 48)
    xq, xs = quantize_rows_reference(x)
    out = fp8_matmul(xq, xs, wq, ws, torch.float32)
    want = dequantize_rows(xq, xs).double() @ dequantize_rows(wq, ws).double().t()
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(out, fp8_matmul_reference(xq, xs, wq, ws, torch.float32))


def test_fp8_matmul_checks_its_inputs():
    xq, xs = quantize_rows_reference(torch.randn(3, 16))
    wq, ws = quantize_weight(torch.randn(8, 16))
    with pytest.raises(TypeError, match="xq"):
        fp8_matmul(xq.float(), xs, wq, ws)
    with pytest.raises(ValueError, match="same K"):
        fp8_matmul(xq, xs, wq[:, :8], ws)
    with pytest.raises(ValueError, match="one scale per row"):
        fp8_matmul(xq, xs[:2], wq, ws)
    with pytest.raises(TypeError, match="out_dtype"):
        fp8_matmul(xq, xs, wq, ws, torch.int32)


def test_check_quant_and_device(monkeypatch):
    assert check_quant(None) is None and check_quant("FP8") == "fp8" and check_quant("none") is None
    with pytest.raises(ValueError, match="quant must be None or 'fp8'"):
        check_quant("int4")
    with pytest.raises(TypeError, match="quant"):
        check_quant(8)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"compute capability >= 8.9.*cpu"):
        check_fp8_device("cpu")
    with pytest.raises(ValueError, match="compute capability"):
        random_model(ARGS, "cpu", torch.float32, quant="fp8")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_fp8_device("cpu")


def _dequantized_twin(model_fp8, model_bf):
    """The high-precision model whose block matrices are the FP8 model's, dequantized."""
    sd = model_bf.state_dict()
    for name, t in model_fp8.state_dict().items():
        if t.dtype == FP8_DTYPE:
            sd[name] = dequantize_rows(t, model_fp8.state_dict()[name + "_scale"]).to(
                sd[name].dtype
            )
    model_bf.load_state_dict(sd)
    return model_bf


def test_random_model_fp8_is_the_quantized_twin_and_close_to_it():
    bf = random_model(ARGS, "cpu", torch.float32, seed=5, kernels="reference")
    f8 = random_model(ARGS, "cpu", torch.float32, seed=5, kernels="reference", quant="fp8")
    assert f8.quant == "fp8" and bf.quant is None
    lin = f8.layers[0].attention.wqkv
    assert isinstance(lin, Fp8Linear) and lin.weight.dtype == FP8_DTYPE
    assert f8.tok_embeddings.weight.dtype == torch.float32 and f8.dtype == torch.float32
    for name, t in bf.state_dict().items():
        got = f8.state_dict()[name]
        if got.dtype == FP8_DTYPE:
            q, s = quantize_weight(t)
            assert torch.equal(got.float(), q.float()), name
            assert torch.equal(f8.state_dict()[name + "_scale"], s), name
        else:
            assert torch.equal(got, t), name
    tokens = _tokens()
    out8 = f8(tokens)
    ref = bf(tokens)
    assert torch.isfinite(out8).all()
    rel = (out8 - ref).norm() / ref.norm()
    assert 0 < rel < 0.1, rel  # FP8 differs, and only by quantization noise


def test_fp8_forward_equals_quantize_then_matmul_at_each_block():
    """One block by hand: norm -> quantize rows -> FP8 GEMM, exactly what the model computes."""
    f8 = random_model(ARGS, "cpu", torch.float32, seed=2, kernels="reference", quant="fp8")
    lin = f8.layers[0].feed_forward.w2
    x = torch.randn(6, lin.in_features)
    xq, xs = quantize_rows_reference(x)
    want = fp8_matmul_reference(xq, xs, lin.weight, lin.weight_scale, torch.float32)
    f8.ops.act_dtype = torch.float32
    assert torch.equal(lin(x), want)


def test_module_to_dtype_keeps_fp8_buffers():
    f8 = random_model(ARGS, "cpu", torch.float32, seed=2, kernels="reference", quant="fp8")
    scale = f8.layers[1].attention.wo.weight_scale.clone()
    f8 = f8.to(torch.bfloat16)
    wo = f8.layers[1].attention.wo
    assert wo.weight.dtype == FP8_DTYPE and torch.equal(wo.weight_scale, scale)
    assert f8.dtype == torch.bfloat16
    out = f8(_tokens())
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_checkpoint_round_trip(tmp_path, tp):
    meta = write_meta_checkpoint(tmp_path / "meta", TINY_PARAMS, seed=4)
    out = convert.convert(meta, tmp_path / "fp8", tp=tp, quiet=True, quant="fp8")
    params = json.loads((out / "params.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    assert params["quant"] == "fp8" and manifest["quant"] == "fp8"
    plain = convert.convert(meta, tmp_path / "plain", tp=tp, quiet=True)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    plain_size = sum(f.stat().st_size for f in plain.glob("*.safetensors"))
    assert size < plain_size  # fp32 source: block matrices at a quarter of the bytes
    for rank in range(tp):
        ctx = ParallelContext(rank, tp) if tp > 1 else None
        from_fp8 = load(out, "cpu", None, ctx, kernels="reference", quant="fp8")
        at_load = load(plain, "cpu", None, ctx, kernels="reference", quant="fp8")
        a, b = from_fp8.state_dict(), at_load.state_dict()
        assert a.keys() == b.keys()
        for name in a:  # each rank's shard quantized with its own channels' scales
            assert a[name].dtype == b[name].dtype, name
            assert torch.equal(a[name].float(), b[name].float()), name
        if tp == 1:
            tokens = _tokens(vocab=TINY_PARAMS["vocab_size"])
            assert torch.equal(from_fp8(tokens), at_load(tokens))


def test_fp8_checkpoint_without_quant_is_refused(tmp_path):
    meta = write_meta_checkpoint(tmp_path / "meta", TINY_PARAMS, seed=4)
    out = convert.convert(meta, tmp_path / "fp8", quiet=True, quant="fp8")
    with pytest.raises(CheckpointError, match="FP8 checkpoint.*quant='fp8'"):
        load(out, "cpu", None, kernels="reference")


def test_fp8_manifest_mismatch_is_refused(tmp_path):
    meta = write_meta_checkpoint(tmp_path / "meta", TINY_PARAMS, seed=4)
    out = convert.convert(meta, tmp_path / "plain", quiet=True)
    params = json.loads((out / "params.json").read_text())
    params["quant"] = "fp8"  # a bf16 checkpoint whose params claim FP8
    (out / "params.json").write_text(json.dumps(params))
    with pytest.raises(CheckpointError):
        ck.load_rank_state_dict(out, verify="size")


def test_quantize_state_keeps_quantized_and_requires_scales():
    w = torch.randn(8, 16)
    state = {"layers.0.attention.wo.weight": w, "norm.weight": torch.ones(16)}
    quantize_state(state)
    assert state["layers.0.attention.wo.weight"].dtype == FP8_DTYPE
    assert state["layers.0.attention.wo.weight_scale"].shape == (8,)
    assert state["norm.weight"].dtype == torch.float32
    bad = {"layers.0.attention.wo.weight": state["layers.0.attention.wo.weight"]}
    with pytest.raises(ValueError, match="no .*weight_scale"):
        quantize_state(bad)


def test_convert_cli_quant(tmp_path, capsys):
    meta = write_meta_checkpoint(tmp_path / "meta", TINY_PARAMS, seed=4)
    assert convert.main([str(meta), str(tmp_path / "o"), "--quant", "fp8", "--quiet"]) == 0
    with pytest.raises(SystemExit):
        convert.main([str(meta), str(tmp_path / "o2"), "--quant", "int4"])
    assert "invalid choice" in capsys.readouterr().err


def test_fp8_triton_kernels_path_matches_reference_path():
    """The interpreter runs the quantizing norm / SwiGLU / row kernels and the packed attention:
    the same function as the reference path, up to the attention's summation order."""
    f8 = random_model(ARGS, "cpu", torch.float32, seed=6, kernels="triton", quant="fp8")
    tokens = _tokens(n=1, s=7)
    n = tokens.shape[1]
    pos = torch.arange(n)
    fused = f8.forward_packed(tokens[0], pos, torch.zeros(n, dtype=torch.long), None, pos)
    f8.kernels = "reference"
    ref = f8.forward_packed(tokens[0], pos, torch.zeros(n, dtype=torch.long), None, pos)
    assert torch.isfinite(fused).all()
    assert (fused - ref).norm() / ref.norm() < 1e-3


def test_fp8_decode_step_streams_e4m3_weights():
    """Generation on an FP8 model: the decode step passes each layer's scales (reference GEMVs
    on the CPU) and greedy decoding equals decoding the dequantized weights in fp32."""
    from nakta_model.generation.engine import Generator, greedy_requests

    f8 = random_model(ARGS, "cpu", torch.float32, seed=7, kernels="reference", quant="fp8")
    twin = _dequantized_twin(
        f8, random_model(ARGS, "cpu", torch.float32, seed=7, kernels="reference")
    )
    ps = [[1, 5, 9, 13], [1, 40, 2, 77, 31]]
    got = Generator(f8, max_batch=2, max_seq_len=32, chunk=3).generate(greedy_requests(ps, 6, None))
    want = Generator(twin, max_batch=2, max_seq_len=32, chunk=3).generate(
        greedy_requests(ps, 6, None)
    )
    assert [len(r.tokens) for r in got] == [6, 6]
    # decode (W8A16) = the twin's decode; prefill (W8A8) quantizes activations: first tokens
    # may differ only where the twin's logits are near-tied, so compare from the decode step on
    assert sum(a == b for x, y in zip(got, want) for a, b in zip(x.tokens, y.tokens)) >= 9


def test_peers_read_an_fp8_checkpoint_dequantized(tmp_path):
    """llama_org / HF get an FP8 checkpoint's weights as what its codes stand for."""
    from nakta_model.sources import open_checkpoint

    meta = write_meta_checkpoint(tmp_path / "meta", TINY_PARAMS, seed=4)
    out = convert.convert(meta, tmp_path / "fp8", tp=2, quiet=True, quant="fp8")
    src = open_checkpoint(out)
    assert "FP8 dequantized" in src.description
    ref = torch.load(meta / "consolidated.00.pth", weights_only=True)
    wq = src.get("layers.0.attention.wq.weight")
    assert wq.dtype == src.dtype and wq.shape == ref["layers.0.attention.wq.weight"].shape
    want = ref["layers.0.attention.wq.weight"].float()
    q, s = quantize_rows_reference(want)
    assert torch.allclose(wq.float(), dequantize_rows(q, s), rtol=1e-6, atol=1e-7)
    assert torch.equal(src.get("norm.weight"), ref["norm.weight"])


def test_quantized_is_the_fp8_twin_and_names_what_is_wrong():
    """``loading.quantized``: the same block matrices quantized, the rest shared; a bad call
    says which argument is wrong (an FP8 model given was reported as a bad ``quant``)."""
    from nakta_model.loading import quantized

    bf = random_model(ARGS, "cpu", torch.float32, seed=5, kernels="reference")
    f8 = random_model(ARGS, "cpu", torch.float32, seed=5, kernels="reference", quant="fp8")
    twin = quantized(bf)
    assert twin.quant == "fp8" and bf.quant is None
    want = f8.state_dict()
    for name, t in twin.state_dict().items():
        assert t.dtype == want[name].dtype and torch.equal(t.float(), want[name].float()), name
    assert twin.tok_embeddings.weight.data_ptr() == bf.tok_embeddings.weight.data_ptr()
    with pytest.raises(ValueError, match="model is already quantized"):
        quantized(f8)
    with pytest.raises(ValueError, match="quant must be 'fp8', got None"):
        quantized(bf, "none")


def test_peers_read_an_fp8_checkpoint_dequantized_whatever_the_quant_spelling(tmp_path):
    """params.json's ``"quant": "FP8"`` loads (check_quant takes any case), so the peers must
    get it dequantized too, never the raw e4m3 codes."""
    from nakta_model.sources import open_checkpoint

    meta = write_meta_checkpoint(tmp_path / "meta", TINY_PARAMS, seed=4)
    out = convert.convert(meta, tmp_path / "fp8", quiet=True, quant="fp8")
    for name in ("params.json", "manifest.json"):
        doc = json.loads((out / name).read_text())
        text = json.dumps({**doc, "quant": "FP8"}, indent=2, sort_keys=True) + "\n"
        (out / name).write_text(text)  # the same size: verify=False checks sizes only
    src = open_checkpoint(out, verify=False)
    assert "FP8 dequantized" in src.description
    assert src.get("layers.0.attention.wq.weight").dtype == src.dtype


def test_run_all_fp8_engines_on_a_device_without_fp8_is_one_error_line(monkeypatch, capsys):
    from speed_bench import run_all

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(SystemExit) as e:
        run_all.main(["--engines", "nakta_cache_fp8", "--limit", "2", "--device", "cpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "compute capability >= 8.9" in err and "Traceback" not in err


# ------------------------------------------- W8A8 at a few rows: the decode step's FP8 GEMM
def _gemm_inputs(rows: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    xq = (torch.randn(rows, k, generator=g) * 4).to(FP8_DTYPE)
    wq = (torch.randn(n, k, generator=g) * 2).to(FP8_DTYPE)
    xs = torch.rand(rows, generator=g) * 0.02 + 1e-3
    ws = torch.rand(n, generator=g) * 0.02 + 1e-3
    return xq, xs, wq, ws


@pytest.fixture
def spy(monkeypatch):
    """Counts the calls of ``fp8_decode_gemm`` and of cuBLASLt's ``fp8_matmul``, with the
    small-product path on up to its ``MAX_ROWS`` (off by default: ``FP8_SMALL_GEMM_ROWS``)."""
    import nakta_model.model as model_module

    monkeypatch.setattr(model_module, "FP8_SMALL_GEMM_ROWS", fdg.MAX_ROWS)
    calls = {"triton": 0, "cublaslt": 0}
    small, big = fdg.fp8_decode_gemm, fp8_gemm.fp8_matmul

    def small_spy(*a, **kw):
        calls["triton"] += 1
        return small(*a, **kw)

    def big_spy(*a, **kw):
        calls["cublaslt"] += 1
        return big(*a, **kw)

    monkeypatch.setattr(fdg, "fp8_decode_gemm", small_spy)
    monkeypatch.setattr(fp8_gemm, "fp8_matmul", big_spy)
    monkeypatch.setattr(fdg, "_TUNE", dict(BLOCK_N=32, BLOCK_K=32))  # several tiles, K steps
    return calls


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_few_rows_take_the_decode_gemm(rows, out_dtype, spy):
    """N = 70 and K = 100 are not multiples of the tiles; a non-contiguous x (every other row
    of a wider buffer)."""
    xq, xs, wq, ws = _gemm_inputs(2 * rows, 70, 100)
    xq, xs = xq[::2], xs[::2]
    got = _Ops("triton", "fp8").fp8_matmul(xq, xs, wq, ws, out_dtype)
    want = fp8_matmul_reference(xq, xs, wq, ws, out_dtype)
    assert spy == {"triton": 1, "cublaslt": 0}
    assert got.dtype == out_dtype and got.shape == (rows, 70)
    tol = 2.0**-7 if out_dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max())


def test_more_rows_and_the_reference_mode_keep_the_gemm(spy):
    xq, xs, wq, ws = _gemm_inputs(fdg.MAX_ROWS + 1, 48, 64)
    got = _Ops("triton", "fp8").fp8_matmul(xq, xs, wq, ws, torch.bfloat16)
    assert spy == {"triton": 0, "cublaslt": 1}
    torch.testing.assert_close(got, fp8_matmul_reference(xq, xs, wq, ws, torch.bfloat16))
    few = _gemm_inputs(4, 48, 64)
    _Ops("reference", "fp8").fp8_matmul(*few, torch.bfloat16)
    assert spy == {"triton": 0, "cublaslt": 2}


def test_fp8_small_gemm_rows_bounds_the_kernel_path(spy, monkeypatch):
    """``FP8_SMALL_GEMM_ROWS`` (benchmarks' A/B): 0 keeps every product on the GEMM."""
    import nakta_model.model as model_module

    monkeypatch.setattr(model_module, "FP8_SMALL_GEMM_ROWS", 3)
    ops = _Ops("triton", "fp8")
    ops.fp8_matmul(*_gemm_inputs(3, 40, 64), torch.bfloat16)
    ops.fp8_matmul(*_gemm_inputs(4, 40, 64), torch.bfloat16)
    monkeypatch.setattr(model_module, "FP8_SMALL_GEMM_ROWS", 0)
    ops.fp8_matmul(*_gemm_inputs(1, 40, 64), torch.bfloat16)
    assert spy == {"triton": 1, "cublaslt": 2}


def test_small_products_stay_on_cublaslt_by_default():
    """The default: every W8A8 product on cuBLASLt (a batch-1 call measured no faster with the
    Triton GEMM for its prompt; docs/fp8.md)."""
    import nakta_model.model as model_module

    assert model_module.FP8_SMALL_GEMM_ROWS == 0


def test_model_prefill_at_a_few_tokens_runs_the_decode_gemm(spy):
    """The packed forward of a 7-token prompt: every block matrix through ``fp8_decode_gemm``
    (4 a layer), logits as the reference path's up to summation order."""
    f8 = random_model(ARGS, "cpu", torch.float32, seed=6, kernels="triton", quant="fp8")
    tokens = torch.randint(0, ARGS.vocab_size, (7,), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(7)
    start = torch.zeros(7, dtype=torch.long)
    fused = f8.forward_packed(tokens, pos, start, None, pos)
    assert spy == {"triton": 4 * ARGS.n_layers, "cublaslt": 0}
    f8.kernels = "reference"
    ref = f8.forward_packed(tokens, pos, start, None, pos)
    assert (fused - ref).norm() / ref.norm() < 1e-3
