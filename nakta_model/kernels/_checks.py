"""Input checks shared by every kernel launcher, the row views they hand to the kernels, and
the few host facts launchers read (interpreter on, debug checks on, SM count).

Launchers validate before they launch: a Triton kernel fed a wrong shape reads garbage
instead of failing, so every check here raises ``ValueError`` / ``TypeError`` with a message
that names the argument and what was expected.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable

import torch

from nakta_model import knobs

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreter_enabled() -> bool:
    """True when Triton runs kernels on the CPU (``TRITON_INTERPRET=1``), as in CI."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def debug_checks() -> bool:
    """Host checks that need a device sync (index ranges) run on CUDA only with NAKTA_DEBUG=1;
    without it a kernel turns an out-of-range index into NaN instead of reading past a table."""
    return bool(knobs.get_bool("NAKTA_DEBUG"))


def tracing() -> bool:
    """True while torch.compile traces a caller: address checks (``data_ptr``) are skipped
    there (dynamo cannot trace them and would split the graph at every launch); the same
    calls ran them when the step was built and tested eagerly."""
    return torch.compiler.is_compiling()


@functools.lru_cache(maxsize=16)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_family(device: torch.device) -> str:
    """A word of the CUDA device's name that launch-config tables are keyed by (``"h200"``,
    ``"h100"``, ...; ``""`` off the GPU or for other devices): tuned tile sizes differ."""
    if device.type != "cuda":
        return ""
    name = _device_name(device.index if device.index is not None else torch.cuda.current_device())
    for family in ("h200", "h100", "a100"):
        if family in name.lower():
            return family
    return ""


@functools.lru_cache(maxsize=16)
def sm_count(device: torch.device, off_gpu: int) -> int:
    """Streaming multiprocessors of a CUDA ``device``; ``off_gpu`` for any other device."""
    if device.type != "cuda":
        return off_gpu
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=16)
def dependent_launch(device: torch.device) -> bool:
    """Whether decode kernels launch as programmatic dependents (Hopper's PDL: a kernel's blocks
    are scheduled while its predecessor drains and wait in ``gdc_wait`` for its results, instead
    of the launch starting only after the predecessor ends). CUDA devices of compute capability
    9.0 or later with a Triton that has ``launch_pdl``; never in the interpreter."""
    if device.type != "cuda" or interpreter_enabled():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(index) < (9, 0):
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def fp8_mma(device: torch.device) -> bool:
    """Whether Triton kernels on ``device`` may feed e4m3 operands to ``tl.dot``: CUDA devices
    of compute capability 8.9 or later, or the CPU under the interpreter."""
    if device.type == "cpu":
        return interpreter_enabled()
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= (8, 9)


@functools.lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def mark_compile_constants() -> None:
    """Tell torch.compile that ``device_family`` and ``sm_count`` are constants (no graph break
    at every launch). Called by the compile path just before ``torch.compile``, not at import:
    the marking imports ``torch._dynamo`` (0.8 s on a fast CPU, seconds on a slow file system),
    which every lm-eval run would otherwise pay. The decorator marks and returns the function
    itself, so callers holding it see the mark."""
    for fn in (device_family, sm_count, dependent_launch, fp8_mma):
        torch.compiler.assume_constant_result(fn)


def check_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_dtype(name: str, t: torch.Tensor, allowed: Iterable[torch.dtype] = FLOAT_DTYPES) -> None:
    allowed = tuple(allowed)
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(
            f"{name} must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}"
        )


def check_ndim(name: str, t: torch.Tensor, ndims: int | Iterable[int]) -> None:
    ok = (ndims,) if isinstance(ndims, int) else tuple(ndims)
    if t.dim() not in ok:
        raise ValueError(
            f"{name} must have {' or '.join(map(str, ok))} dimensions, got shape {tuple(t.shape)}"
        )


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_index(name: str, t: object, n: int | None = None, per: str = "token") -> torch.Tensor:
    """A 1-D int32/int64 tensor, with ``n`` entries (one per ``per``) when ``n`` is given."""
    t = check_tensor(name, t)
    check_dtype(name, t, INDEX_DTYPES)
    check_ndim(name, t, 1)
    if n is not None and t.shape[0] != n:
        raise ValueError(f"{name} must have {n} entries (one per {per}), got {t.shape[0]}")
    return t


def check_range(name: str, t: torch.Tensor, n: int, what: str) -> None:
    """Every index in ``[0, n)`` (``what`` says what it indexes); reads the values (a sync)."""
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= n):
        raise ValueError(
            f"{name} must lie in [0, {n}) ({what}), got [{int(t.min())}, {int(t.max())}]"
        )


def check_triton_device(name: str, t: torch.Tensor) -> None:
    """Kernels run on CUDA, or on the CPU only under the Triton interpreter."""
    if t.is_cuda:
        return
    if t.device.type == "cpu" and interpreter_enabled():
        return
    raise ValueError(
        f"{name} is on {t.device}: the Triton kernel needs a CUDA tensor "
        "(or TRITON_INTERPRET=1 for CPU tensors); use the *_reference function on the CPU"
    )


def check_same_device(**tensors: torch.Tensor) -> None:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    if not items:
        return
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}")


def rows_view(name: str, t: torch.Tensor, last: str = "features") -> torch.Tensor:
    """``t`` as ``[rows, last]`` without copying: the last dim must be unit-stride and the
    leading dims must collapse into one row stride (kernels take that one stride)."""
    if t.dim() < 1:
        raise ValueError(f"{name} must have at least one dimension, got a scalar")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(
            f"{name} must be unit-stride along its last dimension, got strides {t.stride()}"
        )
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError as e:
        raise ValueError(
            f"{name} with shape {tuple(t.shape)} and strides {t.stride()} cannot be viewed as "
            f"[rows, {last}] with one row stride; pass a tensor whose leading dims collapse"
        ) from e


def grad_rows(g: torch.Tensor | None) -> torch.Tensor | None:
    """An incoming gradient ready to be read by rows. Gradients may be broadcast views
    (``y.sum().backward()`` gives stride 0); those, and only those, are materialized."""
    if g is None:
        return None
    if g.stride(-1) == 1:
        try:
            g.view(-1, g.shape[-1])
            return g
        except RuntimeError:
            pass
    return g.contiguous()


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last + 1)`` byte addresses a strided view can touch (strides are >= 0)."""
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (extent + 1) * t.element_size()


def check_no_overlap(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """A kernel output must not share memory with an input other programs still read (a race
    the kernel cannot detect). Conservative: views whose address ranges interleave count."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or tracing():
        return
    a0, a1 = _byte_span(a)
    b0, b1 = _byte_span(b)
    if a0 < b1 and b0 < a1:
        raise ValueError(f"{name_a} overlaps {name_b} in memory; pass a separate {name_a} tensor")
