"""Nakta checkpoint format: fusion/splitting, the HF permutation, the writer, manifest checks."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_factory import TINY_PARAMS, meta_state_dict, shard_state_dict
from hf_factory import hf_permute, hf_state_dict

import nakta_model
from nakta_model import checkpoint as ck
from nakta_model import layout
from nakta_model.config import ModelArgs
from nakta_model.kernels.rope import apply_rope_qkv_reference, build_rope_cache

ARGS = ModelArgs.from_meta_params(TINY_PARAMS)


@pytest.fixture(scope="module")
def meta_sd():
    return meta_state_dict(TINY_PARAMS, seed=5)


@pytest.mark.parametrize("tp", [1, 2])
def test_fusion_layout_and_inverse(meta_sd, tp):
    shards = [layout.from_meta_state_dict(meta_sd, ARGS, r, tp) for r in range(tp)]
    hd, hq, hkv, f = ARGS.head_dim, ARGS.n_heads // tp, ARGS.n_kv_heads // tp, ARGS.hidden_dim // tp
    for r, s in enumerate(shards):
        assert {k: tuple(v.shape) for k, v in s.items()} == layout.nakta_shapes(ARGS, tp)
        wqkv = s["layers.1.attention.wqkv.weight"]
        # Rank r holds Q heads [r*hq, (r+1)*hq), then its K heads, then its V heads.
        q_rows = meta_sd["layers.1.attention.wq.weight"][r * hq * hd : (r + 1) * hq * hd]
        k_rows = meta_sd["layers.1.attention.wk.weight"][r * hkv * hd : (r + 1) * hkv * hd]
        v_rows = meta_sd["layers.1.attention.wv.weight"][r * hkv * hd : (r + 1) * hkv * hd]
        assert torch.equal(wqkv, torch.cat([q_rows, k_rows, v_rows]))
        w13 = s["layers.0.feed_forward.w13.weight"]
        assert torch.equal(w13[:f], meta_sd["layers.0.feed_forward.w1.weight"][r * f : (r + 1) * f])
        assert torch.equal(w13[f:], meta_sd["layers.0.feed_forward.w3.weight"][r * f : (r + 1) * f])
        assert torch.equal(
            s["layers.0.feed_forward.w2.weight"],
            meta_sd["layers.0.feed_forward.w2.weight"][:, r * f : (r + 1) * f],
        )
        assert torch.equal(s["tok_embeddings.weight"], meta_sd["tok_embeddings.weight"])
    back = layout.to_meta_state_dict(shards, ARGS)
    assert back.keys() == meta_sd.keys()
    for k in meta_sd:
        assert torch.equal(back[k], meta_sd[k]), k


def test_merge_meta_shards_undoes_fairscale_split(meta_sd):
    merged = layout.merge_meta_shards(shard_state_dict(meta_sd, 2), ARGS)
    assert all(torch.equal(merged[k], meta_sd[k]) for k in meta_sd)
    bad = shard_state_dict(meta_sd, 2)
    bad[1]["layers.0.attention.wq.weight"] = bad[1]["layers.0.attention.wq.weight"][:-8]
    with pytest.raises(ck.CheckpointError, match="shards disagree on shape"):
        layout.merge_meta_shards(bad, ARGS)
    with pytest.raises(ck.CheckpointError, match="merged shape"):
        layout.merge_meta_shards(shard_state_dict(meta_sd, 2)[:1], ARGS)
    extra = dict(meta_sd, **{"layers.0.attention.wz.weight": torch.zeros(1)})
    with pytest.raises(ck.CheckpointError, match="unknown tensor names"):
        layout.merge_meta_shards([extra], ARGS)
    assert layout.merge_meta_shards([dict(meta_sd, **{"rope.freqs": torch.zeros(8)})], ARGS)


def test_hf_unpermute_is_the_inverse_and_matches_rope_semantics(meta_sd):
    """Meta pairs rotated on Meta rows == HF halves rotated on HF rows (then HF-permuted back)."""
    n_heads, hd = ARGS.n_heads, ARGS.head_dim
    wq = meta_sd["layers.0.attention.wq.weight"]
    assert torch.equal(layout.unpermute_hf(hf_permute(wq, n_heads), n_heads), wq)
    assert torch.equal(layout.permute_for_hf(wq, n_heads), hf_permute(wq, n_heads))
    x = torch.randn(5, ARGS.dim)
    cos, sin = build_rope_cache(16, hd)
    pos = torch.arange(3, 8)

    def rot(rows, interleaved):  # rotate q rows inside a fused matrix with a dummy K/V head
        qkv = torch.cat([x @ rows.T, torch.zeros(5, 2 * hd)], 1)
        apply_rope_qkv_reference(qkv, pos, cos, sin, n_heads, 1, hd, interleaved=interleaved)
        return qkv[:, : n_heads * hd]

    meta_rot = rot(wq, True)
    hf_rot = rot(hf_permute(wq, n_heads), False)
    # HF's output channel order is the permuted one: bring it back with the inverse permutation.
    back = layout.unpermute_hf(hf_rot.T.contiguous(), n_heads).T
    torch.testing.assert_close(back, meta_rot, rtol=1e-6, atol=1e-6)
    # And from_hf_state_dict recovers the Meta weights exactly (GQA: k uses n_kv_heads).
    rec = layout.from_hf_state_dict(hf_state_dict(meta_sd, TINY_PARAMS), ARGS)
    assert all(torch.equal(rec[k], meta_sd[k]) for k in meta_sd)


def test_writer_output_is_a_standard_safetensors_file(tmp_path, meta_sd):
    from safetensors.torch import load_file, save_file

    out = ck.save_checkpoint(tmp_path / "ck", meta_sd, ARGS, tp_size=2, dtype=torch.bfloat16)
    for r in range(2):
        f = out / ck.shard_file_name(r, 2)
        loaded = load_file(str(f))
        want = layout.from_meta_state_dict(meta_sd, ARGS, r, 2)
        assert loaded.keys() == want.keys()
        for k in want:
            assert loaded[k].dtype == torch.bfloat16
            assert torch.equal(loaded[k], want[k].to(torch.bfloat16)), k
        # Same bytes as the reference writer given the same tensors.
        save_file(loaded, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
        assert (tmp_path / "ref.safetensors").read_bytes() == f.read_bytes()


def _saved(tmp_path, meta_sd, tp=1):
    return ck.save_checkpoint(tmp_path / f"ck{tp}", meta_sd, ARGS, tp_size=tp)


def test_load_rank_round_trip_and_tp_mismatch(tmp_path, meta_sd):
    out = _saved(tmp_path, meta_sd, tp=2)
    for r in range(2):
        args, sd = ck.load_rank_state_dict(out, r, 2)
        assert args == ARGS
        want = layout.from_meta_state_dict(meta_sd, ARGS, r, 2)
        assert sd.keys() == want.keys() and all(torch.equal(sd[k], want[k]) for k in want)
    with pytest.raises(ck.CheckpointError, match="sharded for tp_size=2, but tp_size=1"):
        ck.load_rank_state_dict(out, 0, 1)
    with pytest.raises(ValueError, match=r"tp_rank must be an int in \[0, 2\), got 2"):
        ck.load_rank_state_dict(out, 2, 2)
    with pytest.raises(ck.CheckpointError, match="sharded for tp_size=2, but tp_size=1"):
        nakta_model.load(out, "cpu")


def test_manifest_catches_corruption_truncation_and_missing_files(tmp_path, meta_sd):
    out = _saved(tmp_path, meta_sd)
    f = out / ck.shard_file_name(0, 1)
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointError, match="sha256 differs"):
        nakta_model.load(out, "cpu")
    nakta_model.load(out, "cpu", verify=False)  # size still right: hashing was the only check
    f.write_bytes(bytes(data[:-4]))
    with pytest.raises(ck.CheckpointError, match="truncated"):
        nakta_model.load(out, "cpu", verify=False)
    f.unlink()
    with pytest.raises(ck.CheckpointError, match="missing"):
        nakta_model.load(out, "cpu")
    (out / "manifest.json").unlink()
    with pytest.raises(ck.CheckpointError, match="manifest.json not found"):
        nakta_model.load(out, "cpu")


def test_manifest_tensor_list_and_format_version_are_enforced(tmp_path, meta_sd):
    out = _saved(tmp_path, meta_sd)
    man = json.loads((out / "manifest.json").read_text())
    info = man["files"][ck.shard_file_name(0, 1)]["tensors"]
    info["norm.weight"]["shape"] = [1]
    (out / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ck.CheckpointError, match="norm.weight does not match the manifest"):
        nakta_model.load(out, "cpu")
    params = json.loads((out / "params.json").read_text())
    (out / "params.json").write_text(json.dumps({**params, "format_version": 99}))
    with pytest.raises(ck.CheckpointError, match="format_version 99"):
        nakta_model.load(out, "cpu")
    with pytest.raises(ck.CheckpointError, match="not a Nakta checkpoint"):
        nakta_model.load(tmp_path / "nowhere", "cpu")


def test_load_builds_no_uninitialized_tensors_and_converts_dtype(tmp_path, meta_sd):
    out = _saved(tmp_path, meta_sd)
    model = nakta_model.load(out, "cpu", torch.bfloat16)
    sd = model.state_dict()
    want = layout.from_meta_state_dict(meta_sd, ARGS)
    assert sd.keys() == want.keys()
    for k in want:
        assert sd[k].device.type == "cpu" and sd[k].dtype == torch.bfloat16
        assert torch.equal(sd[k], want[k].to(torch.bfloat16)), k
    assert not any(p.requires_grad for p in model.parameters())


def test_existing_output_is_refused_without_force(tmp_path, meta_sd):
    out = _saved(tmp_path, meta_sd)
    with pytest.raises(FileExistsError):
        _saved(tmp_path, meta_sd)
    other = {k: v + 1 for k, v in meta_sd.items()}
    ck.save_checkpoint(out, other, ARGS, force=True)
    _, sd = ck.load_rank_state_dict(out)
    assert torch.equal(sd["norm.weight"], other["norm.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck1"]  # no temp dirs left behind


def test_meta_to_hf_name_inverts_hf_to_meta_name():
    for name in meta_state_dict(TINY_PARAMS):
        hf = layout.meta_to_hf_name(name)
        assert hf != name and layout.hf_to_meta_name(hf) == name
    with pytest.raises(ck.CheckpointError, match="unknown Meta tensor name"):
        layout.meta_to_hf_name("layers.0.attention.wz.weight")


# ------------------------------------------------------------- manifest names, --force target


@pytest.mark.parametrize(
    "entry", ["../outside.bin", "/etc/hostname", "sub/file.bin", "a..b", "..", "link.bin"]
)
def test_manifest_entries_must_stay_inside_the_checkpoint(tmp_path, meta_sd, entry):
    out = _saved(tmp_path, meta_sd)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"12345")
    (out / "sub").mkdir()
    (out / "sub" / "file.bin").write_bytes(b"12345")
    (out / "a..b").write_bytes(b"12345")
    (out / "link.bin").symlink_to(outside)  # a plain name that resolves outside
    man = json.loads((out / "manifest.json").read_text())
    man["files"][entry] = {"size": 5, "sha256": "0" * 64}
    (out / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ck.CheckpointError, match=f"file entry '{entry}'"):
        ck.verify_checkpoint(out)
    with pytest.raises(ck.CheckpointError, match=f"file entry '{entry}'"):
        nakta_model.load(out, "cpu")


def test_unreadable_manifest_and_params_name_the_file(tmp_path, meta_sd):
    out = _saved(tmp_path, meta_sd)
    (out / "params.json").write_text("{not json")
    with pytest.raises(ck.CheckpointError, match=r"params\.json: cannot read it as JSON"):
        nakta_model.load(out, "cpu")
    (out / "manifest.json").write_text("[1, 2]")
    with pytest.raises(ck.CheckpointError, match=r"manifest\.json: expected a JSON object"):
        ck.verify_checkpoint(out)
    (out / "manifest.json").write_text(json.dumps({"format_version": 1, "files": {"x": {}}}))
    with pytest.raises(ck.CheckpointError, match="'x' has no valid size"):
        ck.verify_checkpoint(out)


def test_only_a_checkpoint_holding_nothing_else_is_replaceable(tmp_path, meta_sd):
    out = _saved(tmp_path, meta_sd)
    ck.check_replaceable(out)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(
        ck.CheckpointError, match=r"not part of its Nakta checkpoint \['notes.txt'\]"
    ):
        ck.check_replaceable(out)
    with pytest.raises(ck.CheckpointError, match="not part of its Nakta checkpoint"):
        ck.save_checkpoint(out, meta_sd, ARGS, force=True)
    assert (out / "notes.txt").exists()
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(ck.CheckpointError, match="is not a Nakta checkpoint"):
        ck.save_checkpoint(plain, meta_sd, ARGS, force=True)
    (plain / "manifest.json").write_text(json.dumps({"files": {}}))
    with pytest.raises(ck.CheckpointError, match="not a Nakta manifest"):
        ck.check_replaceable(plain)


# ------------------------------------------------------------------------- verification modes


def test_sample_plan_reads_at_most_64_mib_and_covers_both_ends():
    size = 13_476_839_424 + 123  # a 7B bf16 shard, not a whole number of blocks
    plan = ck.sample_plan(size, head_bytes=5000)
    ranges = ck.sample_ranges(size, **plan)
    hashed = sum(end - start for start, end in ranges)
    assert hashed <= 64 * ck.SAMPLE_BLOCK_BYTES
    assert ranges[0][0] == 0 and ranges[-1][1] == size
    assert all(a[1] < b[0] for a, b in zip(ranges, ranges[1:]))  # sorted, disjoint
    assert ck.sample_ranges(10, 4, 1, 0) == [(0, 10)]  # small file: all of it
    assert ck.sample_ranges(100, 10, 4, 3) == [(0, 10), (40, 50), (80, 100)]


@pytest.fixture
def sparse_sampled(tmp_path, meta_sd, monkeypatch):
    """A checkpoint written with tiny sample blocks (64 B, at most 4 per file), so that most
    bytes of its shard are outside the sample; the constants are restored before reading."""
    with monkeypatch.context() as m:
        m.setattr(ck, "SAMPLE_BLOCK_BYTES", 64)
        m.setattr(ck, "SAMPLE_MAX_BLOCKS", 4)
        out = _saved(tmp_path, meta_sd)
    f = out / ck.shard_file_name(0, 1)
    info = json.loads((out / "manifest.json").read_text())["files"][f.name]
    assert info["sample"]["block_bytes"] == 64 and info["sample"]["stride_blocks"] > 1
    ranges = ck.sample_ranges(info["size"], **info["sample"])
    sampled = {i for start, end in ranges for i in range(start, end)}
    head = info["sample"]["head_bytes"]
    unsampled = next(i for i in range(head, info["size"]) if i not in sampled)
    in_sample = ranges[-1][0]  # the last block: tensor data, not the header
    return out, f, unsampled, in_sample


def _flip(f, offset):
    data = bytearray(f.read_bytes())
    data[offset] ^= 0x55
    f.write_bytes(bytes(data))


def test_fast_verify_catches_a_corrupt_sampled_block(sparse_sampled):
    out, f, _, in_sample = sparse_sampled
    ck.verify_checkpoint(out)  # the reader recomputes the digest from the stored parameters
    _flip(f, in_sample)
    for verify in ("fast", True, "full"):
        with pytest.raises(ck.CheckpointError, match="sha256 differs"):
            nakta_model.load(out, "cpu", verify=verify)
    nakta_model.load(out, "cpu", verify="size")


def test_full_verify_catches_corruption_anywhere(sparse_sampled):
    out, f, unsampled, _ = sparse_sampled
    _flip(f, unsampled)
    ck.verify_checkpoint(out, verify="fast")  # outside the sample: fast cannot see it
    nakta_model.load(out, "cpu")  # the default is fast
    with pytest.raises(ck.CheckpointError, match=r"\.safetensors: sha256 differs"):
        nakta_model.load(out, "cpu", verify="full")


def test_truncation_is_caught_by_every_mode(sparse_sampled):
    out, f, _, _ = sparse_sampled
    f.write_bytes(f.read_bytes()[:-1])
    for verify in ("fast", "full", "size", False):
        with pytest.raises(ck.CheckpointError, match="truncated"):
            ck.verify_checkpoint(out, verify=verify)


def test_old_manifest_without_sample_digest_verifies_sizes_under_fast(sparse_sampled):
    out, f, _, in_sample = sparse_sampled
    man = json.loads((out / "manifest.json").read_text())
    for info in man["files"].values():
        del info["sample_sha256"], info["sample"]
    (out / "manifest.json").write_text(json.dumps(man))
    _flip(f, in_sample)
    ck.verify_checkpoint(out, verify="fast")
    with pytest.raises(ck.CheckpointError, match="sha256 differs"):
        ck.verify_checkpoint(out, verify="full")


def test_verify_argument_and_sample_parameters_are_checked(sparse_sampled):
    out, *_ = sparse_sampled
    with pytest.raises(ValueError, match=r"verify must be one of \['fast', 'full', 'size'\]"):
        ck.verify_checkpoint(out, verify="quick")
    man = json.loads((out / "manifest.json").read_text())
    man["files"][ck.shard_file_name(0, 1)]["sample"]["stride_blocks"] = 0
    (out / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ck.CheckpointError, match="sample parameters are invalid"):
        ck.verify_checkpoint(out)
