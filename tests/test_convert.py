"""convert.py: Meta (any shard count) and HF directories -> Nakta at tp 1 and 2, and every refusal."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_factory import (
    TINY_PARAMS,
    TINY_PARAMS_MHA,
    meta_state_dict,
    train_tiny_tokenizer,
    write_meta_checkpoint,
)
from hf_factory import write_hf_checkpoint

import convert
from nakta_model import checkpoint as ck
from nakta_model import layout
from nakta_model.config import ModelArgs


def run(capsys, *argv) -> tuple[int, str]:
    rc = convert.main([str(a) for a in argv] + ["--quiet"])
    captured = capsys.readouterr()
    return rc, captured.err


def assert_round_trip(out, meta_sd, params, tp, dtype=torch.float32):
    """Every tensor of every rank equals the source weights re-fused (exact)."""
    args = ModelArgs.from_meta_params(params)
    for r in range(tp):
        loaded_args, sd = ck.load_rank_state_dict(out, r, tp)
        # HF has no multiple_of; a tied HF source records its tie (checked by the HF test)
        assert loaded_args.replace(multiple_of=args.multiple_of, tie_word_embeddings=False) == args
        want = layout.from_meta_state_dict(meta_sd, args, r, tp)
        assert sd.keys() == want.keys()
        for k, v in want.items():
            assert sd[k].dtype == dtype and torch.equal(sd[k], v.to(dtype)), (r, k)


@pytest.mark.parametrize("n_shards, tp", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_meta_to_nakta_round_trips(tmp_path, capsys, n_shards, tp):
    src = write_meta_checkpoint(tmp_path / "meta", TINY_PARAMS, n_shards=n_shards, seed=7)
    rc, err = run(capsys, src, tmp_path / "out", "--tp", tp)
    assert rc == 0, err
    assert_round_trip(tmp_path / "out", meta_state_dict(TINY_PARAMS, seed=7), TINY_PARAMS, tp)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["tp_size"] == tp and len(manifest["files"]) == tp + 1  # + params.json


def test_meta_dtype_option_and_vocab_placeholder(tmp_path, capsys):
    params = {**TINY_PARAMS_MHA, "vocab_size": -1}  # LLaMA-1's params.json says -1
    src = write_meta_checkpoint(tmp_path / "meta", {**params, "vocab_size": 300}, seed=2)
    (src / "params.json").write_text(json.dumps(params))
    rc, err = run(capsys, src, tmp_path / "out", "--dtype", "bf16")
    assert rc == 0, err
    assert_round_trip(
        tmp_path / "out", meta_state_dict(TINY_PARAMS_MHA, seed=2), TINY_PARAMS_MHA, 1,
        dtype=torch.bfloat16,
    )  # fmt: skip


def test_meta_tokenizer_is_copied_and_checked(tmp_path, capsys):
    src = write_meta_checkpoint(tmp_path / "meta", TINY_PARAMS, seed=1)
    train_tiny_tokenizer(src, vocab_size=300)
    assert run(capsys, src, tmp_path / "out")[0] == 0
    assert (tmp_path / "out" / "tokenizer.model").read_bytes() == (
        src / "tokenizer.model"
    ).read_bytes()
    ck.verify_checkpoint(tmp_path / "out")  # tokenizer listed and hashed in the manifest
    small = write_meta_checkpoint(tmp_path / "meta2", {**TINY_PARAMS, "vocab_size": 280}, seed=1)
    train_tiny_tokenizer(small, vocab_size=300)
    rc, err = run(capsys, small, tmp_path / "out2")
    assert rc != 0 and "300 pieces but the checkpoint's vocab_size is 280" in err


@pytest.mark.parametrize(
    "n_files, fmt, tie, index",
    [(1, "safetensors", False, True), (3, "safetensors", True, True), (2, "bin", False, True),
     (2, "safetensors", False, False)],
)  # fmt: skip
@pytest.mark.parametrize("tp", [1, 2])
def test_hf_to_nakta_round_trips(tmp_path, capsys, n_files, fmt, tie, index, tp):
    src, meta_sd = write_hf_checkpoint(
        tmp_path / "hf", TINY_PARAMS, seed=4, n_files=n_files, fmt=fmt, tie=tie, index=index
    )
    rc, err = run(capsys, src, tmp_path / "out", "--tp", tp)
    assert rc == 0, err
    assert_round_trip(tmp_path / "out", meta_sd, TINY_PARAMS, tp)
    assert ck.read_args(tmp_path / "out")[0].tie_word_embeddings == tie


def _sha(path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_stories260k_one_and_two_shards_convert_identically(tmp_path, capsys, shared_data):
    assert run(capsys, shared_data / "stories260K", tmp_path / "a")[0] == 0
    assert run(capsys, shared_data / "stories260K_mp2", tmp_path / "b")[0] == 0
    a, b = _sha(tmp_path / "a"), _sha(tmp_path / "b")
    assert set(a) == {
        "manifest.json",
        "model.tp00-of-01.safetensors",
        "params.json",
        "tokenizer.model",
    }
    assert a == b
    meta = torch.load(shared_data / "stories260K" / "consolidated.00.pth", weights_only=True)
    params = json.loads((shared_data / "stories260K" / "params.json").read_text())
    assert_round_trip(tmp_path / "a", meta, params, 1)


# ------------------------------------------------------------------------------------ refusals


@pytest.fixture
def meta_dir(tmp_path):
    return write_meta_checkpoint(tmp_path / "meta", TINY_PARAMS, n_shards=2, seed=3)


def _refused(capsys, tmp_path, src, *extra, match):
    out = tmp_path / "refused"
    rc, err = run(capsys, src, out, *extra)
    assert rc != 0
    assert match in err, err
    assert err.startswith("convert.py: error:")
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".refused")]  # no temp left


def test_refuses_a_gap_in_the_shards(tmp_path, capsys):
    src = write_meta_checkpoint(tmp_path / "meta", TINY_PARAMS_MHA, n_shards=4, seed=3)
    (src / "consolidated.01.pth").unlink()
    _refused(capsys, tmp_path, src, match="missing shard(s) consolidated.01.pth")


def test_refuses_a_missing_last_shard(capsys, tmp_path, meta_dir):
    (meta_dir / "consolidated.01.pth").unlink()  # one shard of an MP=2 checkpoint
    _refused(
        capsys,
        tmp_path,
        meta_dir,
        match="merged from 1 shard(s): tok_embeddings.weight has shape (300, 32), params say (300, 64) (a shard missing or extra",
    )


def test_refuses_an_extra_shard(capsys, tmp_path, meta_dir):
    (meta_dir / "consolidated.02.pth").write_bytes((meta_dir / "consolidated.01.pth").read_bytes())
    _refused(
        capsys,
        tmp_path,
        meta_dir,
        match="merged from 3 shard(s): tok_embeddings.weight has shape (300, 96)",
    )


def test_refuses_shapes_that_disagree_with_params(capsys, tmp_path, meta_dir):
    params = json.loads((meta_dir / "params.json").read_text())
    (meta_dir / "params.json").write_text(json.dumps({**params, "multiple_of": 64}))
    _refused(
        capsys,
        tmp_path,
        meta_dir,
        match="layers.0.feed_forward.w1.weight has shape (176, 64), params say (192, 64)",
    )


def test_refuses_unknown_tensor_names(capsys, tmp_path, meta_dir):
    sd = torch.load(meta_dir / "consolidated.00.pth", weights_only=True)
    sd["layers.0.attention.wz.weight"] = torch.zeros(2, 2)
    torch.save(sd, meta_dir / "consolidated.00.pth")
    _refused(
        capsys, tmp_path, meta_dir, match="unknown tensor names ['layers.0.attention.wz.weight']"
    )


def test_refuses_missing_tensors(capsys, tmp_path, meta_dir):
    sd = torch.load(meta_dir / "consolidated.01.pth", weights_only=True)
    del sd["layers.1.ffn_norm.weight"]
    torch.save(sd, meta_dir / "consolidated.01.pth")
    _refused(capsys, tmp_path, meta_dir, match="missing tensors ['layers.1.ffn_norm.weight']")


def test_refuses_more_layers_in_params_than_in_the_weights(capsys, tmp_path, meta_dir):
    params = json.loads((meta_dir / "params.json").read_text())
    (meta_dir / "params.json").write_text(json.dumps({**params, "n_layers": 3}))
    _refused(capsys, tmp_path, meta_dir, match="missing tensors ['layers.2.")


@pytest.mark.parametrize("tp, what", [(3, "n_heads = 4"), (8, "n_heads = 4")])
def test_refuses_tp_that_does_not_divide(capsys, tmp_path, meta_dir, tp, what):
    _refused(capsys, tmp_path, meta_dir, "--tp", tp, match=f"size {tp} does not divide {what}")


def test_tp_above_kv_heads_replicates_them(capsys, tmp_path, meta_dir):
    """tp 4 over 2 KV heads (as vLLM): each rank holds its query heads and the one KV head they
    use; reading the checkpoint back gives the source weights."""
    from nakta_model.sources import open_nakta

    rc, err = run(capsys, meta_dir, tmp_path / "out", "--tp", 4)
    assert rc == 0, err
    src = meta_state_dict(TINY_PARAMS, seed=3)
    args = ModelArgs.from_meta_params(TINY_PARAMS)
    hd = args.head_dim
    for r in range(4):
        _, sd = ck.load_rank_state_dict(tmp_path / "out", r, 4)
        wqkv = sd["layers.1.attention.wqkv.weight"]
        assert wqkv.shape == ((1 + 2) * hd, args.dim)  # 1 query head, 1 K head, 1 V head
        kv = r // 2  # ranks 0, 1 use KV head 0; ranks 2, 3 KV head 1
        assert torch.equal(wqkv[:hd], src["layers.1.attention.wq.weight"][r * hd : (r + 1) * hd])
        assert torch.equal(
            wqkv[hd : 2 * hd], src["layers.1.attention.wk.weight"][kv * hd : (kv + 1) * hd]
        )
        assert torch.equal(
            wqkv[2 * hd :], src["layers.1.attention.wv.weight"][kv * hd : (kv + 1) * hd]
        )
    back = open_nakta(tmp_path / "out")
    for name, t in src.items():
        assert torch.equal(back.get(name), t), name


def test_refuses_existing_output_without_force(capsys, tmp_path, meta_dir):
    out = tmp_path / "out"
    assert run(capsys, meta_dir, out)[0] == 0
    rc, err = run(capsys, meta_dir, out)
    assert rc == 2 and "already exists" in err and "--force" in err
    first = _sha(out)
    rc, err = run(capsys, meta_dir, out, "--force")  # a Nakta checkpoint: replaced
    assert rc == 0, err
    assert _sha(out) == first and _hidden(tmp_path) == []


def test_force_replaces_only_a_nakta_checkpoint(capsys, tmp_path, meta_dir):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    rc, err = run(capsys, meta_dir, out, "--force")
    assert rc == 2 and f"output {out} is not a Nakta checkpoint" in err
    assert (out / "keep.txt").read_text() == "precious"
    (out / "keep.txt").unlink()
    assert run(capsys, meta_dir, out, "--force")[0] == 2  # an empty directory is not one either
    out.rmdir()
    assert run(capsys, meta_dir, out)[0] == 0
    (out / "notes.txt").write_text("mine")  # a checkpoint holding something else
    rc, err = run(capsys, meta_dir, out, "--force")
    assert rc == 2 and "not part of its Nakta checkpoint ['notes.txt']" in err
    assert (out / "notes.txt").read_text() == "mine"


def _hidden(parent) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def _tree(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    "make_out, message",
    [
        (lambda src, t: src.parent, "contains the input"),
        (lambda src, t: src, "is the input directory"),
        (lambda src, t: _link(t / "link", src), "is the input directory"),
        (lambda src, t: _link(t / "link", src.parent), "contains the input"),
        (lambda src, t: src / "sub", "is inside the input directory"),
        (lambda src, t: _file(t / "file"), "exists and is not a directory"),
        (lambda src, t: _link(t / "link", _file(t / "file")), "is a symbolic link"),
        (lambda src, t: _link(t / "link", t / "nowhere"), "is a symbolic link"),
    ],
    ids=["parent-of-in", "in", "link-to-in", "link-to-parent", "inside-in", "file", "link-file",
         "dangling-link"],
)  # fmt: skip
def test_force_never_touches_the_source_a_link_or_a_file(
    capsys, tmp_path, meta_dir, make_out, message, monkeypatch
):
    before = _tree(tmp_path)
    out = make_out(meta_dir, tmp_path)
    monkeypatch.setattr(convert, "open_source", lambda *a: pytest.fail("checked after reading"))
    rc, err = run(capsys, meta_dir, out, "--force")
    assert rc == 2, err
    assert err.startswith(f"convert.py: error: output {out} ") and message in err, err
    assert err.count("\n") == 1  # one line, no traceback
    after = _tree(tmp_path)
    assert all(after.get(k) == v for k, v in before.items())  # nothing removed or changed
    assert _hidden(tmp_path) == [] and _hidden(meta_dir) == []


def _link(link, target):
    link.symlink_to(target)
    return link


def _file(path):
    path.write_text("data")
    return path


def test_refuses_an_output_that_cannot_be_created(capsys, tmp_path, meta_dir):
    blocker = _file(tmp_path / "blocker")
    rc, err = run(capsys, meta_dir, blocker / "out")
    assert rc == 2 and f"{blocker} is not a directory" in err
    if os.geteuid() == 0:
        return  # root writes anywhere: the permission half cannot be shown
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    rc, err = run(capsys, meta_dir, locked / "a" / "out")
    assert rc == 2 and f"no write permission in {locked}" in err


def test_refuses_bad_tp_before_reading(capsys, tmp_path, meta_dir):
    with pytest.raises(SystemExit) as e:
        convert.main([str(meta_dir), str(tmp_path / "out"), "--tp", "0"])
    assert e.value.code == 2 and "--tp must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="tp must be a positive int, got 0"):
        convert.convert(meta_dir, tmp_path / "out", tp=0)


def test_refuses_unknown_or_unreadable_params(capsys, tmp_path, meta_dir):
    params = json.loads((meta_dir / "params.json").read_text())
    (meta_dir / "params.json").write_text(json.dumps({**params, "vision_chunk_size": 448}))
    _refused(capsys, tmp_path, meta_dir, match="params.json: params.json has unknown key(s)")
    (meta_dir / "params.json").write_text("{")
    _refused(capsys, tmp_path, meta_dir, match="params.json: cannot read it as JSON")
    (meta_dir / "params.json").write_text("[]")
    _refused(capsys, tmp_path, meta_dir, match="params.json: expected a JSON object, got list")


def test_output_created_by_someone_else_during_the_conversion_is_kept(
    capsys, tmp_path, meta_dir, monkeypatch
):
    out = tmp_path / "out"
    real = ck.nakta_tensor

    def intrude(*a, **kw):
        if not out.exists():
            out.mkdir()
            (out / "theirs.txt").write_text("theirs")
        return real(*a, **kw)

    monkeypatch.setattr(ck, "nakta_tensor", intrude)
    rc, err = run(capsys, meta_dir, out)
    assert rc == 2 and "appeared while this write ran" in err
    assert [p.name for p in out.iterdir()] == ["theirs.txt"] and _hidden(tmp_path) == []


# ------------------------------------------------------------------- signals and stale temps

# Runs convert.main in a fresh interpreter and sends itself SIGNAL while the third output
# tensor is being built (mid-write: the shard files are open and partly written).
_SIGNAL_SCRIPT = """
import os, signal, sys
from nakta_model import checkpoint as ck
real, calls = ck.nakta_tensor, []
def nakta_tensor(*a, **kw):
    calls.append(1)
    if len(calls) == 3:
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    return real(*a, **kw)
ck.nakta_tensor = nakta_tensor
import convert
sys.exit(convert.main(sys.argv[2:]))
"""


def _convert_with_signal(signame, src, out):
    repo = Path(__file__).resolve().parents[1]
    return subprocess.run(
        [sys.executable, "-c", _SIGNAL_SCRIPT, signame, str(src), str(out), "--quiet"],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "signame, returncode, stderr",
    [
        ("SIGTERM", -signal.SIGTERM, ""),  # the default action after the cleanup: status 143
        ("SIGINT", 130, "convert.py: interrupted; no partial output left behind\n"),
    ],
)
def test_signal_mid_write_removes_the_partial_output(
    tmp_path, meta_dir, signame, returncode, stderr
):
    out = tmp_path / "out"
    proc = _convert_with_signal(signame, meta_dir, out)
    assert (proc.returncode, proc.stderr) == (returncode, stderr)
    assert not out.exists() and _hidden(tmp_path) == []


def test_a_killed_conversion_is_swept_by_the_next_one(capsys, tmp_path, meta_dir):
    out = tmp_path / "out"
    proc = _convert_with_signal("SIGKILL", meta_dir, out)
    assert proc.returncode == -signal.SIGKILL
    left = _hidden(tmp_path)
    assert len(left) == 1 and (tmp_path / left[0] / ".nakta-tmp").is_file()  # cannot be helped
    rc, err = convert.main([str(meta_dir), str(tmp_path / "other")]), capsys.readouterr().err
    assert rc == 0 and f"removed {tmp_path / left[0]}, a temporary directory left by" in err
    assert _hidden(tmp_path) == [] and not out.exists()


def test_refuses_inputs_that_are_not_checkpoints(capsys, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    _refused(capsys, tmp_path, empty, match="neither a Meta checkpoint")
    _refused(capsys, tmp_path, tmp_path / "missing", match="is not a directory")
    (empty / "params.json").write_text(json.dumps(TINY_PARAMS))
    _refused(capsys, tmp_path, empty, match="no consolidated.NN.pth shards")
    (empty / "consolidated.00.pth").write_bytes(b"not a checkpoint")
    _refused(capsys, tmp_path, empty, match="cannot read")


def test_refuses_broken_hf_directories(capsys, tmp_path):
    src, _ = write_hf_checkpoint(tmp_path / "hf", TINY_PARAMS, n_files=3)
    (src / "model-00002-of-00003.safetensors").unlink()
    _refused(capsys, tmp_path, src, match="lists missing weight file(s)")
    (src / "model.safetensors.index.json").unlink()
    _refused(capsys, tmp_path, src, match="missing weight shard(s) [2] of 3")

    src, _ = write_hf_checkpoint(tmp_path / "hf2", TINY_PARAMS)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(src / "model.safetensors"))
    save_file(
        {**sd, "model.layers.0.mlp.extra_proj.weight": torch.zeros(2)},
        str(src / "model.safetensors"),
    )
    _refused(
        capsys, tmp_path, src, match="unknown tensor name 'model.layers.0.mlp.extra_proj.weight'"
    )
    del sd["lm_head.weight"]  # not tied: the LM head is missing
    save_file(sd, str(src / "model.safetensors"))
    _refused(capsys, tmp_path, src, match="missing tensors ['output.weight']")


def test_refuses_a_broken_tokenizer_but_passes_over_a_broken_shared_one(capsys, tmp_path):
    src = write_meta_checkpoint(tmp_path / "models" / "tiny", TINY_PARAMS, seed=1)
    (tmp_path / "models" / "tokenizer.model").write_bytes(b"garbage")  # Meta's shared spot
    assert run(capsys, src, tmp_path / "out")[0] == 0
    assert not (tmp_path / "out" / "tokenizer.model").exists()
    (src / "tokenizer.model").write_bytes(b"garbage")
    _refused(capsys, tmp_path, src, match="tokenizer.model: not a SentencePiece model")
