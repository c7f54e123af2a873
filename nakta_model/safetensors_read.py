"""Read a safetensors file onto a device at the speed of the disk and the PCIe link.

``safetensors.safe_open(device="cuda")`` copies tensor by tensor from a memory map, each copy
from pageable memory (the driver stages it through a bounce buffer and waits for it): a 13.5 GB
LLaMA-7B shard takes several seconds, more than HF's own loader. Here the file's data section
is read in large chunks by a few threads (``os.preadv`` releases the GIL) into page-locked
buffers, each chunk copied asynchronously into ONE device buffer while the next is read, and
every tensor is a view of that buffer: one allocation, no per-tensor copies, reads and copies
overlapped. On the CPU the chunks are read straight into the final buffer.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path

import torch

__all__ = ["read_safetensors"]

_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,  # FP8 checkpoints (convert.py --quant fp8)
}
CHUNK_BYTES = 64 << 20
THREADS = 4


def _header(f, path: Path) -> tuple[dict, int]:
    raw = f.read(8)
    if len(raw) != 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header size)")
    (n,) = struct.unpack("<Q", raw)
    size = os.fstat(f.fileno()).st_size
    if n > size - 8:
        raise ValueError(f"{path}: header of {n} bytes does not fit in a {size}-byte file")
    try:
        header = json.loads(f.read(n))
    except ValueError as e:
        raise ValueError(f"{path}: the safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object")
    return header, 8 + n


def _read_exact(fd: int, view: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise ValueError(f"{path}: file ended early (truncated?)")
        done += n


def _fill(fd: int, buf: torch.Tensor, start: int, path: Path, chunk: int, threads: int) -> None:
    """``buf[:]`` <- file bytes ``[start, start + len(buf))``, chunked over ``threads``."""
    size = buf.numel()
    chunks = [(off, min(chunk, size - off)) for off in range(0, size, chunk)]
    on_gpu = buf.is_cuda
    errors: list[BaseException] = []

    def work(mine: list[tuple[int, int]]) -> None:
        try:
            if not on_gpu:
                host = buf.numpy()
                for off, n in mine:
                    _read_exact(fd, memoryview(host[off : off + n]), start + off, path)
                return
            stream = torch.cuda.Stream(buf.device)
            pinned = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            done = [None, None]
            for i, (off, n) in enumerate(mine):
                slot = i % 2
                if done[slot] is not None:
                    done[slot].synchronize()  # its previous copy has left the buffer
                _read_exact(fd, memoryview(pinned[slot].numpy()[:n]), start + off, path)
                with torch.cuda.stream(stream):
                    buf[off : off + n].copy_(pinned[slot][:n], non_blocking=True)
                    done[slot] = torch.cuda.Event()
                    done[slot].record(stream)
            stream.synchronize()
        except BaseException as e:  # noqa: BLE001 -- re-raised in the caller's thread
            errors.append(e)

    workers = [
        threading.Thread(target=work, args=(chunks[t::threads],), daemon=True)
        for t in range(min(threads, len(chunks)))
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


def _fill_mapped(fd: int, buf: torch.Tensor, start: int, threads: int, populate: bool) -> None:
    """``buf[:]`` <- file bytes ``[start, start + len(buf))`` through a read-only memory map:
    each of ``threads`` threads copies one contiguous part in one ``copy_`` call (the driver
    stages the pageable memory). Kept as the benchmark's alternative, not the default: it reads
    at about half the pinned reader's rate and slows beside a busy Python thread just as the
    pinned one does (``speed_bench/read_bench.py``). ``populate`` maps every page at
    ``mmap`` time (``MAP_POPULATE``) instead of faulting them in during the copies."""
    import mmap
    import warnings

    size = buf.numel()
    flags = mmap.MAP_PRIVATE | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    with mmap.mmap(fd, start + size, flags=flags, prot=mmap.PROT_READ) as mm:
        with warnings.catch_warnings():  # read-only buffer: torch warns; it is only read
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(mm, dtype=torch.uint8, offset=start, count=size)
        step = -(-size // threads)
        step += -step % (2 << 20)  # 2 MiB-aligned parts
        errors: list[BaseException] = []

        def work(dst: torch.Tensor, part: torch.Tensor) -> None:
            try:
                dst.copy_(part)
            except BaseException as e:  # noqa: BLE001 -- re-raised in the caller's thread
                errors.append(e.with_traceback(None))  # its frame would keep the map open

        workers = [
            threading.Thread(target=work, args=(buf[a : a + step], src[a : a + step]), daemon=True)
            for a in range(0, size, step)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        del workers  # (a finished thread drops its arguments: the views of the map go)
        del src  # the map closes only once no tensor views it
    if errors:
        raise errors[0]


METHODS = ("pinned", "mapped", "mapped_populate")


def read_safetensors(
    path: str | Path,
    device: torch.device | str,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    threads: int = THREADS,
    method: str = "pinned",
) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (F32 / F16 / BF16), as views of one buffer on
    ``device``. Raises ``ValueError`` naming the file for a malformed or truncated file.

    ``method``: ``pinned`` (chunks read into page-locked buffers, copied asynchronously) or
    ``mapped`` / ``mapped_populate`` (a memory map copied by ``threads`` long GIL-free calls:
    ``speed_bench/read_bench.py`` measures them, alone and beside a busy Python thread)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    path, device = Path(path), torch.device(device)
    with open(path, "rb", buffering=0) as f:
        header, start = _header(f, path)
        size = os.fstat(f.fileno()).st_size - start
        spans = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if not isinstance(info, dict) or info.get("dtype") not in _DTYPES:
                raise ValueError(f"{path}: tensor {name!r} has an unsupported entry {info!r}")
            lo, hi = info["data_offsets"]
            dtype = _DTYPES[info["dtype"]]
            count = 1
            for s in info["shape"]:
                count *= s
            if not 0 <= lo <= hi <= size or hi - lo != count * dtype.itemsize:
                raise ValueError(f"{path}: tensor {name!r} has bad data offsets {lo}, {hi}")
            if lo % dtype.itemsize:
                raise ValueError(f"{path}: tensor {name!r} is not aligned to its element size")
            spans[name] = (lo, hi, dtype, info["shape"])
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        if size and method == "pinned":
            _fill(f.fileno(), buf, start, path, chunk_bytes, max(1, threads))
        elif size:
            _fill_mapped(f.fileno(), buf, start, max(1, threads), method == "mapped_populate")
    return {
        name: buf[lo:hi].view(dtype).view(shape) for name, (lo, hi, dtype, shape) in spans.items()
    }
