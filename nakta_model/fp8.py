"""FP8 weights and activations (``quant="fp8"``): the linear layer, the device check, the rule
for which tensors are quantized.

Opt-in, never a default: ``load(..., quant="fp8")`` / ``random_model(..., quant="fp8")`` turn
the four block matrices (``wqkv``, ``wo``, ``w13``, ``w2``) into :class:`Fp8Linear` layers:
e4m3 weights with one fp32 scale per output channel (quantized on this rank's shard, so under
tensor parallelism each rank's channels have their own scales) and per-token e4m3 activations
that the kernels before them write already quantized (RMSNorm, SwiGLU; the attention output
goes through ``quantize_rows``). The embedding, the norms' weights, RoPE, the attention math,
the LM head stay in the model's dtype: the LM head decides the logprobs. The KV cache's dtype
is a separate option (``kv_cache``, :class:`Precision`), independent of the weights'.

The GEMMs are cuBLASLt's FP8 GEMMs (``kernels/fp8_gemm.py``; at up to 64 rows, a short
prompt's prefill, the decode step's Triton ``fp8_decode_gemm``: ``model._Ops.fp8_matmul``), so
the device needs compute capability 8.9 (Ada, Hopper) or newer; on the CPU, FP8 runs only under the Triton interpreter
(``TRITON_INTERPRET=1``: the tests), with the exact fp32 reference GEMM.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn

from nakta_model.config import ModelArgs
from nakta_model.kernels._checks import interpreter_enabled
from nakta_model.kernels.fp8_quant import FP8_DTYPE, QuantRows, quantize_weight
from nakta_model.layout import nakta_shapes, nakta_tensor

__all__ = [
    "KV_CACHE_MODES",
    "QUANT_MODES",
    "QUANTIZED_KINDS",
    "Fp8Linear",
    "Precision",
    "check_fp8_device",
    "check_kv_cache",
    "check_quant",
    "is_quantized_name",
    "quantize_state",
    "quantizing_fetch",
    "scale_name",
    "stored_layout",
]

QUANT_MODES = (None, "fp8")
KV_CACHE_MODES = ("bf16", "fp8")  # "bf16": the model's dtype (bf16, fp16 or fp32)
QUANTIZED_KINDS = ("wqkv", "wo", "w13", "w2")
SCALE_SUFFIX = "_scale"
MIN_CAPABILITY = (8, 9)


def check_quant(quant: object) -> str | None:
    """``None`` or ``"fp8"`` (any case; ``""``, ``"none"``, ``"bf16"``, ``"fp16"`` and ``"fp32"``
    also mean None: no quantization, the model's dtype throughout)."""
    if quant is None:
        return None
    if not isinstance(quant, str):
        raise TypeError(f"quant must be None or 'fp8', got {type(quant).__name__}")
    q = quant.strip().lower()
    if q in ("", "none", "bf16", "fp16", "fp32"):
        return None
    if q != "fp8":
        raise ValueError(f"quant must be None or 'fp8', got {quant!r}")
    return q


def check_kv_cache(kv_cache: object) -> str:
    """``"bf16"`` (the default: the model's own dtype, whatever it is) or ``"fp8"`` (e4m3 K/V
    with an fp32 scale per token and KV head); any case, None and ``""`` mean the default,
    ``"fp16"``/``"fp32"``/``"model"`` too (the cache follows the model's dtype)."""
    if kv_cache is None:
        return "bf16"
    if not isinstance(kv_cache, str):
        raise TypeError(f"kv_cache must be 'bf16' or 'fp8', got {type(kv_cache).__name__}")
    k = kv_cache.strip().lower()
    if k in ("", "bf16", "fp16", "fp32", "model"):
        return "bf16"
    if k != "fp8":
        raise ValueError(f"kv_cache must be 'bf16' or 'fp8', got {kv_cache!r}")
    return k


@dataclass(frozen=True)
class Precision:
    """The precision options beyond the model's dtype, parsed once where a command reads its
    arguments (:meth:`parse`) and passed down as this one object: ``load``, ``random_model``
    and the model take it as it is, nothing below re-checks or re-encodes it.

    ``quant``: None (the model's dtype throughout) or ``"fp8"`` (e4m3 block matrices and
    activations, see the module docstring). ``kv_cache``: ``"bf16"`` (the model's dtype) or
    ``"fp8"`` (e4m3 K/V, one fp32 scale per token and KV head: twice the positions in the same
    bytes), read where the cache is built (``Transformer.setup_cache``); independent of
    ``quant``.
    """

    quant: str | None = None
    kv_cache: str = "bf16"

    def __post_init__(self) -> None:
        if self.quant not in QUANT_MODES:  # only parse() and the defaults build one
            raise ValueError(f"quant must be None or 'fp8', got {self.quant!r} (use parse)")
        if self.kv_cache not in KV_CACHE_MODES:
            raise ValueError(f"kv_cache must be 'bf16' or 'fp8', got {self.kv_cache!r} (use parse)")

    @classmethod
    def parse(cls, quant: object = None, kv_cache: object = None) -> Precision:
        """The options from a user's values (``quant``: see :func:`check_quant`; ``kv_cache``:
        :func:`check_kv_cache`)."""
        return cls(quant=check_quant(quant), kv_cache=check_kv_cache(kv_cache))

    @classmethod
    def of(cls, value: Precision | str | None) -> Precision:
        """``value`` itself when already parsed; a library caller's ``quant`` string is parsed
        here, once, at that call's entry."""
        return value if isinstance(value, Precision) else cls.parse(value)

    def check_device(self, device: torch.device | str) -> None:
        """Whether ``device`` can run these options (:func:`check_fp8_device` for FP8)."""
        if self.quant == "fp8":
            check_fp8_device(device)
        # e4m3 loads and stores in the attention kernels; the CPU's reference paths
        # dequantize in PyTorch, so only a GPU is checked
        if self.kv_cache == "fp8" and torch.device(device).type == "cuda":
            check_fp8_device(device, what="kv_cache='fp8'")


def check_fp8_device(device: torch.device | str, what: str = "quant='fp8'") -> None:
    """FP8 GEMMs need a CUDA device of compute capability >= 8.9; the CPU only under the Triton
    interpreter (tests). Raises ``ValueError`` naming the device and what it needs."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        cap = torch.cuda.get_device_capability(index)
        if cap < MIN_CAPABILITY:
            name = torch.cuda.get_device_name(index)
            raise ValueError(
                f"{what} needs a GPU of compute capability >= 8.9 (Ada, Hopper or newer); "
                f"{device} is a {name} of capability {cap[0]}.{cap[1]}: drop {what.split('=')[0]}"
            )
        return
    if device.type == "cpu" and interpreter_enabled():
        return
    raise ValueError(
        f"{what} needs a CUDA GPU of compute capability >= 8.9, got device {device} "
        "(on the CPU it runs only under TRITON_INTERPRET=1, for tests)"
    )


def is_quantized_name(name: str) -> bool:
    """``True`` for the weight of a block matrix that ``quant="fp8"`` stores in e4m3."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in QUANTIZED_KINDS


def scale_name(weight_name: str) -> str:
    """``layers.0.attention.wqkv.weight`` -> ``layers.0.attention.wqkv.weight_scale``."""
    return weight_name + SCALE_SUFFIX


def quantize_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Quantize the block matrices of a Nakta state dict in place (round to nearest, one scale
    per output channel), freeing each high-precision tensor as soon as it is replaced: the peak
    is the state plus one matrix. Already-quantized weights (with their scale) are kept."""
    for name in [n for n in state if is_quantized_name(n)]:
        w = state[name]
        if w.dtype == FP8_DTYPE:
            if scale_name(name) not in state:
                raise ValueError(f"{name} is e4m3 but has no {scale_name(name)}")
            continue
        q, s = quantize_weight(w)
        del w
        state[name], state[scale_name(name)] = q, s
    return state


def stored_layout(
    args: ModelArgs, tp_size: int, dtype: torch.dtype, quant: str | None
) -> tuple[dict[str, tuple[int, ...]], dict[str, torch.dtype]]:
    """Per-rank shape and stored dtype of every tensor of a checkpoint: ``dtype`` throughout,
    or with FP8 the block matrices in e4m3 plus one fp32 scale per output channel."""
    shapes = nakta_shapes(args, tp_size)
    dtypes = dict.fromkeys(shapes, dtype)
    if quant:
        for name in [n for n in shapes if is_quantized_name(n)]:
            dtypes[name] = FP8_DTYPE
            shapes[scale_name(name)] = (shapes[name][0],)
            dtypes[scale_name(name)] = torch.float32
    return shapes, dtypes


def quantizing_fetch(get_meta, tp_size: int, args=None):
    """``tensor(name, rank)``: a rank's Nakta tensor, its block matrices quantized once for the
    weight and its scale (written one after the other: names sort that way)."""

    @functools.lru_cache(maxsize=tp_size)
    def quantized(weight_name: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_weight(nakta_tensor(weight_name, get_meta, rank, tp_size, args))

    def tensor(name: str, rank: int) -> torch.Tensor:
        if is_quantized_name(name):
            return quantized(name, rank)[0]
        if name.endswith("_scale") and is_quantized_name(name[: -len("_scale")]):
            return quantized(name[: -len("_scale")], rank)[1]
        return nakta_tensor(name, get_meta, rank, tp_size, args)

    return tensor


class Fp8Linear(nn.Module):
    """``y = x @ W^T`` with ``W`` in e4m3 and one fp32 scale per output channel.

    ``x`` is either ``QuantRows`` (already quantized by the kernel that produced it) or a tensor
    ``[M, in_features]``, quantized per row here by ``ops.quantize_rows`` (the model's kernel
    dispatch). The output is in ``ops.act_dtype`` (the model's dtype, set by the model at each
    forward). Weights are buffers, not parameters: nothing here trains, and
    ``Module.to(dtype)`` must not cast them (see :meth:`_apply`).
    """

    def __init__(self, in_features: int, out_features: int, ops) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.ops = ops
        self.register_buffer("weight", torch.empty((out_features, in_features), dtype=FP8_DTYPE))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32))

    def forward(self, x: torch.Tensor | QuantRows) -> torch.Tensor:
        if not isinstance(x, QuantRows):
            x = self.ops.quantize_rows(x)
        return self.ops.fp8_matmul(
            x.q, x.scale, self.weight, self.weight_scale, self.ops.act_dtype
        )  # cuBLASLt, or at a few rows the decode step's FP8 GEMM (``_Ops.fp8_matmul``)

    def _apply(self, fn, recurse: bool = True):
        """Device moves apply; dtype casts do not (an fp32 scale cast to bf16 would lose bits,
        an e4m3 weight cast to bf16 would silently leave FP8)."""
        for name, b in list(self._buffers.items()):
            if b is None:
                continue
            moved = fn(b)
            if moved.dtype != b.dtype:
                moved = b.to(device=moved.device)
            self._buffers[name] = moved
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3"
