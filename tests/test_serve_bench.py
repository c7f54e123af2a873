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
    assert saved["engine_online_tok_s"] > 0  # the same Generator fed online, no HTTP
    assert [r["rate"] for r in saved["runs"]] == [20.0, None]
    for r in saved["runs"]:
        for key in ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "itl_p99_s"):
            assert r[key] > 0, key
    assert saved["runs"][1]["prompts"] == 6 and summary["runs"][0]["prompts"] == 4
    assert (out / "serve.md").is_file() and (out / "serve.png").stat().st_size > 0
    assert os.path.isfile(out / "serve.csv")
    diag = (out / "serve_diagnostics.md").read_text()
    for row in ("| offline ", "| engine_online ", "| main "):
        assert row in diag, row


def test_variants_parse_into_names_and_server_arguments(capsys):
    a = serve_bench.parse_args(
        ["--tokenizer", "t", "--variant", "gil5=--switch-interval-ms 5", "--variant", "plain="]
    )
    assert a.variants == [("gil5", ["--switch-interval-ms", "5"]), ("plain", [])]
    assert a.variant_rate_list == [10.0, None]
    for bad in ("noequals", "main=--chunk 4", "two words=--chunk 4"):
        with pytest.raises(SystemExit) as e:
            serve_bench.parse_args(["--tokenizer", "t", "--variant", bad])
        assert e.value.code == 2 and "--variant" in capsys.readouterr().err


def test_diagnose_reads_the_server_counters_across_a_run():
    before = {"nakta_engine_decode_steps_total": 10.0, "nakta_generation_tokens_total": 100.0}
    after = {
        "nakta_engine_decode_steps_total": 30.0,
        "nakta_generation_tokens_total": 504.0,  # 4 first tokens (prefill) + 400 decoded
        "nakta_engine_prefill_forwards_total": 2.0,
        "nakta_engine_prefilled_tokens_total": 64.0,
        "nakta_engine_busy_seconds_total": 2.0,
        "nakta_engine_cpu_seconds_total": 1.5,
        "nakta_engine_prefill_seconds_total": 0.2,
        "nakta_engine_decode_seconds_total": 1.4,
        "nakta_ttft_queue_seconds_sum": 0.04,
        "nakta_ttft_queue_seconds_count": 4.0,
        "nakta_stream_events_total": 40.0,
        "nakta_stream_seconds_total": 0.002,
        "nakta_loop_cpu_seconds_total": 0.01,
    }
    d = serve_bench.diagnose(before, after, prompts=4)
    assert d["rows_per_step"] == pytest.approx(20.0) and d["decode_steps"] == 20
    assert d["prefill_tokens_per_forward"] == pytest.approx(32.0)
    assert d["engine_step_pct"] == pytest.approx(80.0)
    assert d["engine_gil_wait_pct"] == pytest.approx(25.0)
    assert d["ttft_queue_ms"] == pytest.approx(10.0)
    assert d["ttft_engine_ms"] != d["ttft_engine_ms"]  # no samples: nan
    assert d["stream_us_per_event"] == pytest.approx(50.0)
    assert d["loop_us_per_event"] == pytest.approx(250.0)
    assert d["events_per_request"] == pytest.approx(10.0)


def _reader(data: bytes):
    import asyncio

    r = asyncio.StreamReader()
    r.feed_data(data)
    r.feed_eof()
    return r


def test_client_reads_chunked_server_sent_events_split_anywhere():
    import asyncio

    events = (
        b'data: {"choices": [{"text": "a"}]}\n\n'
        b'data: {"choices": [{"text": "b"}]}\n\ndata: {"choices": [{"text": "c"}]}\n\n'
        b'data: {"choices": [], "usage": {"completion_tokens": 7}}\n\ndata: [DONE]\n\n'
    )
    cuts = [0, 20, 41, 90, len(events)]  # chunk borders inside lines and between events
    body = (
        b"".join(b"%x\r\n%s\r\n" % (b - a, events[a:b]) for a, b in zip(cuts, cuts[1:]))
        + b"0\r\n\r\n"
    )
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )

    async def go(data):
        return await serve_bench._read_stream(_reader(data))

    got, tokens = asyncio.run(go(head + body))
    assert len(got) == 3 and tokens == 7 and got == sorted(got)
    plain = b"HTTP/1.1 200 OK\r\n\r\n" + events  # no chunking: the body to the end
    assert asyncio.run(go(plain))[1] == 7
    with pytest.raises(RuntimeError, match="429"):
        asyncio.run(go(b"HTTP/1.1 429 Too Many Requests\r\n\r\n{}"))
    err = b"HTTP/1.1 200 OK\r\n\r\n" + b'data: {"error": {"message": "x"}}\n\n'
    with pytest.raises(RuntimeError, match="error event"):
        asyncio.run(go(err))
