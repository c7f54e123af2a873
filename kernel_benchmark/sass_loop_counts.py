"""Instructions per weight element in the K loop of ``decode_linear``'s batch-1 FP8 GEMVs, from
sm_90 SASS compiled on the CPU (no GPU needed).

Why: the batch-1 FP8 GEMVs stream less of the copy bandwidth than the bf16 ones; whether the
K loop is issue-bound (instructions per byte) or latency-bound (bytes in flight) is read from
its machine code. Per kind and launch-knob set (``--tune``, any ``_TUNE`` knobs: ``PREFETCH``,
``BLOCK_K``...) this prints, for the loop that loads the weight (the backward branch holding
the ``evict_first`` loads), its SASS by opcode divided by the weight elements one thread
handles per iteration (``TILE_N * BLOCK_K / threads``), the registers and spill stack per
thread, the programs an SM holds by registers and shared memory, the weight loads per iteration and
the weight bytes one SM has asked for at most (programs x tile bytes), from the TTGIR the
elements the loop moves between layouts per iteration (through shared memory) and the
layout its K lanes are summed in (same layout, same order, same bits). Launches are
captured as ``sass_fingerprint`` does (stand-in sm_90 driver), compiled with Triton's ptxas
and read back with nvdisasm; ``--dump DIR`` writes each one's TTGIR, PTX and SASS there.

    python -m kernel_benchmark.sass_loop_counts [--family h200] [--kinds wqkv,w2]
        [--tune "PREFETCH=0;PREFETCH=1;BLOCK_K=512,PREFETCH=1"] [--dump DIR]

``--family`` takes that device family's tuned rows (``_decode_linear_fp8_tuned.json``); the
default is the tables' generic rows. Run in a fresh process (it sets ``TRITON_INTERPRET=0``).
"""

from __future__ import annotations

import argparse
import collections
import math
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


def _compile(entry: dict, target) -> tuple[dict[str, str], int, int, int]:
    """({"ttgir", "ptx", "sass"} texts, registers a thread, stack (spill) bytes a thread,
    shared bytes) of one launch."""
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
    texts = {"ttgir": kernel.asm["ttgir"], "ptx": kernel.asm["ptx"], "sass": sass}
    regs, stack = (int(re.search(rf"{k}:(\d+)", usage).group(1)) for k in ("REG", "STACK"))
    return texts, regs, stack, int(kernel.metadata.shared)


# sm_90 limits per SM: registers, threads, resident blocks, shared memory a kernel may take
SM_REGS, SM_THREADS, SM_BLOCKS, SM_SMEM = 65536, 2048, 32, 227 * 1024


def programs_per_sm(regs: int, threads: int, smem: int) -> int:
    """Resident programs of one SM: registers (allocated 8 a thread at a time, per warp),
    threads, blocks and shared memory (1 KB reserved a block) permitting."""
    per_warp = 32 * (-(-regs // 8) * 8)
    by_regs = (SM_REGS // per_warp) // (threads // 32)
    by_smem = SM_SMEM // (smem + 1024) if smem else SM_BLOCKS
    return max(0, min(by_regs, SM_THREADS // threads, SM_BLOCKS, by_smem))


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


def weight_loads(counts: collections.Counter) -> tuple[int, int]:
    """(count, bytes a thread) of the loop's ``evict_first`` global loads (``LDG...EF[.width]``,
    width in bits, 32 when not written)."""
    n = nbytes = 0
    for op, c in counts.items():
        if op.startswith("LDG") and ".EF" in op:
            width = re.search(r"\.(8|16|32|64|128)$", op)
            n += c
            nbytes += c * (int(width.group(1)) if width else 32) // 8
    return n, nbytes


def _layouts(ttgir: str) -> dict[str, str]:
    """``#name`` -> its definition, from a TTGIR module's header."""
    return dict(re.findall(r"^(#\w+) = (.*)$", ttgir, flags=re.M))


def loop_conversions(ttgir: str) -> int:
    """Elements moved between layouts per iteration of the loop holding the weight's
    ``evict_first`` loads (``ttg.convert_layout`` in its body; shared memory on sm_90)."""
    lines = ttgir.splitlines()
    for i, line in enumerate(lines):
        if "scf.for" not in line:
            continue
        indent = len(line) - len(line.lstrip())
        end = next(j for j in range(i + 1, len(lines))
                   if lines[j].strip().startswith("}") and len(lines[j]) - len(lines[j].lstrip()) == indent)  # fmt: skip
        body = lines[i + 1 : end]
        if not any("evict_first" in b for b in body):
            continue
        moved = 0
        for b in body:
            if "ttg.convert_layout" in b and (m := re.search(r": tensor<([\dx]+)x\w+,", b)):
                moved += math.prod(int(d) for d in m.group(1).split("x"))
        return moved
    raise ValueError("no loop with evict_first weight loads in the TTGIR")


def reduce_layout(ttgir: str) -> str:
    """The layout of the first 2-D fp32 ``tt.reduce`` operand after the weight loop (the K
    lanes' sum): equal layouts reduce in the same order, so give the same bits."""
    loop = ttgir.index("evict_first")
    m = re.search(r"\}\) : \(tensor<\d+x\d+xf32, (#\w+)>\)", ttgir[loop:])
    if not m:
        raise ValueError("no 2-D fp32 reduction after the weight loop in the TTGIR")
    text = _layouts(ttgir)[m.group(1)]
    keys = ("sizePerThread", "threadsPerWarp", "warpsPerCTA", "order")
    return "/".join(
        re.search(rf"{k} = \[([\d, ]+)\]", text).group(1).replace(" ", "") for k in keys
    )


def _call_args(dl, kind: str, weight: str) -> tuple:
    """(x, weight, kwargs) of one kind's batch-1 ``decode_linear`` call (values do not matter)."""
    import torch

    from nakta_model.kernels.fp8_quant import FP8_DTYPE
    from nakta_model.kernels.rope import build_rope_cache

    bf16 = torch.bfloat16
    n, k, variant = KINDS[kind]
    x, nw = torch.randn(1, k).to(bf16), torch.randn(k).to(bf16)
    w = torch.empty(n, k, dtype=FP8_DTYPE if weight == "fp8" else bf16)
    kw: dict = {"weight_scale": torch.ones(n)} if weight == "fp8" else {}
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
    return x, w, kw


HEAD = ["kind", "knobs", "BLOCK_N", "BLOCK_K", "warps", "regs", "stack", "progs/SM", "LDG/iter",
        "B/thread/iter", "KB/SM asked", "moved/iter", "reduce layout", "all", *GROUPS,
        "other"]  # fmt: skip


def twins_differ(rows: list[dict]) -> list[str]:
    """Lines naming each ``PREFETCH=1`` row whose reduce layout or moved elements differ from
    its ``PREFETCH=0`` twin's (same kind and other knobs); empty: every pair agrees."""
    base = {(r["kind"], r["key"]): r for r in rows if not r["tune"].get("PREFETCH")}
    out = []
    for r in rows:
        twin = base.get((r["kind"], r["key"])) if r["tune"].get("PREFETCH") else None
        if twin and (twin["reduce"], twin["moved"]) != (r["reduce"], r["moved"]):
            out.append(f"{r['kind']} {r['tune']}: reduce {r['reduce']} moved {r['moved']} vs "
                       f"PREFETCH=0's {twin['reduce']} moved {twin['moved']}")  # fmt: skip
    return out


def _knob_sets(args, p, kind: str) -> list[dict[str, int]]:
    """``--tune``'s knob sets, or with ``--grid`` the tuner's batch-1 CUDA-core candidates."""
    if args.grid:
        from kernel_benchmark.tune_fp8_decode import candidates

        return [c for c in candidates(KINDS[kind][2], 1) if not c["USE_DOT"]]
    try:
        return [{k: int(v) for k, v in (kv.split("=") for kv in t.split(",") if kv)}
                for t in args.tune.split(";")]  # fmt: skip
    except ValueError:
        p.error(f"--tune takes K=V,K=V;K=V..., got {args.tune!r}")


SHOWN = ("BLOCK_N", "BLOCK_K", "num_warps", "USE_DOT", "DOT_F16", "num_stages")  # not in labels


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="", help="device family whose tuned rows to use")
    p.add_argument("--weight", choices=("fp8", "bf16"), default="fp8",
                   help="weight dtype (bf16: the same loop for comparison, per element)")  # fmt: skip
    p.add_argument("--tune", default="PREFETCH=0;PREFETCH=1",
                   help="knob sets (;-separated K=V,K=V)")  # fmt: skip
    p.add_argument("--kinds", default=",".join(KINDS), help=f"subset of {','.join(KINDS)}")
    p.add_argument("--grid", action="store_true",
                   help="the tuner's batch-1 CUDA-core candidates instead of --tune")  # fmt: skip
    p.add_argument("--dump", type=Path, default=None, help="write TTGIR / PTX / SASS here")
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if set(kinds) - set(KINDS):
        p.error(f"--kinds must be a subset of {','.join(KINDS)}")
    rows = []
    os.environ["TRITON_INTERPRET"] = "0"
    import torch

    from kernel_benchmark.sass_fingerprint import _Capture, _import_kernels

    capture = _Capture()
    dl = _import_kernels()["decode_linear"]
    dl.device_family = lambda device: args.family
    print(f"sm_90 SASS, {args.weight} weights, batch 1, family "
          f"{args.family or '(generic rows)'}: per weight element in the weight loop")  # fmt: skip
    print(" | ".join(HEAD))
    for kind in kinds:
        x, w, kw = _call_args(dl, kind, args.weight)
        n, k, variant = KINDS[kind]
        for tune in _knob_sets(args, p, kind):
            dl._TUNE = tune
            cfg = dl._config(torch.bfloat16, 1, n // 2 if variant == "swiglu" else n, k, variant,
                             torch.device("cpu"), w.dtype)  # fmt: skip
            capture.launches.clear()
            dl.decode_linear(x, w, **kw)
            texts, regs, stack, smem = _compile(capture.launches[-1][1], capture.target)
            label = ",".join(f"{a}={b}" for a, b in tune.items() if a not in SHOWN) or "tables"
            if args.dump:
                args.dump.mkdir(parents=True, exist_ok=True)
                for ext, text in texts.items():
                    (args.dump / f"{kind}_{label}.{ext}").write_text(text)
            counts = weight_loop(texts["sass"])
            g = group(counts)
            threads = 32 * cfg["num_warps"]
            per = cfg["TILE_N"] * cfg["BLOCK_K"] / threads
            n_ldg, ldg_bytes = weight_loads(counts)
            progs = programs_per_sm(regs, threads, smem)
            asked_kb = progs * threads * ldg_bytes / 1024
            moved, reduce = loop_conversions(texts["ttgir"]), reduce_layout(texts["ttgir"])
            key = tuple(sorted((a, b) for a, b in tune.items() if a != "PREFETCH"))
            rows.append(dict(kind=kind, tune=tune, key=key, moved=moved, reduce=reduce))
            cells = [kind, label, cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"], regs, stack,
                     progs,
                     n_ldg, ldg_bytes, f"{asked_kb:.0f}", moved, reduce]  # fmt: skip
            cells += [f"{g[key] / per:.2f}" for key in ("all", *GROUPS, "other")]
            print(" | ".join(map(str, cells)), flush=True)
    differ = twins_differ(rows)
    pairs = sum(1 for r in rows if r["tune"].get("PREFETCH"))
    print("\n".join(differ) or f"PREFETCH=1 vs its PREFETCH=0 twin: {pairs} launches, the same "
          "reduce layout and moved elements in every one")  # fmt: skip
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
