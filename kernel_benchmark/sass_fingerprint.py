"""sm_90 SASS of every Triton kernel launch a GPU-shaped scenario makes, fingerprinted without a GPU.

Why: a refactor of the kernel files (moves, renames, shared helpers, config tables) must not
change what runs on the GPU, and a GPU is not always at hand. This runs the public kernel APIs at
LLaMA shapes on CPU tensors with a stand-in CUDA driver (target sm_90, an H100/H200): Triton's
JIT cache hook captures each launch's specialization (signature, constexprs, alignment,
num_warps / num_stages) instead of launching it. Each distinct launch is then compiled with
Triton's bundled ptxas and disassembled (nvdisasm); the SASS, without addresses and with the
kernel's name replaced, is hashed. Equal hashes launch by launch mean the same machine code:
the same results and the same speed on that architecture. rope_te's angle pinning (``PIN``,
on only for CUDA tensors) is compiled on as well.

    python -m kernel_benchmark.sass_fingerprint --out before.json [--root OLD_CHECKOUT]
    python -m kernel_benchmark.sass_fingerprint --out after.json
    python -m kernel_benchmark.sass_fingerprint --compare before.json after.json

``--root`` imports ``nakta_model`` from another checkout (calls through public APIs only, so
an older tree works too). ``--parts`` picks kernels (default all; ~15 min on 2 cores cold,
Triton's cache makes reruns fast). Uses Triton 3.x internals (``knobs.runtime.jit_cache_hook``,
``ASTSource``): run it in a fresh process (it sets ``TRITON_INTERPRET=0``). Exit status of
``--compare``: 0 when every launch matches, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

PARTS = ("rmsnorm", "swiglu", "rope_qkv", "rope_te", "decode_linear", "decode_attention",
         "packed", "logprobs")  # fmt: skip


# ------------------------------------------------------------------------------ capture
class _Capture:
    """Stand-in CUDA driver (sm_90) and JIT hook: every launch is recorded, none compiled."""

    def __init__(self):
        import torch
        from triton import knobs
        from triton.backends.compiler import GPUTarget
        from triton.runtime.driver import driver

        self.target = GPUTarget("cuda", 90, 32)
        self.launches: list[tuple[str, dict]] = []
        self.label = ""
        self.seen: dict[str, int] = {}
        cap = self

        class Driver:
            def get_current_device(self):
                return 0

            def get_current_stream(self, device=None):
                return 0

            def get_current_target(self):
                return cap.target

            def get_active_torch_device(self):
                return torch.device("cpu")

            def get_device_interface(self):
                return torch.cuda

        driver.set_active(Driver())
        knobs.runtime.jit_cache_hook = self._hook

    def _hook(self, *args, **kwargs) -> bool:
        self.launches.append((self.label, kwargs))
        return True  # compiled later, never launched

    def mark(self, label: str) -> None:
        """Label the launches from here on (a repeated label gets a counter)."""
        self.seen[label] = self.seen.get(label, 0) + 1
        self.label = f"{label} #{self.seen[label]}"


def _import_kernels():
    """The kernel modules, with CPU tensors accepted where the launchers want CUDA ones."""
    from nakta_model.kernels import _checks

    _checks.check_triton_device = lambda *args, **kwargs: None  # before the modules bind it
    import importlib

    names = ("rmsnorm", "swiglu", "rope", "decode_linear", "decode_attention",
             "packed_attention", "logprobs")  # fmt: skip
    mods = {n: importlib.import_module(f"nakta_model.kernels.{n}") for n in names}
    try:
        mods["rope_te"] = importlib.import_module("nakta_model.kernels.rope_te")
    except ImportError:  # a tree from before the split: the TE API lived in rope.py
        mods["rope_te"] = mods["rope"]
    return mods


# ------------------------------------------------------------------------------ scenario
def _scenario(k: dict, mark: Callable[[str], None]) -> dict[str, Callable[[], None]]:
    """One function per part: public calls at the shapes (and dtypes, epilogues, formats) the
    GPU benches and the model use. Values do not matter, only what gets launched."""
    import torch

    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32

    def t(*shape, dtype=bf16):
        return torch.randn(*shape).to(dtype)

    def rmsnorm():
        for dtype in (bf16, f16, f32):
            for n in (4096, 5120, 6656, 8192, 20000, 200, 1280):
                for res in (False, True):
                    for cast in ("meta", "fp32"):
                        if cast == "fp32" and (dtype != bf16 or n not in (4096, 6656)):
                            continue
                        x, w, r = t(64, n, dtype=dtype), t(n, dtype=dtype), None
                        r = t(64, n, dtype=dtype) if res else None
                        mark(f"rmsnorm fwd {dtype} {n} res={res} {cast}")
                        k["rmsnorm"].rms_norm(x, w, 1e-6, r, cast)
                        mark(f"rmsnorm fwd+bwd {dtype} {n} res={res} {cast}")
                        xg, wg = x.requires_grad_(), w.requires_grad_()
                        out = k["rmsnorm"].rms_norm(xg, wg, 1e-6, r, cast)
                        outs = out if res else (out,)
                        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        mark("rmsnorm mixed")
        k["rmsnorm"].rms_norm(t(8, 4096), t(4096, dtype=f32))

    def swiglu():
        for dtype in (bf16, f16, f32):
            for f in (11008, 13824, 100):
                gu = t(32, 2 * f, dtype=dtype)
                for exact in (True, False):
                    mark(f"swiglu fwd {dtype} {f} exact={exact}")
                    k["swiglu"].swiglu(gu, exact=exact)
                mark(f"swiglu bwd {dtype} {f}")
                k["swiglu"].swiglu(gu.requires_grad_()).backward(torch.ones(32, f, dtype=dtype))
                mark(f"silu_mul {dtype} {f}")
                a, b = t(32, f, dtype=dtype).requires_grad_(), t(32, f, dtype=dtype)
                k["swiglu"].silu_mul(a, b).backward(torch.ones(32, f, dtype=dtype))

    def rope_qkv():
        rope = k["rope"]
        for dtype in (bf16, f16, f32):
            for nq, nkv, hd, rot in ((32, 32, 128, None), (40, 40, 128, None), (64, 8, 128, None),
                                     (8, 2, 64, 32)):  # fmt: skip
                tokens = 1024 if dtype == bf16 else 64
                cos, sin = rope.build_rope_cache(4096, rot or hd)
                args = (nq, nkv, hd)
                for il in (False, True):
                    qkv, pos = t(tokens, (nq + 2 * nkv) * hd, dtype=dtype), torch.arange(tokens)
                    kw = dict(interleaved=il, rotary_dim=rot)
                    mark(f"rope_qkv {dtype} {args} rot={rot} il={il}")
                    rope.apply_rope_qkv_(qkv, pos, cos, sin, *args, **kw)
                    kc = torch.zeros(tokens, nkv, hd, dtype=dtype)
                    mark(f"rope_qkv cache {dtype} {args} rot={rot} il={il}")
                    cache = dict(k_cache=kc, v_cache=kc.clone(), cache_slots=pos)
                    rope.apply_rope_qkv_(qkv, pos, cos, sin, *args, **kw, **cache)
                    mark(f"rope_qkv bwd {dtype} {args} rot={rot} il={il}")
                    q = qkv.clone().requires_grad_().clone()
                    o = rope.apply_rope_qkv_(q, pos, cos, sin, *args, **kw)
                    o.backward(torch.ones_like(o))
                mark(f"rope_qkv 3 tokens {dtype} {args}")
                qkv = t(3, (nq + 2 * nkv) * hd, dtype=dtype)
                rope.apply_rope_qkv_(qkv, torch.arange(3), cos, sin, *args, interleaved=True,
                                     rotary_dim=rot)  # fmt: skip

    def rope_te():
        rpe, apply = k["rope_te"].RotaryPositionEmbedding, k["rope_te"].apply_rotary_pos_emb
        for s, b, h, d, rp in ((4096, 16, 32, 128, 1.0), (512, 16, 32, 128, 1.0),
                               (1024, 16, 32, 128, 1.0), (4096, 2, 32, 128, 1.0),
                               (4096, 8, 32, 128, 1.0), (4096, 16, 8, 128, 1.0),
                               (4096, 16, 64, 128, 1.0), (4096, 16, 32, 512, 1.0),
                               (4096, 16, 32, 128, 0.5), (8, 1, 64, 128, 1.0)):  # fmt: skip
            x, emb = torch.empty(s, b, h, d, dtype=bf16), rpe(d, rp, device="cpu")(s)
            mark(f"te fwd {s} {b} {h} {d} {rp}")
            apply(x, emb, "sbhd")
            mark(f"te fwd start {s} {b} {h} {d} {rp}")
            starts = torch.randint(0, 10, (b,), dtype=torch.int32)
            apply(x, rpe(d, rp, device="cpu")(s + 10), "sbhd", start_positions=starts)
            mark(f"te bwd {s} {b} {h} {d} {rp}")
            apply(x.clone().requires_grad_(), emb, "sbhd").backward(torch.zeros_like(x))
            mark(f"te interleaved {s} {b} {h} {d} {rp}")
            apply(x, rpe(d, rp, interleaved=True, device="cpu")(s), "sbhd", interleaved=True)
        emb = rpe(64, device="cpu")(4096)
        mark("te bshd")
        apply(torch.empty(128, 16, 8, 64).transpose(0, 1), emb, "bshd")
        packed = torch.empty(2048, 8, 64)
        cu = torch.tensor([0, 100, 100, 300, 2048], dtype=torch.int32)
        mark("te thd")
        apply(packed, emb, "thd", cu_seqlens=cu)
        mark("te thd start")
        apply(packed, emb, "thd", cu_seqlens=cu, start_positions=torch.arange(4, dtype=torch.int32))
        mark("te thd cp2")
        cu2 = torch.tensor([0, 100, 100, 300, 4096], dtype=torch.int32)
        apply(packed, emb, "thd", cu_seqlens=cu2, cp_size=2, cp_rank=1)

    def decode_linear():
        dl, rope = k["decode_linear"], k["rope"]
        models = {"7B": (4096, 11008, 32, 32), "13B": (5120, 13824, 40, 40),
                  "gqa": (4096, 14336, 32, 8)}  # fmt: skip
        for name, (dim, hidden, nq, nkv) in models.items():
            cos, sin = rope.build_rope_cache(256, 128)
            for dtype in (bf16, f16, f32) if name == "7B" else (bf16,):
                for batch in (1, 2, 3, 8, 16, 32, 64):
                    x, nw = t(batch, dim, dtype=dtype), t(dim, dtype=dtype)
                    rows = torch.arange(batch)
                    kc = torch.zeros(64, nkv, 128, dtype=dtype)
                    ra = dl.RopeArgs(rows, cos, sin, nq, nkv, 128, kc, kc.clone(), rows)
                    w = torch.empty((nq + 2 * nkv) * 128, dim, dtype=dtype)
                    mark(f"decode_linear rope {name} {dtype} {batch}")
                    dl.decode_linear(x, w, norm_weight=nw, eps=1e-5, rope=ra)
                    mark(f"decode_linear wo {name} {dtype} {batch}")
                    dl.decode_linear(t(batch, nq * 128, dtype=dtype),
                                     torch.empty(dim, nq * 128, dtype=dtype),
                                     residual=t(batch, dim, dtype=dtype))  # fmt: skip
                    mark(f"decode_linear w13 {name} {dtype} {batch}")
                    w13 = torch.empty(2 * hidden, dim, dtype=dtype)
                    dl.decode_linear(x, w13, norm_weight=nw, eps=1e-5, swiglu=True)
                    mark(f"decode_linear w2 {name} {dtype} {batch}")
                    dl.decode_linear(t(batch, hidden, dtype=dtype),
                                     torch.empty(dim, hidden, dtype=dtype),
                                     residual=t(batch, dim, dtype=dtype))  # fmt: skip
                    if batch in (1, 8) and dtype == bf16:
                        mark(f"decode_linear head {name} {batch}")
                        dl.decode_linear(x, torch.empty(32000, dim, dtype=dtype), norm_weight=nw,
                                         eps=1e-5, out_dtype=f32)  # fmt: skip
                        mark(f"decode_linear plain {name} {batch}")
                        dl.decode_linear(x, torch.empty(1000, dim, dtype=dtype))

    def decode_attention():
        da = k["decode_attention"]
        for dtype in (bf16, f16, f32):
            for nq, nkv in ((32, 32), (32, 8), (32, 4)):
                for batch in (1, 8, 32):
                    q = t(batch, nq, 128, dtype=dtype)
                    s_max = 4096 if dtype == bf16 else 512
                    cache = torch.empty(batch, s_max, nkv, 128, dtype=dtype)
                    lens = torch.full((batch,), 100, dtype=torch.int32)
                    label = f"{dtype} {nq}/{nkv} batch {batch}"
                    mark(f"decode_attention {label}")
                    da.decode_attention(q, cache, cache.clone(), lens)
                    mark(f"decode_attention one split {label}")
                    da.decode_attention(q, cache, cache.clone(), lens, n_splits=1)
                    mark(f"decode_attention rows {label}")
                    da.decode_attention(q, cache, cache.clone(), lens, rows=torch.arange(batch))
        if not hasattr(da, "cascade_splits"):
            return  # an older tree: no cascade to compare
        for dtype in (bf16, f32):
            for nq, nkv in ((32, 32), (32, 8)):
                batch, s_max = 64, 1280
                q = t(batch, nq, 128, dtype=dtype)
                cache = torch.empty(batch + 3, s_max, nkv, 128, dtype=dtype)
                lens = torch.full((batch,), 900, dtype=torch.int32)
                pre = torch.full((batch,), 768, dtype=torch.int32)
                slots = (torch.tensor([batch + 1, batch + 2], dtype=torch.int32), pre[:2])
                mark(f"decode_attention cascade {dtype} {nq}/{nkv} batch {batch}")
                da.decode_attention(q, cache, cache.clone(), lens, rows=torch.arange(batch),
                                    prefix_rows=torch.full((batch,), batch + 1), prefix_lens=pre,
                                    prefix_slots=slots)  # fmt: skip

    def packed():
        import inspect

        pa = k["packed_attention"]
        start = (torch.arange(512, dtype=torch.int32) // 64) * 64
        # 64-token chains through the tree mask (a tree of branch ids before span ends)
        new_api = "span_end" in inspect.signature(pa.packed_attention).parameters
        tree = start + 64 if new_api else torch.zeros(512, dtype=torch.int32)
        for dtype in (bf16, f16, f32):
            for hq, hkv, hd in ((32, 32, 128), (32, 8, 128), (8, 8, 64), (4, 4, 32), (4, 4, 256),
                                (4, 4, 80)):  # fmt: skip
                mark(f"packed {dtype} {hq}/{hkv}x{hd}")
                qkv = t(512, (hq + 2 * hkv) * hd, dtype=dtype)
                pa.packed_attention(qkv, start, tree, hq, hkv, hd)
        if not new_api:
            return  # an older tree: no causal-only and prefix variants to compare
        for dtype in (bf16, f32):
            hq, hkv, hd = 32, 8, 128
            qkv = t(512, (hq + 2 * hkv) * hd, dtype=dtype)
            mark(f"packed causal {dtype} {hq}/{hkv}x{hd}")
            pa.packed_attention(qkv, start, None, hq, hkv, hd)
            pool = t(8 * 64, hkv, hd, dtype=dtype)
            prefix = pa.PrefixKV(
                pool, pool.clone(), torch.zeros(1, 2, dtype=torch.int32),
                torch.tensor([100], dtype=torch.int32), torch.zeros(512, dtype=torch.int32), 64,
            )  # fmt: skip
            mark(f"packed prefix {dtype} {hq}/{hkv}x{hd}")
            pa.packed_attention(qkv, start, start + 64, hq, hkv, hd, prefix=prefix)
            mark(f"packed prefix causal {dtype} {hq}/{hkv}x{hd}")
            pa.packed_attention(qkv, start, None, hq, hkv, hd, prefix=prefix)

    def logprobs():
        for dtype in (bf16, f32, f16):
            for vocab in (32000, 128256, 1000, 50):
                mark(f"logprobs {dtype} {vocab}")
                k["logprobs"].row_logsumexp_argmax(t(16, vocab, dtype=dtype))

    return dict(rmsnorm=rmsnorm, swiglu=swiglu, rope_qkv=rope_qkv, rope_te=rope_te,
                decode_linear=decode_linear, decode_attention=decode_attention, packed=packed,
                logprobs=logprobs)  # fmt: skip


# ------------------------------------------------------------------------------ compile
def _key(entry: dict) -> str:
    c = entry["compile"]
    fn = entry["fn"].jit_function.fn
    options = [c[k] for k in ("num_warps", "num_ctas", "num_stages", "enable_fp_fusion")]
    return repr((fn.__module__, fn.__name__, c["signature"], sorted(c["constants"].items()),
                 sorted(c["configs"][0].items()), options))  # fmt: skip


def _with_pin(entry: dict) -> dict | None:
    """The launch with ``PIN=True`` (what a CUDA tensor gets), for kernels that have it."""
    c = entry["compile"]
    names = list(c["signature"])
    if "PIN" not in names:
        return None
    constants = {**c["constants"], (names.index("PIN"),): True}
    return {**entry, "compile": {**c, "constants": constants}}


def _sass_hash(entry: dict, target) -> str:
    """Compile one captured launch for ``target``; hash its SASS (addresses and name removed)."""
    import triton
    from triton.compiler import ASTSource

    c = entry["compile"]
    jit = entry["fn"].jit_function
    src = ASTSource(jit, c["signature"], c["constants"], c["configs"][0])
    options = {k: c[k] for k in ("num_warps", "num_ctas", "num_stages", "enable_fp_fusion",
                                 "launch_cooperative_grid", "extern_libs")}  # fmt: skip
    kernel = triton.compile(src, target=target, options=options)
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.check_output([str(nvdisasm), "-c", f.name], text=True)
    lines = (re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).replace(jit.fn.__name__, "KERNEL").strip()
             for line in sass.splitlines())  # fmt: skip
    return hashlib.sha256("\n".join(x for x in lines if x).encode()).hexdigest()[:16]


def fingerprint(parts: list[str], jobs: int) -> list[dict]:
    """Run the scenario's ``parts``; one row per launch: label, index, kernel, SASS hash."""
    import multiprocessing

    capture = _Capture()
    steps = _scenario(_import_kernels(), capture.mark)
    for part in parts:
        steps[part]()
    entries, count = [], {}
    for label, entry in capture.launches:
        count[label] = count.get(label, -1) + 1
        entries.append((label, count[label], entry))
        pinned = _with_pin(entry)
        if pinned is not None:
            entries.append((label + " PIN", count[label], pinned))
    unique = {_key(e): e for _, _, e in entries}
    keys = list(unique)
    global _UNIQUE, _TARGET  # read by the forked workers
    _UNIQUE, _TARGET = unique, capture.target
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        hashes = dict(zip(keys, pool.map(_hash_key, keys, chunksize=1)))
    return [{"label": label, "index": i, "kernel": e["fn"].jit_function.fn.__name__,
             "sass": hashes[_key(e)]} for label, i, e in entries]  # fmt: skip


_UNIQUE: dict[str, dict] = {}
_TARGET = None


def _hash_key(key: str) -> str:
    return _sass_hash(_UNIQUE[key], _TARGET)


def compare(before: list[dict], after: list[dict]) -> list[str]:
    """Lines naming every launch whose SASS differs or that only one run made (empty: same)."""
    a = {(r["label"], r["index"]): r for r in before}
    b = {(r["label"], r["index"]): r for r in after}
    lines = [f"only in the first run: {k[0]} launch {k[1]}" for k in a if k not in b]
    lines += [f"only in the second run: {k[0]} launch {k[1]}" for k in b if k not in a]
    lines += [f"SASS differs: {k[0]} launch {k[1]} ({a[k]['kernel']})"
              for k in a if k in b and a[k]["sass"] != b[k]["sass"]]  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the fingerprints of this tree (or --root's) here")
    p.add_argument("--root", help="import nakta_model from this checkout")
    p.add_argument("--parts", default=",".join(PARTS), help=f"from {','.join(PARTS)}")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = p.parse_args(argv)
    if args.compare:
        before, after = (json.loads(Path(f).read_text()) for f in args.compare)
        lines = compare(before, after)
        print("\n".join(lines) or f"all {len(after)} launches: identical SASS")
        return 1 if lines else 0
    parts = args.parts.split(",")
    if not args.out or set(parts) - set(PARTS):
        p.error(f"give --out FILE (and --parts from {', '.join(PARTS)}), or --compare A B")
    os.environ["TRITON_INTERPRET"] = "0"  # real JIT functions; read when triton is imported
    if args.root:
        sys.path.insert(0, str(Path(args.root).resolve()))
    rows = fingerprint(parts, args.jobs)
    Path(args.out).write_text(json.dumps(rows, indent=0))
    tree = Path(sys.modules["nakta_model"].__file__).parents[1]
    print(f"{len(rows)} launches, {len({r['sass'] for r in rows})} distinct SASS of {tree}'s "
          f"kernels -> {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
