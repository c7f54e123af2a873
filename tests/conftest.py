"""Test set-up: Triton kernels run in interpreter mode on CPU-only machines.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` function is created, so it is set
here, before the tests import ``nakta_model``. GPU tests carry the ``gpu`` marker and are
skipped without CUDA; on the GPU machine run ``pytest -m gpu``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER") and not torch.cuda.is_available():
    # Under ``pytest -n 2`` each worker has one core: torch's intra-op pool (and the CLIs the
    # tests start, through OMP_NUM_THREADS) would otherwise put two threads per core and make
    # every test wait on the other worker's.
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from nakta_model import knobs  # noqa: E402

SHARED_DATA = (
    knobs.get_path("NAKTA_SHARED_DATA")
    or Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
)
if not SHARED_DATA.exists():  # on the GPU machine the data travels in a git-ignored folder
    SHARED_DATA = Path(__file__).resolve().parents[1] / ".data"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def shared_data() -> Path:
    """``../shared/data`` (real tokenizer, tiny checkpoints, HellaSwag); skips when absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture
def device() -> torch.device:
    """CUDA when present, else the CPU (Triton in interpreter mode)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch CPU thread for a module's tests (``pytestmark = pytest.mark.usefixtures(...)``):
    tiny models run faster so on 2 cores, and the tests that start ranks or worker threads
    beside them do not oversubscribe the machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def _no_process_group_outlives_its_module():
    """The process group llama_org starts for its world of one ends with the module that
    started it: a later module's test that needs none (or a fresh one) never meets it."""
    yield
    import sys

    if "llama_org.distributed" in sys.modules:
        sys.modules["llama_org.distributed"].shutdown()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
