"""Instructions per weight element in the K loop of ``decode_linear``'s batch-1 FP8 GEMVs, from
sm_90 SASS compiled on the CPU (no GPU needed).

Why: the FP8 GEMVs stream less of the copy bandwidth than the bf16 ones, and FP8 moves half the
bytes per element, so per byte it needs twice the instructions. This counts, per launch config
and ``CVT`` (e4m3 -> fp32 by cvt instructions, 0, or by integer ops, 1), the SASS of the loop
that loads the weight (the loop holding the ``evict_first`` loads), by opcode, divided by the
weight elements one thread handles per iteration (``TILE_N * BLOCK_K / threads``), and the
registers per thread; ``--tune`` sets any ``_TUNE`` knobs. Launches are captured as
``sass_fingerprint`` does (stand-in sm_90 driver), compiled with Triton's ptxas and read back
with nvdisasm.

    python -m kernel_benchmark.sass_loop_counts [--family h100] [--kinds wqkv,w2]
        [--tune "CVT=0;CVT=1;BLOCK_K=512,CVT=1"]

``--family`` takes that device family's tuned rows (``_decode_linear_fp8_tuned.json``); the
default is the tables' generic rows. Run in a fresh process (it sets ``TRITON_INTERPRET=0``).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if not __package__:  # run by path: import from the repo root, not from this script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

KINDS = {  # LLaMA-7B batch-1 decode GEMVs: (N weight rows, K, variant)
    "wqkv": (12288, 4096, "rope"),
    "wo": (4096, 4096, "residual"),
    "w13": (22016, 4096, "swiglu"),
    "w2": (4096, 11008, "residual"),
}
GROUPS = ("FFMA", "HADD2.F32", "F2FP", "PRMT", "LOP3", "SHF", "IMAD", "FMUL", "BAR", "LDS")


def _bin(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _compile(entry: dict, target) -> tuple[str, int]:
    """(SASS text, registers per thread) of one captured launch."""
    import triton
    from triton.compiler import ASTSource

    c = entry["compile"]
    src = ASTSource(entry["fn"].jit_function, c["signature"], c["constants"], c["configs"][0])
    options = {k: c[k] for k in ("num_warps", "num_ctas", "num_stages", "enable_fp_fusion",
                                 "launch_cooperative_grid", "extern_libs")}  # fmt: skip
    kernel = triton.compile(src, target=target, options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.check_output([_bin("nvdisasm"), "-c", f.name], text=True)
        usage = subprocess.check_output([_bin("cuobjdump"), "--dump-resource-usage", f.name],
                                        text=True)  # fmt: skip
    return sass, int(re.search(r"REG:(\d+)", usage).group(1))


def weight_loop(sass: str) -> collections.Counter:
    """Opcode counts of the backward-branch loop that holds the weight's ``.EF`` loads."""
    ops, labels = [], {}
    for line in sass.splitlines():
        if m := re.match(r"^\s*(\.L_x_\d+):", line):
            labels[m.group(1)] = len(ops)
        elif m := re.match(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)([^;]*);", line):
            ops.append((m.group(1), m.group(2)))
    for i, (op, rest) in enumerate(ops):
        target = re.search(r"\.L_x_\d+", rest) if op == "BRA" else None
        if target and labels.get(target.group(0), i + 1) <= i:
            body = ops[labels[target.group(0)] : i + 1]
            if any(o.startswith("LDG") and ".EF" in o for o, _ in body):
                return collections.Counter(o for o, _ in body)
    raise ValueError("no loop with evict_first weight loads in the SASS")


def group(counts: collections.Counter) -> dict[str, int]:
    """Counts by ``GROUPS`` (an opcode's first word, or ``HADD2.F32``), the rest as other."""
    out = dict.fromkeys(GROUPS, 0) | {"other": 0, "all": sum(counts.values())}
    for op, n in counts.items():
        key = "HADD2.F32" if op.startswith("HADD2.F32") else op.split(".")[0]
        out[key if key in out else "other"] += n
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="", help="device family whose tuned rows to use")
    p.add_argument("--weight", choices=("fp8", "bf16"), default="fp8",
                   help="weight dtype (bf16: the same loop for comparison, per element)")  # fmt: skip
    p.add_argument("--tune", default="CVT=0;CVT=1", help="knob sets (;-separated K=V,K=V)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"subset of {','.join(KINDS)}")
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if set(kinds) - set(KINDS):
        p.error(f"--kinds must be a subset of {','.join(KINDS)}")
    try:
        tunes = [{k: int(v) for k, v in (kv.split("=") for kv in t.split(",") if kv)}
                 for t in args.tune.split(";")]  # fmt: skip
    except ValueError:
        p.error(f"--tune takes K=V,K=V;K=V..., got {args.tune!r}")
    os.environ["TRITON_INTERPRET"] = "0"
    import torch

    from kernel_benchmark.sass_fingerprint import _Capture, _import_kernels

    capture = _Capture()
    dl = _import_kernels()["decode_linear"]
    from nakta_model.kernels.fp8_quant import FP8_DTYPE
    from nakta_model.kernels.rope import build_rope_cache

    dl.device_family = lambda device: args.family
    bf16 = torch.bfloat16
    print(f"sm_90 SASS, {args.weight} weights, batch 1, family {args.family or '(generic rows)'}: instructions "
          "per weight element in the weight loop")  # fmt: skip
    head = ["kind", "CVT", "BLOCK_N", "BLOCK_K", "warps", "regs", "all", *GROUPS, "other"]
    print(" | ".join(head))
    for kind in kinds:
        n, k, variant = KINDS[kind]
        x, nw = torch.randn(1, k).to(bf16), torch.randn(k).to(bf16)
        w_dtype = FP8_DTYPE if args.weight == "fp8" else bf16
        w = torch.empty(n, k, dtype=w_dtype)
        kw: dict = {"weight_scale": torch.ones(n)} if args.weight == "fp8" else {}
        if variant == "rope":
            cos, sin = build_rope_cache(64, 128)
            rows, cache = torch.zeros(1, dtype=torch.long), torch.zeros(4, 32, 128, dtype=bf16)
            kw["rope"] = dl.RopeArgs(rows, cos, sin, 32, 32, 128, cache, cache.clone(), rows)
        elif variant == "swiglu":
            kw["swiglu"] = True
        else:
            kw["residual"] = torch.randn(1, n).to(bf16)
        if variant != "residual":
            kw |= {"norm_weight": nw, "eps": 1e-5}
        for tune in tunes:
            dl._TUNE = tune
            cfg = dl._config(bf16, 1, n // 2 if variant == "swiglu" else n, k, variant,
                             torch.device("cpu"), w_dtype)  # fmt: skip
            capture.launches.clear()
            dl.decode_linear(x, w, **kw)
            sass, regs = _compile(capture.launches[-1][1], capture.target)
            g = group(weight_loop(sass))
            per = cfg["TILE_N"] * cfg["BLOCK_K"] / (32 * cfg["num_warps"])
            cells = [
                kind,
                cfg.get("CVT", 0),
                cfg["BLOCK_N"],
                cfg["BLOCK_K"],
                cfg["num_warps"],
                regs,
            ]
            cells += [f"{g[key] / per:.2f}" for key in ("all", *GROUPS, "other")]
            print(" | ".join(map(str, cells)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
