"""torch.distributed + fairscale model-parallel set-up, as Meta's ``Llama.build`` does it.

Meta always calls ``init_process_group("nccl")`` and needs ``torchrun``. Here the backend
follows the device (NCCL on CUDA, gloo on CPU) and a plain ``python`` process works as a world
of size 1: the rendezvous variables torchrun would set get single-process defaults.
"""

from __future__ import annotations

import contextlib
import os
import socket
import warnings
from collections.abc import Iterator

import fairscale.nn.model_parallel.initialize as fs_init
import torch
import torch.distributed as dist

_STARTED_PROCESS_GROUP = False  # True when this module created the default process group


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None``: this rank's GPU (``LOCAL_RANK``) when CUDA is present, else the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    return device


def resolve_dtype(dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None``: fp16 on CUDA (as Meta), fp32 on the CPU."""
    if dtype is None:
        return torch.float16 if device.type == "cuda" else torch.float32
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(
            f"dtype must be torch.float16, torch.bfloat16 or torch.float32, got {dtype}"
        )
    return dtype


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device: torch.device) -> int:
    """Join (or create) the default process group; returns the world size."""
    global _STARTED_PROCESS_GROUP
    if not dist.is_initialized():
        if fs_init.model_parallel_is_initialized():  # groups of a world that was destroyed
            fs_init.destroy_model_parallel()
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "WORLD_SIZE" not in os.environ:  # plain `python`: a world of one
            # its address goes to init_process_group, not os.environ: torchrun's variables
            # left behind there made every child process (a CLI a test runs, accelerate in
            # HF's lm-eval model) join or re-bind this world's port
            url = f"tcp://127.0.0.1:{_free_port()}"
            dist.init_process_group(backend, init_method=url, rank=0, world_size=1)
        else:
            dist.init_process_group(backend)
        _STARTED_PROCESS_GROUP = True
    return dist.get_world_size()


def init_model_parallel(model_parallel_size: int) -> None:
    """fairscale model parallel over the whole world (Meta: MP size == world size)."""
    if fs_init.model_parallel_is_initialized():
        current = fs_init.get_model_parallel_world_size()
        if current != model_parallel_size:
            raise ValueError(
                f"fairscale model parallel is already initialized with size {current}, "
                f"but this checkpoint needs {model_parallel_size}"
            )
        return
    fs_init.initialize_model_parallel(model_parallel_size)


def shutdown() -> None:
    """Undo :func:`init_distributed` / :func:`init_model_parallel` (for tests and scripts)."""
    global _STARTED_PROCESS_GROUP
    if fs_init.model_parallel_is_initialized():
        fs_init.destroy_model_parallel()
    if _STARTED_PROCESS_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _STARTED_PROCESS_GROUP = False


_CUDA_TENSOR_TYPES = {
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float32: "torch.cuda.FloatTensor",
}


@contextlib.contextmanager
def default_tensor_type(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Build modules directly on ``device`` in ``dtype``; restores the global defaults after.

    fairscale allocates weights with the legacy ``torch.Tensor(n, m)`` constructor, which follows
    the default tensor TYPE but not ``torch.set_default_device``. On CUDA we therefore do what
    Meta does (``torch.set_default_tensor_type(torch.cuda.HalfTensor)``, for the chosen dtype);
    elsewhere the default dtype plus a device context is enough (fairscale's weights land on the
    CPU, the caller moves them).
    """
    old_dtype = torch.get_default_dtype()
    try:
        if device.type == "cuda":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # deprecated API, still Meta's way
                torch.set_default_tensor_type(_CUDA_TENSOR_TYPES[dtype])
            with torch.cuda.device(device):
                yield
        else:
            torch.set_default_dtype(dtype)
            with torch.device(device):
                yield
    finally:
        if device.type == "cuda":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                torch.set_default_tensor_type("torch.FloatTensor")
        torch.set_default_dtype(old_dtype)
