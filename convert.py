"""Convert a Meta or HF LLaMA checkpoint into a Nakta checkpoint at any tensor-parallel size.

    python convert.py IN OUT [--tp N] [--dtype bf16|fp16|fp32] [--quant fp8] [--force]

IN is either a Meta checkpoint directory (``consolidated.NN.pth`` shards, any count, and
``params.json``) or a HF LLaMA directory (``config.json`` and ``*.safetensors`` or
``pytorch_model*.bin``, with or without an index json; tied embeddings are fine). OUT gets fused
``wqkv`` / ``w13`` weights split for ``--tp`` ranks, a ``params.json`` and a ``manifest.json``
(see ``nakta_model/checkpoint.py``). Sources are memory-mapped and every output tensor is
written as soon as it is built, so even 65B converts without holding the model in memory.

``--quant fp8`` writes an FP8 checkpoint: each rank's ``wqkv``/``wo``/``w13``/``w2`` in e4m3
with one fp32 scale per output channel of its shard (round to nearest, no calibration data),
the rest in ``--dtype``; about half the bytes. It loads with ``quant="fp8"`` only.

Everything is checked before a byte is written: shard set, tensor names, shapes against the
params, tp divisibility. OUT is written to a temporary directory and renamed at the end.

OUT must not be IN, contain IN, or lie inside IN, and is never a symlink or a file. ``--force``
replaces an existing OUT only when it is a Nakta checkpoint holding nothing but its own files
(its ``manifest.json`` lists them), and only if it is still that same directory when the new
one is complete; a directory that appears at OUT during the conversion is left alone (exit 2).
SIGINT/SIGTERM remove the partial output (exit status 130/143); temporary directories left by
a conversion that was killed outright are removed by the next conversion into the same parent.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from nakta_model.checkpoint import CheckpointError, check_replaceable, write_checkpoint
from nakta_model.io_utils import check_output_dir
from nakta_model.sources import open_source

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def check_output(in_dir: Path, out_dir: Path, force: bool) -> None:
    """Refuse, before any work, an OUT that convert must not create or replace: never the
    source, never a symlink or a file, an existing OUT only with ``force`` and only a Nakta
    checkpoint holding nothing else (``checkpoint.check_replaceable``)."""
    if not in_dir.is_dir():
        raise CheckpointError(f"input {in_dir} is not a directory")
    check_output_dir(out_dir, force, source=in_dir, may_replace=check_replaceable)


def convert(
    in_dir: str | Path,
    out_dir: str | Path,
    tp: int = 1,
    dtype: torch.dtype | None = None,
    force: bool = False,
    quiet: bool = False,
    quant: str | None = None,
) -> Path:
    """IN (Meta or HF, ``sources.open_source``) -> a Nakta checkpoint at OUT for ``tp`` ranks;
    every check (OUT, names, shapes, tp, dtype) before a byte is written."""
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp!r}")
    check_output(in_dir, out_dir, force)
    src = open_source(in_dir, quiet)
    src.args.check_tp(tp)
    dtype = dtype or src.dtype
    if dtype not in DTYPES.values():
        raise CheckpointError(f"source dtype {dtype} is not bf16/fp16/fp32; pass --dtype")
    return write_checkpoint(
        out_dir,
        src.args,
        src.get,
        tp,
        dtype,
        force=force,
        tokenizer=src.tokenizer,
        progress=not quiet,
        quant=quant,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="convert.py", description=__doc__.split("\n\n")[0].strip()
    )
    parser.add_argument("input", type=Path, help="Meta checkpoint dir or HF LLaMA dir")
    parser.add_argument("output", type=Path, help="Nakta checkpoint dir to create")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="output dtype (default: source)")
    parser.add_argument(
        "--quant", choices=["fp8"], help="fp8: e4m3 block matrices + per-channel scales"
    )
    parser.add_argument(
        "--force", action="store_true", help="replace an existing OUT that is a Nakta checkpoint"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    ns = parser.parse_args(argv)
    if ns.tp < 1:
        parser.error(f"--tp must be >= 1, got {ns.tp}")
    try:
        out = convert(
            ns.input,
            ns.output,
            tp=ns.tp,
            dtype=DTYPES[ns.dtype] if ns.dtype else None,
            force=ns.force,
            quiet=ns.quiet,
            quant=ns.quant,
        )
    except (CheckpointError, ValueError, TypeError, OSError) as e:
        print(f"convert.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # SIGTERM's default action ends the process after the cleanup
        print("convert.py: interrupted; no partial output left behind", file=sys.stderr)
        return 130
    if not ns.quiet:
        print(f"wrote {out} (tp={ns.tp}{', fp8' if ns.quant else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
