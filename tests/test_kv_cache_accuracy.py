"""accuracy_test.kv_cache_accuracy: the e4m3 KV cache against the fp32 truth on a real checkpoint
and on random weights at a preset's shape, rows for every model in one result (small sizes)."""

from __future__ import annotations

import json

import pytest

from accuracy_test import kv_cache_accuracy as kva

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_checkpoint_and_random_weights_in_one_result(shared_data, tmp_path):
    out = tmp_path / "kv.json"
    argv = ["--checkpoint", str(shared_data / "stories260K"), "--preset", "tiny", "--layers", "1",
            "--tokenizer", str(shared_data / "stories260K" / "tokenizer.model"),
            "--hellaswag", str(shared_data / "hellaswag_val_subset1000.jsonl"),
            "--contexts", "2", "--context-len", "24", "--new-tokens", "6", "--out", str(out)]  # fmt: skip
    assert kva.main(argv) == 0
    r = json.loads(out.read_text())
    assert r["models"] == ["stories260K", "tiny-random-1of2layers"]
    assert r["contexts"]["tokens"] == {"stories260K": 24, "tiny-random-1of2layers": 24}
    rows = {(a["model"], a["dtype"], a["kv"]): a for a in r["accuracy"]}
    assert len(rows) == 6 and all(a["positions"] == 48 for a in rows.values())
    for model in r["models"]:
        bf16, fp8 = rows[model, "bfloat16", "bf16"], rows[model, "bfloat16", "fp8"]
        # the e4m3 cache moves the distributions; bf16 alone much less (real weights)
        assert fp8["mean_kl_vs_fp32"] > 0 and 0 <= bf16["top1_agree_vs_fp32"] <= 1
        assert rows[model, "float32", "fp8"]["mean_kl_vs_fp32"] > 0  # the cache's own error
    real = "stories260K"
    assert (
        rows[real, "bfloat16", "bf16"]["mean_kl_vs_fp32"]
        < rows[real, "bfloat16", "fp8"]["mean_kl_vs_fp32"]
    )
    assert len(r["greedy"]) == 6 * len(kva.PROMPTS)
    assert all(g["new_tokens"] == 6 and 0 <= g["first_divergence"] <= 6 for g in r["greedy"])


@pytest.mark.parametrize(
    "extra, needle",
    [
        ([], "at least one --checkpoint or a --preset"),
        (["--preset", "tiny"], "--preset needs --layers"),
        (["--preset", "nope", "--layers", "1", "--tokenizer", "x"], "--preset"),
        (["--preset", "tiny", "--layers", "1", "--tokenizer", "/no/such"], "no such path"),
        (["--layers", "2"], "go with --preset"),
        (["--preset", "tiny", "--layers", "1", "--tokenizer", "x", "--new-tokens", "0"],
         "--new-tokens"),
    ],
)  # fmt: skip
def test_bad_arguments_are_one_error_line(extra, needle, tmp_path, capsys):
    data = tmp_path / "h.jsonl"
    data.write_text("")
    (tmp_path / "x").write_text("")
    with pytest.raises(SystemExit) as e:
        kva.parse_args(["--hellaswag", str(data), *extra])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err
