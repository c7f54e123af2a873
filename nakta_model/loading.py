"""The one way to build a Nakta model: :func:`load` reads weights, :func:`random_model` draws them.

``load(source, device, dtype, parallel, kernels=, verify=)`` takes any of:

=================================  =============================================================
source                             what this rank reads
=================================  =============================================================
a Nakta checkpoint directory       its own shard file (``convert.py --tp N``), checked against
                                   the manifest (``verify``: ``"fast"``, ``"full"``, ``"size"``)
a Meta checkpoint directory        opened through ``sources.py`` (memory-mapped; every name and
(``consolidated.NN.pth``, any      shape checked first), this rank's fused tensors built one at
count) or a HF LLaMA directory     a time: no converted copy on disk, any ``tp``
a ``sources.Source``               unsplit Meta-named tensors from anywhere (a state dict in
                                   memory: ``sources.state_dict_source``; a benchmark's weights)
a ``sources.MetaRankShard``        this rank's own piece of Meta's model-parallel split (MP = tp):
                                   fairscale splits as Nakta does, only the embedding (split
                                   along ``dim`` by Meta, replicated by Nakta) is all-gathered
=================================  =============================================================

Every kind ends the same way: the model is built on the ``meta`` device and filled by
assignment (no random init, no second copy of the weights), strictly: a missing, unexpected or
misshapen tensor is an error, never uninitialized memory. ``dtype`` None keeps the stored dtype.
The model never shares storage with what a source handed out (a file mapping, a caller's dict).

Random weights are their own entry, :func:`random_model` (a ``ModelArgs``, a ``seed``): they
have no file to read or verify, and one argument that is either a path or a preset name would
be ambiguous (a folder called ``7B``).

Tensor parallel: ``parallel`` is this rank's place in the grid (``parallel.init_parallel``).
Under a grid the read goes through ``parallel.collective_call``: a file that fails on one rank
fails the load on every rank, and no healthy rank waits in a collective for one that left; a
Nakta checkpoint sharded for another ``tp`` is refused from its ``params.json`` before that.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from nakta_model.checkpoint import load_rank_state_dict, read_args
from nakta_model.config import ModelArgs
from nakta_model.fp8 import (
    Precision,
    is_quantized_name,
    quantize_state,
    scale_name,
)
from nakta_model.kernels.fp8_quant import FP8_DTYPE, quantize_weight
from nakta_model.layout import CheckpointError, check_meta_names, nakta_shapes, nakta_tensor
from nakta_model.model import Transformer
from nakta_model.parallel import (
    ParallelConfigError,
    ParallelContext,
    collective_call,
    gather_last_dim,
    validate_grid,
)
from nakta_model.sources import (
    MetaRankShard,
    Source,
    is_hf_checkpoint,
    is_meta_checkpoint,
    open_source,
)

__all__ = [
    "SUPPORTED_DTYPES",
    "CheckpointDir",
    "checkpoint_args",
    "load",
    "quantized",
    "random_model",
    "read_rank_state",
]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_EMBEDDING = "tok_embeddings.weight"

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class CheckpointDir:
    """A checkpoint folder opened once (:meth:`open`): its format and settings, read once, for
    a command to check a tokenizer or a length against, then hand to :func:`load`, which reads
    only the weights. A Meta or HF folder is opened memory-mapped (``source``: every name and
    shape checked); a Nakta folder's ``params.json`` is kept as read (``params``)."""

    path: Path
    format: str  # "nakta" | "meta" | "hf"
    args: ModelArgs
    params: dict | None = None  # Nakta: params.json (tp_size, quant)
    source: Source | None = None  # Meta / HF: the opened source

    @classmethod
    def open(cls, path: str | os.PathLike) -> CheckpointDir:
        """Open folder ``path`` (a ``CheckpointError`` / ``OSError`` when it does not read)."""
        path = Path(path)
        if is_meta_checkpoint(path) or is_hf_checkpoint(path):
            source = open_source(path, quiet=True)
            fmt = "meta" if is_meta_checkpoint(path) else "hf"
            return cls(path, fmt, source.args, source=source)
        args, params = read_args(path)
        return cls(path, "nakta", args, params=params)

    def __str__(self) -> str:  # messages name the folder, as for a path
        return str(self.path)


def load(
    source: str | os.PathLike | CheckpointDir | Source | MetaRankShard,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    parallel: ParallelContext | None = None,
    *,
    kernels: str | None = None,
    verify: str | bool = "fast",
    quant: Precision | str | None = None,
) -> Transformer:
    """This rank's model from ``source`` (see the module docstring for the kinds).

    ``device`` None: ``parallel.device``, else CUDA when present, else the CPU. ``verify``
    applies to Nakta checkpoints (Meta and HF ones have no manifest: their names and shapes are
    checked, not their bytes). ``kernels``: ``auto`` / ``triton`` / ``reference``.
    ``quant="fp8"``: e4m3 block matrices (``nakta_model/fp8.py``), read as stored from an FP8
    Nakta checkpoint (``convert.py --quant fp8``) or quantized here from any other (round to
    nearest, one scale per output channel of this rank's shard); an FP8 checkpoint loaded
    without it is refused, never reinterpreted. ``quant`` is a :class:`~nakta_model.fp8.Precision`
    parsed where the command read its arguments (a string is parsed here). A
    :class:`CheckpointDir` already opened (its settings read) is read for its weights only.
    """
    precision = Precision.of(quant)
    quant = precision.quant
    parallel = parallel or ParallelContext()
    device, dtype = _resolve(device if device is not None else parallel.device, dtype)
    precision.check_device(device)
    if parallel.world_size == 1:
        args, state = read_rank_state(source, parallel, device, dtype, verify, quant)
    else:
        _check_grid(source, parallel)
        args, state = collective_call(
            read_rank_state, source, parallel, device, dtype, verify, quant
        )
    if isinstance(source, MetaRankShard):  # every rank agreed the shards fit: now gather
        state[_EMBEDDING] = gather_last_dim(state[_EMBEDDING], parallel)
    stored_fp8 = any(t.dtype == FP8_DTYPE for t in state.values())
    if stored_fp8 and quant is None:
        raise CheckpointError(
            f"{source} is an FP8 checkpoint (e4m3 weights + scales): load it with quant='fp8' "
            "(lm-eval: --model_args ...,quant=fp8; the CLIs: --quant fp8)"
        )
    if quant is not None:
        quantize_state(state)
    return _assemble(args, state, parallel, kernels, precision)


def checkpoint_args(path: str | os.PathLike) -> ModelArgs:
    """The ``ModelArgs`` that :func:`load` of checkpoint directory ``path`` builds, without
    reading its weights. A command that loads the folder afterwards opens it once instead
    (:meth:`CheckpointDir.open`) and hands that to :func:`load`."""
    return CheckpointDir.open(path).args


def read_rank_state(
    source: str | os.PathLike | CheckpointDir | Source | MetaRankShard,
    parallel: ParallelContext,
    device: torch.device,
    dtype: torch.dtype | None,
    verify: str | bool = "fast",
    quant: str | None = None,
) -> tuple[ModelArgs, StateDict]:
    """``(args, this rank's Nakta tensors on device)`` from any source; a ``MetaRankShard``'s
    embedding is still this rank's slice (:func:`load` gathers it). With ``quant``, tensors
    built one at a time from a Meta/HF source are quantized as they are built (the peak is the
    FP8 model plus one matrix: a 30B from bf16 weights fits one 80 GB GPU)."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not (is_meta_checkpoint(path) or is_hf_checkpoint(path)):
            tp_rank, tp_size = parallel.tp_rank, parallel.tp_size
            return load_rank_state_dict(path, tp_rank, tp_size, device, dtype, verify=verify)
        source = open_source(path, quiet=True)
    if isinstance(source, CheckpointDir):  # opened: its settings are not read again
        if source.source is None:
            tp_rank, tp_size = parallel.tp_rank, parallel.tp_size
            settings = (source.args, source.params)
            return load_rank_state_dict(
                source.path, tp_rank, tp_size, device, dtype, verify=verify, settings=settings
            )
        source = source.source
    if isinstance(source, Source):
        return source.args, _state_from_source(source, parallel, device, dtype, quant)
    if isinstance(source, MetaRankShard):
        return source.args, _state_from_rank_shard(source, parallel, device, dtype)
    raise TypeError(
        "source must be a checkpoint directory (Nakta, Meta or HF; or a CheckpointDir), a "
        "sources.Source or a "
        f"sources.MetaRankShard, got {type(source).__name__}"
    )


def random_model(
    args: ModelArgs,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    parallel: ParallelContext | None = None,
    *,
    kernels: str | None = None,
    quant: Precision | str | None = None,
) -> Transformer:
    """Random weights initialized directly on ``device`` (this rank's shard only), for speed runs.

    Scale keeps activations finite over 80 layers: matrices ~ N(0, 1/fan_in) with the residual
    projections (``wo``, ``w2``) further scaled by 1/sqrt(2 n_layers), embeddings ~ N(0, 1),
    norm weights 1. Different ranks draw different shards (seeded by seed and rank); the
    replicated embedding is the same on every rank. ``quant="fp8"``: the same draws, each
    block matrix quantized as it is drawn (one matrix in ``dtype`` at a time: a 30B fits one
    80 GB GPU), so it is the quantized twin of the model drawn without it.
    """
    precision = Precision.of(quant)
    parallel = parallel or ParallelContext()
    device, dtype = _resolve(device, dtype)
    dtype = dtype or torch.bfloat16
    precision.check_device(device)
    with torch.device("meta"):
        model = Transformer(args, parallel, kernels, precision).to(dtype)  # no fp32 copy
    # Storage by assignment, not ``to_empty``: that goes through torch._refs.empty_like, which
    # imports sympy (seconds of one thread's start-up, more beside a busy one).
    empty = {
        k: torch.empty(v.shape, dtype=v.dtype, device=device) for k, v in model.state_dict().items()
    }
    model.load_state_dict(empty, strict=True, assign=True)
    gen = torch.Generator(device=device).manual_seed(seed * 1000003 + parallel.tp_rank)
    # Replicated tensors must be equal on every rank: drawn from a rank-independent stream.
    shared_gen = torch.Generator(device=device).manual_seed(seed * 1000003 + 999983)
    depth_scale = 1.0 / math.sqrt(2 * args.n_layers)
    fan_in = {
        "wqkv": args.dim,
        "wo": args.dim,
        "w13": args.dim,
        "w2": args.hidden_dim,
        "output": args.dim,
    }
    state = model.state_dict()  # registration order, as named_parameters without quant
    with torch.no_grad():
        for name, p in state.items():
            if name.endswith("_scale"):
                continue  # drawn with its weight
            kind = name.split(".")[-2]
            if p.dim() == 1:
                p.fill_(1.0)
            elif kind == "tok_embeddings":
                p.normal_(0.0, 1.0, generator=shared_gen)
            else:
                std = fan_in[kind] ** -0.5 * (depth_scale if kind in ("wo", "w2") else 1.0)
                if p.dtype != FP8_DTYPE:
                    p.normal_(0.0, std, generator=gen)
                    continue
                w = torch.empty(p.shape, dtype=dtype, device=device).normal_(
                    0.0, std, generator=gen
                )
                q, s = quantize_weight(w)
                p.copy_(q)
                state[scale_name(name)].copy_(s)
                del w
        if args.tie_word_embeddings:  # the head is the embedding: this rank's rows of it
            head = state["output.weight"]
            rows = head.shape[0]
            head.copy_(state["tok_embeddings.weight"][parallel.tp_rank * rows :][:rows])
    model.requires_grad_(False)
    return model.eval()


# ------------------------------------------------------------------------------------ helpers


def _resolve(device, dtype) -> tuple[torch.device, torch.dtype | None]:
    """The device to build on (an explicit CUDA index: tensors and kernels agree) and the
    dtype, refused unless the kernels support it."""
    device = torch.device(
        device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
    return device, dtype


def _check_grid(source: object, parallel: ParallelContext) -> None:
    """A Nakta checkpoint sharded for another ``tp``: the same ``ParallelConfigError`` on every
    rank, from its ``params.json`` (which every rank reads alike), before any collective."""
    tp, dp, world = parallel.tp_size, parallel.dp_size, parallel.world_size
    if isinstance(source, CheckpointDir):  # its settings already read: checked from them
        validate_grid(tp, dp, world, args=source.args)
        stored_tp = None if source.params is None else source.params.get("tp_size")
        if source.params is not None and stored_tp != tp:
            raise ParallelConfigError(
                f"checkpoint {source.path} is sharded for tp={stored_tp}, but this run has "
                f"--tp {tp}; reshard it with: python convert.py <meta-or-hf-dir> <out-dir> --tp {tp}"
            )
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir() and not (is_meta_checkpoint(path) or is_hf_checkpoint(path)):
            validate_grid(tp, dp, world, checkpoint=path)


def _owned(t: torch.Tensor, handed_out: set[int], device, dtype) -> torch.Tensor:
    """``t`` on ``device`` in ``dtype``, in storage of its own: never a view of a tensor a
    source handed out (a file mapping, a caller's dict, an unsplit tensor to be freed)."""
    t = t.to(device=device, dtype=dtype or t.dtype)
    if t.untyped_storage().data_ptr() in handed_out:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _state_from_source(
    source: Source, parallel: ParallelContext, device, dtype, quant: str | None = None
) -> StateDict:
    """This rank's fused tensors from unsplit Meta tensors, one at a time: a rank holds its
    shard plus one unsplit tensor, never the whole model (a 30B splits over two GPUs)."""
    state: StateDict = {}
    for name in nakta_shapes(source.args, parallel.tp_size):
        state[name] = _rank_tensor(name, source, parallel, device, dtype)
        if quant is not None and is_quantized_name(name):
            state[name], state[scale_name(name)] = quantize_weight(state[name])
    return state


def _rank_tensor(name: str, source: Source, parallel: ParallelContext, device, dtype):
    """One fused Nakta tensor of this rank from the source's unsplit Meta tensors."""
    handed_out: set[int] = set()

    def fetch(meta_name: str) -> torch.Tensor:
        t = source.get(meta_name)
        handed_out.add(t.untyped_storage().data_ptr())
        return t

    t = nakta_tensor(name, fetch, parallel.tp_rank, parallel.tp_size, source.args)
    return _owned(t, handed_out, device, dtype)


def _state_from_rank_shard(
    source: MetaRankShard, parallel: ParallelContext, device, dtype
) -> StateDict:
    """This rank's fused tensors from its own Meta shard (the embedding still split along dim)."""
    shard, args, rank, tp = source.shard, source.args, parallel.tp_rank, parallel.tp_size
    check_meta_names(shard.keys(), args, what=f"Meta shard of rank {rank}")
    handed_out = {t.untyped_storage().data_ptr() for t in shard.values()}
    state = {}
    for name, shape in nakta_shapes(args, tp).items():
        parts = name.split(".")
        if parts[-2] in ("wqkv", "w13"):
            pre = ".".join(parts[:-2])
            keys = ("wq", "wk", "wv") if parts[-2] == "wqkv" else ("w1", "w3")
            t = torch.cat([shard[f"{pre}.{k}.weight"] for k in keys], dim=0)
        else:
            t = shard[name]
            if name == _EMBEDDING:
                shape = (shape[0], shape[1] // tp)  # Meta: split along dim
        if tuple(t.shape) != shape:
            raise CheckpointError(
                f"{name}: rank {rank}'s Meta shard has shape {tuple(t.shape)}, "
                f"tp={tp} needs {shape} (is this a checkpoint of {tp} shards?)"
            )
        state[name] = _owned(t, handed_out, device, dtype)
    return state


def _assemble(
    args: ModelArgs,
    state: StateDict,
    parallel: ParallelContext,
    kernels: str | None,
    quant: Precision | None = None,
) -> Transformer:
    """The model on the ``meta`` device, filled by assignment: every tensor present, none
    extra, every shape the model's."""
    args.check_tp(parallel.tp_size)
    with torch.device("meta"):
        model = Transformer(args, parallel, kernels, quant)
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"tensors do not match the model: missing {missing}, unexpected {unexpected}"
        )
    for name, t in state.items():
        if t.shape != expected[name].shape:
            raise ValueError(
                f"{name}: shape {tuple(t.shape)}, the model needs {tuple(expected[name].shape)}"
            )
    _tie(args, state, parallel)
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    return model.eval()


def _tie(args: ModelArgs, state: StateDict, parallel: ParallelContext) -> None:
    """A tied head (``tie_word_embeddings``) is the embedding: refused when the weights say
    otherwise, and on one rank held once (the embedding's storage) instead of twice."""
    if not args.tie_word_embeddings:
        return
    emb, out = state[_EMBEDDING], state["output.weight"]
    if out.dtype == FP8_DTYPE or out.dtype != emb.dtype:
        return
    rows = out.shape[0]
    own = emb[parallel.tp_rank * rows : (parallel.tp_rank + 1) * rows]
    if out.data_ptr() != own.data_ptr() and not torch.equal(out, own):
        raise CheckpointError(
            "tie_word_embeddings is set but output.weight differs from tok_embeddings.weight"
        )
    if parallel.tp_size == 1:
        state["output.weight"] = emb


def quantized(model: Transformer, quant: Precision | str = "fp8") -> Transformer:
    """A new model holding ``model``'s weights with ``quant`` (the block matrices quantized on
    this rank's shard; the rest shared with ``model``, which is left as it is): a parity run
    scores both from one load."""
    precision = Precision.of(quant)
    if precision.quant is None:
        raise ValueError(f"quant must be 'fp8', got {precision.quant!r}")
    if model.quant is not None:
        raise ValueError(f"model is already quantized (quant={model.quant!r}): pass its source")
    precision.check_device(model.device)
    state = dict(model.state_dict())
    quantize_state(state)
    return _assemble(model.args, state, model.parallel, model.kernels, precision)
