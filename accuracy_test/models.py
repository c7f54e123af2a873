"""Build the two models the accuracy tools compare, from the same weights.

``nakta``: ``nakta_model.load`` of a Nakta checkpoint dir or of the Meta dir itself (read in
memory, this rank's shard built tensor by tensor: no converted copy on disk). ``llama_org``:
Meta's reference, from the Meta dir (:func:`load_llama_org`), or from a Nakta or HF dir handed
the same weights in memory as Meta tensors (:func:`llama_org_from_checkpoint`). :func:`random_pair` draws one set
of random Meta weights on the device and gives both models exactly those (the 7B-shape check
needs no 13 GB checkpoint on disk).

This module is the only place the accuracy tools touch both packages; ``nakta_model`` and
``llama_org`` never import each other.
"""

from __future__ import annotations

import contextlib
import logging
import os
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
    from nakta_model.sources import is_meta_checkpoint

    os.environ.setdefault("LLAMA_ORG_QUIET", "1")
    if not is_meta_checkpoint(meta_dir):
        raise ValueError(f"checkpoint {meta_dir} is not a Meta checkpoint (params.json + .pth)")
    return Llama.build(
        str(meta_dir), str(tokenizer), max_seq_len, max_batch_size, device=device, dtype=dtype
    )


def llama_org_from_checkpoint(
    path: str | Path,
    tokenizer: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    max_seq_len: int,
    max_batch_size: int,
):
    """llama_org on any checkpoint folder: a Meta one through Meta's ``Llama.build`` (one shard
    per model-parallel process), a Nakta or HF one through ``Llama.from_state_dict`` of the same
    weights as Meta-named tensors (``sources.open_checkpoint``), each process given its
    fairscale shard (MP = world size) cut one tensor at a time."""
    from nakta_model.sources import is_meta_checkpoint

    if is_meta_checkpoint(path):
        return load_llama_org(path, tokenizer, device, dtype, max_seq_len, max_batch_size)
    import fairscale.nn.model_parallel.initialize as fs_init

    from llama_org import Llama
    from llama_org.distributed import init_distributed, init_model_parallel
    from nakta_model.layout import meta_shapes, meta_split_dim
    from nakta_model.sources import open_checkpoint

    os.environ.setdefault("LLAMA_ORG_QUIET", "1")
    source = open_checkpoint(path)
    init_model_parallel(init_distributed(device))  # Meta: MP = world size
    rank, size = fs_init.get_model_parallel_rank(), fs_init.get_model_parallel_world_size()
    shard = {}
    for name in meta_shapes(source.args):
        t, dim = source.get(name), meta_split_dim(name)
        if size > 1 and dim is not None:
            t = t.chunk(size, dim)[rank]
        shard[name] = t.to(device=device, dtype=dtype).clone(memory_format=torch.contiguous_format)
    return Llama.from_state_dict(
        source.args.to_meta_params(),
        shard,
        max_seq_len,
        max_batch_size,
        tokenizer=str(tokenizer),
        device=device,
        dtype=dtype,
    )


def _llama_org_params(args) -> dict:
    """``params.json`` fields of the ``ModelArgs`` a llama_org model was built with: a second
    llama_org of the very same shape builds from them."""
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

    llama_org draws the weights on the device (``Llama.from_state_dict(..., None)``); Nakta is
    loaded from that very state dict (``nakta_model.load`` of a ``state_dict_source``: fused
    into its layout, in storage of its own). Nakta keeps the preset's ``max_seq_len``;
    llama_org's KV cache is sized ``max_batch_size x llama_max_seq_len`` (Meta allocates it up
    front, so keep it to what the requests need).

    Under ``torchrun`` llama_org splits over the whole world (Meta: MP = world size) and draws
    each rank's shard; Nakta then needs ``tp`` = world (``parallel``) and is loaded from that
    rank's Meta shard (a ``MetaRankShard``: only the embedding is gathered).
    """
    from llama_org import Llama
    from nakta_model.config import PRESETS
    from nakta_model.loading import load
    from nakta_model.parallel import ParallelConfigError, ParallelContext
    from nakta_model.sources import MetaRankShard, state_dict_source

    parallel = parallel or ParallelContext()
    if parallel.world_size > 1 and parallel.tp_size != parallel.world_size:
        raise ParallelConfigError(
            f"random weights under torchrun need --tp = world size ({parallel.world_size}): "
            "llama_org draws them split over every rank (Meta: MP = world size)"
        )

    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    args = PRESETS[preset]
    llama = Llama.from_state_dict(
        args.to_meta_params(),
        None,
        llama_max_seq_len,
        max_batch_size,
        tokenizer=str(tokenizer),
        device=device,
        dtype=dtype,
        seed=seed,
    )
    meta_sd = {k: v for k, v in llama.model.state_dict().items() if k != "rope.freqs"}
    if parallel.world_size > 1:
        source = MetaRankShard(meta_sd, args)
    else:
        source = state_dict_source(meta_sd, args)
    model = load(source, parallel.device or device, dtype, parallel)
    del meta_sd, source
    with contextlib.suppress(Exception):
        torch.cuda.empty_cache()
    return model, llama


def fp32_weights(llama) -> tuple[dict, dict]:
    """(Meta params, this rank's state dict upcast to fp32 on the CPU) of a built ``Llama``.

    The fp32 truth of a bf16/fp16 comparison runs these: the very weights the half-precision
    models hold (exactly representable in fp32), so what differs is only the arithmetic.
    """
    params = _llama_org_params(llama.model.params)
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
