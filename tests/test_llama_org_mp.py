"""llama_org under ``torchrun --nproc_per_node 2`` (gloo, CPU): 2 shards == 1 shard.

Meta's model parallel is real here: each rank loads its own ``consolidated.0R.pth`` into
fairscale layers that all-gather / all-reduce over gloo. The same file is the worker script
(``__main__`` below); the test runs it in a subprocess with a hard timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llama_org import Llama
from llama_org.distributed import shutdown

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240
MAX_SEQ_LEN = 64
GEN_LEN = 24


def _run_jobs(jobs: list[dict]) -> list[dict]:
    """What one process computes for each job (the torchrun worker and the 1-shard baseline)."""
    results = []
    for job in jobs:
        llama = Llama.build(
            job["ckpt_dir"],
            job["tokenizer_path"],
            max_seq_len=MAX_SEQ_LEN,
            max_batch_size=2,
            device="cpu",
        )
        tokens = torch.tensor(job["tokens"])
        full = llama.model(tokens, 0)
        # prefill + one decode step through the sharded KV cache
        cached = torch.cat(
            [llama.model(tokens[:, :-1], 0), llama.model(tokens[:, -1:], tokens.shape[1] - 1)], 1
        )
        generated, _ = llama.generate(job["prompts"], max_gen_len=job["max_gen_len"], temperature=0)
        results.append({"logits": full, "cached": cached, "generated": generated})
    return results


def _worker(jobs_path: str, out_path: str) -> None:
    import torch.distributed as dist

    os.environ["LLAMA_ORG_QUIET"] = "1"
    torch.set_num_threads(1)
    results = _run_jobs(json.loads(Path(jobs_path).read_text()))
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.barrier()
    shutdown()


def _torchrun(jobs: list[dict], tmp_path: Path) -> list[dict]:
    jobs_path, out_path = tmp_path / "jobs.json", tmp_path / "out.pt"
    jobs_path.write_text(json.dumps(jobs))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [__file__, str(jobs_path), str(out_path)]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks: our own session only
        output, _ = proc.communicate()
        pytest.fail(f"torchrun timed out after {TIMEOUT_S}s:\n{output.decode()[-3000:]}")
    assert proc.returncode == 0, output.decode()[-3000:]
    return torch.load(out_path, weights_only=True)


@pytest.fixture(scope="module", autouse=True)
def _cleanup():
    yield
    shutdown()


@pytest.mark.slow
def test_two_shards_under_torchrun_equal_one_shard(tmp_path, shared_data_or_none):
    from checkpoint_factory import TINY_PARAMS, train_tiny_tokenizer, write_meta_checkpoint

    tok = train_tiny_tokenizer(tmp_path / "tok")
    rand_tokens = [
        [1, 17, 99, 250, 31, 8, 200, 45, 46, 47, 12],
        [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14],
    ]
    pairs = [
        (
            write_meta_checkpoint(tmp_path / "mp1", TINY_PARAMS, n_shards=1, seed=11),
            write_meta_checkpoint(tmp_path / "mp2", TINY_PARAMS, n_shards=2, seed=11),
            tok,
            rand_tokens,
            [[1, 40, 41], [1, 7]],
        )
    ]
    if shared_data_or_none is not None:
        ref = json.loads((shared_data_or_none / "stories260K_greedy_reference.json").read_text())
        pairs.append(
            (
                shared_data_or_none / "stories260K",
                shared_data_or_none / "stories260K_mp2",
                shared_data_or_none / "stories260K" / "tokenizer.model",
                [ref["tokens"][:40], ref["tokens"][10:50]],
                [[1], ref["tokens"][:5]],
            )
        )

    def jobs(which: int) -> list[dict]:
        return [
            {
                "ckpt_dir": str(p[which]),
                "tokenizer_path": str(p[2]),
                "tokens": p[3],
                "prompts": p[4],
                "max_gen_len": GEN_LEN,
            }
            for p in pairs
        ]

    sharded = _torchrun(jobs(1), tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = _run_jobs(jobs(0))
    finally:
        torch.set_num_threads(threads)

    for one, two in zip(single, sharded):
        # the all-reduce in RowParallelLinear sums in another order: close, not bitwise
        torch.testing.assert_close(two["logits"], one["logits"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(two["cached"], one["logits"], rtol=1e-4, atol=1e-4)
        assert two["generated"] == one["generated"]
    if shared_data_or_none is not None:
        assert sharded[1]["generated"][0] == ref["tokens"][1 : 1 + GEN_LEN]


@pytest.fixture
def shared_data_or_none(request):
    """The real 2-shard checkpoint joins the run when ../shared/data is present."""
    try:
        return request.getfixturevalue("shared_data")
    except pytest.skip.Exception:
        return None


@pytest.mark.slow
def test_mismatched_world_fails_clearly_under_torchrun(tmp_path):
    """A 1-shard checkpoint in a world of 2: every rank raises the clear error, nothing hangs."""
    from checkpoint_factory import TINY_PARAMS, train_tiny_tokenizer, write_meta_checkpoint

    job = {
        "ckpt_dir": str(write_meta_checkpoint(tmp_path / "mp1", TINY_PARAMS)),
        "tokenizer_path": str(train_tiny_tokenizer(tmp_path / "tok")),
        "tokens": [[1, 2]],
        "prompts": [[1]],
        "max_gen_len": 1,
    }
    with pytest.raises(AssertionError, match=r"MP=1 .* world size is 2"):
        _torchrun([job], tmp_path)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
