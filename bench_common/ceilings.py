"""Device ceilings measured in the same run as the thing being compared against them.

Every performance figure in Nakta is reported as a fraction of a ceiling measured in the same
process: copy bandwidth for memory-bound kernels, the bf16 matmul rate for MFU. The matmul rate
is timed in a short burst (the convention, and the denominator of every MFU here); a run that
keeps the GPU busy for seconds meets a lower one, the power-limited clocks' (H200: 661 against
773 TFLOP/s, ``kernel_benchmark/bench_gemm.py``), which ``matmul_tflops_sustained`` measures.
"""

from __future__ import annotations

import re

import torch


def device_slug(device: torch.device | str | None = None) -> str:
    """A folder-safe device name, e.g. ``nvidia-h100-80gb-hbm3`` or ``cpu``."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def _time_ms(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median time of ``fn`` in milliseconds (CUDA events, or wall clock on the CPU)."""
    import time

    for _ in range(warmup):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth_gbps(nbytes: int = 2 << 30, device: str = "cuda") -> float:
    """Device-to-device copy rate in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), warmup=5, iters=20)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def matmul_tflops(
    n: int = 8192, dtype: torch.dtype = torch.bfloat16, device: str = "cuda"
) -> float:
    """Dense ``n x n x n`` matmul rate in TFLOP/s on random data: the MFU denominator."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    ms = _time_ms(lambda: a @ b, warmup=3, iters=10)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def sustained_ms(fn, seconds: float = 3.0) -> float:
    """CUDA ms per call of ``fn`` run back to back for ``seconds``, over the second half (the
    clocks settled under the power limit); events every ~50 ms of work, at most ~4 chunks
    queued ahead of the GPU."""
    per = _time_ms(fn)
    chunk = max(1, int(50 / max(per, 1e-3)))
    marks: list[torch.cuda.Event] = []
    import time

    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        for _ in range(chunk):
            fn()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks.append(ev)
        if len(marks) > 4:
            marks[-5].synchronize()
    torch.cuda.synchronize()
    half = len(marks) // 2
    if len(marks) - half < 2:
        return per
    return marks[half].elapsed_time(marks[-1]) / (chunk * (len(marks) - 1 - half))


def matmul_tflops_sustained(
    n: int = 8192, seconds: float = 3.0, dtype: torch.dtype = torch.bfloat16, device: str = "cuda"
) -> float:
    """The ``n x n x n`` matmul rate in TFLOP/s while the GPU stays busy (``sustained_ms``)."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / (sustained_ms(lambda: a @ b, seconds) * 1e-3) / 1e12
