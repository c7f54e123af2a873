"""Build the two models the accuracy tools compare, from the same weights.

``nakta``: a Nakta checkpoint dir, or a Meta dir converted on the fly (``convert.py``) into a
temporary Nakta checkpoint, removed again as soon as the model is loaded (SIGINT/SIGTERM during
conversion and loading remove it too; one left by a killed process is removed by the next run). ``llama_org``: Meta's reference, from the Meta dir. ``random_pair``
draws one set of random Meta weights on the device and gives both models exactly those
(the 7B-shape check needs no 13 GB checkpoint on disk).

This module is the only place the accuracy tools touch both packages; ``nakta_model`` and
``llama_org`` never import each other.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A dtype name in any case (``bf16``, ``BF16``, ``bfloat16``) or a ``torch.dtype``."""
    if isinstance(name, torch.dtype):
        return name
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} (any case), got {name!r}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def resolve_device(name: str | torch.device | None, fallback: bool = False) -> torch.device:
    """``None``/``auto``: CUDA when present, else the CPU.

    A CUDA device this machine cannot give (no CUDA, or an index past the visible GPUs) is an
    error, or with ``fallback`` the automatic choice plus a warning line: lm-eval's CLI passes
    ``cuda:0`` when the user gave no ``--device``, and its ``hf`` model then falls back the
    same way (an unknown device string there means "cuda if available else cpu").
    """
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type != "cuda" or _cuda_device_exists(device):
        return device
    if not fallback:
        raise ValueError(f"device {str(name)!r} requested but {_cuda_shortfall()}")
    chosen = resolve_device(None)
    logging.getLogger(__name__).warning(
        "warning: device %r requested but %s; using %s", str(name), _cuda_shortfall(), chosen
    )
    return chosen


def _cuda_device_exists(device: torch.device) -> bool:
    if not torch.cuda.is_available():
        return False
    return device.index is None or device.index < torch.cuda.device_count()


def _cuda_shortfall() -> str:
    if not torch.cuda.is_available():
        return "CUDA is not available"
    return f"only {torch.cuda.device_count()} GPU(s) are visible"


def is_meta_checkpoint(path: str | Path) -> bool:
    """A Meta release folder: ``params.json`` + ``consolidated.NN.pth`` shards."""
    path = Path(path)
    return (path / "params.json").is_file() and any(path.glob("consolidated.*.pth"))


# Temporary conversions (in the system temp dir): make_temp_dir's names and marker.
CONVERT_TMP_PREFIX = "nakta_convert_"
_CONVERT_TMP = re.compile(re.escape(CONVERT_TMP_PREFIX) + r"[a-z0-9_]{8}")


@dataclass
class NaktaHandle:
    """A loaded Nakta model and where it came from (a Meta dir's temporary conversion is
    already gone: :func:`load_nakta` removes it once the model is loaded)."""

    model: object
    source: str

    def close(self) -> None:
        """Drop the handle's reference to the model (its memory goes once nobody holds it)."""
        self.model = None


def convert_meta(meta_dir: str | Path, out_dir: str | Path, tp: int = 1) -> Path:
    """``python convert.py META_DIR OUT --tp TP --dtype fp32`` in-process."""
    import convert

    out = Path(out_dir)
    argv = [str(meta_dir), str(out), "--tp", str(tp), "--dtype", "fp32", "--quiet"]
    rc = convert.main(argv)
    if rc not in (None, 0):
        raise RuntimeError(f"convert.py {meta_dir} -> {out} failed with exit code {rc}")
    return out


def load_nakta(
    checkpoint: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    kernels: str | None = None,
    parallel=None,
) -> NaktaHandle:
    """A Nakta model from a Nakta checkpoint, or from a Meta one converted to a temp dir
    (removed once the model is loaded, or when loading fails or is interrupted).

    ``parallel`` (a ``ParallelContext`` from ``init_parallel``): this rank's tensor-parallel
    shard. A Meta dir is then converted once, by global rank 0, for the grid's ``tp`` (every
    rank of this host reads the same temp dir); the load itself is collective, so a shard that
    fails on one rank fails on all of them.
    """
    from nakta_model.io_utils import (
        interruptible,
        make_temp_dir,
        remove_stale_temp_dirs,
        signals_deferred,
    )
    from nakta_model.parallel import ParallelContext, gather_objects

    ctx = parallel or ParallelContext()
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise ValueError(f"checkpoint {checkpoint} is not a directory")
    if not is_meta_checkpoint(checkpoint):
        return NaktaHandle(
            model=_load(checkpoint, ctx, dtype, kernels, device), source=str(checkpoint)
        )
    # Only the converting rank holds a temp dir to clean up; the others keep default signals.
    guard = interruptible() if ctx.is_leader else contextlib.nullcontext()
    with guard:
        tmp = None
        try:
            error = None
            if ctx.is_leader:
                remove_stale_temp_dirs(tempfile.gettempdir(), _CONVERT_TMP)
                with signals_deferred():
                    tmp = make_temp_dir(tempfile.gettempdir(), prefix=CONVERT_TMP_PREFIX)
                try:
                    path = convert_meta(checkpoint, tmp / "nakta", ctx.tp_size)
                except Exception as e:  # noqa: BLE001 -- re-raised on every rank below
                    path, error = None, f"{type(e).__name__}: {e}"
            path, error = gather_objects((str(path) if ctx.is_leader else None, error))[0]
            if error is not None:
                raise ValueError(f"converting {checkpoint} for tp={ctx.tp_size}: {error}")
            model = _load(Path(path), ctx, dtype, kernels, device)
        finally:
            if tmp is not None:  # every rank has read it: the load is collective
                with signals_deferred():
                    shutil.rmtree(tmp, ignore_errors=True)
    return NaktaHandle(model=model, source=str(checkpoint))


def _load(path: Path, ctx, dtype: torch.dtype, kernels: str | None, device: torch.device):
    import nakta_model
    from nakta_model.parallel import load_model, validate_grid

    if ctx.world_size == 1:
        return nakta_model.load(path, device, dtype, kernels=kernels)
    validate_grid(ctx.tp_size, ctx.dp_size, ctx.world_size, checkpoint=path)
    return load_model(path, ctx, dtype, kernels=kernels)


def load_llama_org(
    meta_dir: str | Path,
    tokenizer: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    max_seq_len: int,
    max_batch_size: int,
):
    """Meta's ``Llama.build`` (one process: a single-shard checkpoint)."""
    from llama_org import Llama

    os.environ.setdefault("LLAMA_ORG_QUIET", "1")
    if not is_meta_checkpoint(meta_dir):
        raise ValueError(f"checkpoint {meta_dir} is not a Meta checkpoint (params.json + .pth)")
    return Llama.build(
        str(meta_dir), str(tokenizer), max_seq_len, max_batch_size, device=device, dtype=dtype
    )


def meta_params(args) -> dict:
    """Meta ``params.json`` fields of a Nakta ``ModelArgs`` (what llama_org understands)."""
    keys = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of")
    params = {k: getattr(args, k) for k in keys}
    params.update(
        ffn_dim_multiplier=args.ffn_dim_multiplier,
        norm_eps=args.norm_eps,
        rope_theta=args.rope_theta,
    )
    return params


def random_pair(
    preset: str,
    tokenizer: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    llama_max_seq_len: int,
    max_batch_size: int,
    seed: int = 0,
    parallel=None,
):
    """(nakta model, llama_org Llama) holding the SAME seeded random weights of ``preset``.

    llama_org draws the weights on the device (``Llama.from_state_dict(..., None)``); Nakta gets
    that very state dict, fused into its layout by ``checkpoint.from_meta_state_dict``. Nakta
    keeps the preset's ``max_seq_len``; llama_org's KV cache is sized ``max_batch_size x
    llama_max_seq_len`` (Meta allocates it up front, so keep it to what the requests need).

    Under ``torchrun`` llama_org splits over the whole world (Meta: MP = world size) and draws
    each rank's shard; Nakta then needs ``tp`` = world (``parallel``) and takes its shard from
    that rank's Meta shard (``nakta_state_from_meta_shard``: only the embedding is gathered).
    """
    from llama_org import Llama
    from nakta_model.checkpoint import from_meta_state_dict
    from nakta_model.config import PRESETS
    from nakta_model.model import from_state_dict
    from nakta_model.parallel import (
        ParallelConfigError,
        ParallelContext,
        nakta_state_from_meta_shard,
    )

    ctx = parallel or ParallelContext()
    if ctx.world_size > 1 and ctx.tp_size != ctx.world_size:
        raise ParallelConfigError(
            f"random weights under torchrun need --tp = world size ({ctx.world_size}): "
            "llama_org draws them split over every rank (Meta: MP = world size)"
        )

    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    args = PRESETS[preset]
    llama = Llama.from_state_dict(
        meta_params(args),
        None,
        llama_max_seq_len,
        max_batch_size,
        tokenizer=str(tokenizer),
        device=device,
        dtype=dtype,
        seed=seed,
    )
    meta_sd = {k: v for k, v in llama.model.state_dict().items() if k != "rope.freqs"}
    if ctx.world_size > 1:
        nakta_sd = nakta_state_from_meta_shard(meta_sd, args, ctx)
    else:
        nakta_sd = from_meta_state_dict(meta_sd, args)
    del meta_sd
    model = from_state_dict(nakta_sd, args, ctx.device or device, dtype, parallel=ctx)
    del nakta_sd
    with contextlib.suppress(Exception):
        torch.cuda.empty_cache()
    return model, llama


def fp32_weights(llama) -> tuple[dict, dict]:
    """(Meta params, this rank's state dict upcast to fp32 on the CPU) of a built ``Llama``.

    The fp32 truth of a bf16/fp16 comparison runs these: the very weights the half-precision
    models hold (exactly representable in fp32), so what differs is only the arithmetic.
    """
    params = meta_params(llama.model.params)
    state = {
        k: v.detach().to("cpu", torch.float32)
        for k, v in llama.model.state_dict().items()
        if k != "rope.freqs"
    }
    return params, state


def llama_org_fp32(
    params: dict,
    state: dict,
    tokenizer: str | Path,
    device: torch.device,
    max_seq_len: int,
    max_batch_size: int,
):
    """Meta's reference in fp32 from ``fp32_weights`` (same model-parallel world as before)."""
    from llama_org import Llama

    return Llama.from_state_dict(
        params,
        state,
        max_seq_len,
        max_batch_size,
        tokenizer=str(tokenizer),
        device=device,
        dtype=torch.float32,
    )


def shutdown_llama_org() -> None:
    """Tear down the process group llama_org started (tests run several builds)."""
    with contextlib.suppress(ImportError):
        from llama_org.distributed import shutdown

        shutdown()
