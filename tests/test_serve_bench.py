"""speed_bench/serve_bench.py: the summary's numbers from known event times, and one tiny run
end to end (stories260K on the CPU: the offline reference, a server it starts and stops, one
finite rate and the unbounded one) writing the issue's schema."""

from __future__ import annotations

import json
import os

import pytest

from speed_bench import serve_bench


def test_summary_reads_ttft_tpot_and_gaps_from_event_times():
    # two requests: sent at 0 and 1; events (each a chunk of tokens) and their token counts
    results = [(0.0, [0.1, 0.3, 0.5], 9), (1.0, [1.2, 1.6], 5)]
    r = serve_bench.summarize(5.0, results)
    assert r["rate"] == 5.0 and r["prompts"] == 2
    assert r["output_tok_s"] == pytest.approx(14 / 1.6)
    assert r["ttft_p50_s"] == pytest.approx(0.1) and r["ttft_p99_s"] == pytest.approx(0.2)
    assert r["tpot_p50_s"] == pytest.approx(0.05)  # 0.4 / 8 and 0.4 / 4 = 0.1
    assert r["itl_p99_s"] == pytest.approx(0.4)  # gaps 0.2, 0.2, 0.4
    assert serve_bench.percentile([], 50) != serve_bench.percentile([], 50)  # nan


def test_bad_rates_are_one_error_line(capsys):
    with pytest.raises(SystemExit) as e:
        serve_bench.parse_args(["--tokenizer", "t", "--rates", "5,fast"])
    assert e.value.code == 2
    assert "--rates" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_run_writes_the_summary(shared_data, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ckpt = shared_data / "stories260K"
    out = tmp_path / "serve"
    argv = ["--checkpoint", str(ckpt), "--prompts", "6", "--rate-prompts", "4"]
    argv += ["--input-len", "16", "--output-len", "12", "--rates", "20,inf"]
    argv += ["--max-batch", "4", "--chunk", "4", "--device", "cpu", "--out", str(out)]
    summary = serve_bench.main(argv)
    saved = json.loads((out / "serve_summary.json").read_text())
    assert saved["device_name"] == "cpu" and saved["offline_tok_s"] > 0
    assert [r["rate"] for r in saved["runs"]] == [20.0, None]
    for r in saved["runs"]:
        for key in ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "itl_p99_s"):
            assert r[key] > 0, key
    assert saved["runs"][1]["prompts"] == 6 and summary["runs"][0]["prompts"] == 4
    assert (out / "serve.md").is_file() and (out / "serve.png").stat().st_size > 0
    assert os.path.isfile(out / "serve.csv")
