"""nakta-serve under load and through lm-eval (slow tier): 64 concurrent streaming clients with
1 in 10 walking away mid-stream; lm-eval's ``local-completions`` against the server agreeing
with ``--model nakta`` on the same checkpoint (loglikelihood and generate_until)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch
from test_serve import (  # noqa: F401  (the fixtures are used by name)
    NAME,
    ServerProcess,
    offline,
    offline_texts,
    shared_data_module,
    stories,
)

httpx = pytest.importorskip("httpx")

WORDS = ["cat", "dog", "bird", "tree", "ball", "boat", "cake", "frog"]


@pytest.mark.slow
def test_64_streaming_clients_some_walk_away_every_page_comes_back(stories, offline):  # noqa: F811
    _, tok, _ = offline
    prompts = [f"The {WORDS[i % 8]} and the {WORDS[(i // 8) % 8]} went" for i in range(64)]
    ids = [tok.encode(p, bos=True, eos=False) for p in prompts]
    want = offline_texts(offline, ids, 48)
    s = ServerProcess(stories, "--max-batch", "16", "--chunk", "4")
    try:

        async def client(i: int, http) -> tuple[str, bool]:
            body = {"model": NAME, "prompt": ids[i], "max_tokens": 48, "temperature": 0}
            body["stream"] = True
            text, done = "", False
            async with http.stream("POST", f"{s.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                seen = 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    text += json.loads(line[6:])["choices"][0]["text"]
                    seen += 1
                    if i % 10 == 0 and seen == 1:
                        return text, False  # walks away: the connection closes
            return text, done

        async def run():
            limits = httpx.Limits(max_connections=100)
            async with httpx.AsyncClient(timeout=300, limits=limits) as http:
                return await asyncio.gather(*(client(i, http) for i in range(64)))

        results = asyncio.run(run())
        for i, (text, done) in enumerate(results):
            if i % 10:
                assert done and text == want[i], i
        deadline = time.monotonic() + 30
        while True:  # the cancelled rows' pages go back as the engine sees them go
            m = s.metrics()
            idle = m["nakta_running_rows"] == 0 and m["nakta_queue_depth"] == 0
            if idle and m["nakta_kv_pages_used"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert m["nakta_kv_pages_used"] == 0
        assert m["nakta_queue_depth"] == 0 and m["nakta_running_rows"] == 0
        # still serving
        r = httpx.post(f"{s.url}/v1/completions", json={"model": NAME, "prompt": "Hi"}, timeout=60)
        assert r.status_code == 200
    finally:
        assert s.stop() == 0


def _hf_tokenizer(checkpoint, tmp_path, tok):
    """A transformers tokenizer of the checkpoint's SentencePiece model (lm-eval's
    ``huggingface`` backend with ``add_bos_token``: LLaMA's contexts start with BOS, as
    ``--model nakta`` encodes them)."""
    transformers = pytest.importorskip("transformers")
    import shutil

    out = tmp_path / "hf_tok"
    out.mkdir()
    shutil.copy(checkpoint / "tokenizer.model", out / "tokenizer.model")
    hf = transformers.LlamaTokenizer.from_pretrained(out, legacy=True, add_bos_token=True)
    hf.save_pretrained(out)
    for text in ("Once upon a time", "A man is sitting on a roof. he is"):
        assert hf(text).input_ids == tok.encode(text, bos=True, eos=False), text
    return out


def _evaluate(model: str, model_args: str, tasks: list[str], limit: int, **kw) -> dict:
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    from accuracy_test.lm_eval_cli import TASKS_DIR, register_models

    register_models()
    tm = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    return evaluator.simple_evaluate(
        model=model, model_args=model_args, tasks=tasks, limit=limit, log_samples=True,
        task_manager=tm, device="cpu", **kw,
    )  # fmt: skip


@pytest.mark.slow
def test_lm_eval_local_completions_equals_model_nakta(stories, offline, tmp_path, monkeypatch):  # noqa: F811
    pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")  # lm-eval's API models need it (lm-eval[api])
    from conftest import SHARED_DATA

    data = SHARED_DATA / "hellaswag_val_subset1000.jsonl"
    if not data.is_file():
        pytest.skip(f"{data} not found")
    monkeypatch.setenv("NAKTA_HELLASWAG_JSONL", str(data))
    monkeypatch.setenv("OPENAI_API_KEY", "sk-load")
    _, tok, _ = offline
    hf_dir = _hf_tokenizer(stories, tmp_path, tok)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    s = ServerProcess(stories, "--api-key", "sk-load", "--max-batch", "8")
    try:
        remote = (
            f"base_url={s.url}/v1/completions,model={NAME},tokenizer_backend=huggingface,"
            f"tokenizer={hf_dir},add_bos_token=True,max_length=512,num_concurrent=4,"
            "use_fast_tokenizer=False"
        )
        local = f"checkpoint={stories},dtype=fp32"
        gen = {"gen_kwargs": "max_gen_toks=48", "num_fewshot": 1}
        for task, limit, kw in (("hellaswag_local", 50, {}), ("gsm8k_shaped_local", 6, gen)):
            a = _evaluate("local-completions", remote, [task], limit, **kw)
            b = _evaluate("nakta", local, [task], limit, **kw)
            sa, sb = a["samples"][task], b["samples"][task]
            assert len(sa) == len(sb) == limit
            sa = sorted(sa, key=lambda x: x["doc_id"])
            sb = sorted(sb, key=lambda x: x["doc_id"])
            for x, y in zip(sa, sb):
                if task == "hellaswag_local":
                    for (lx, gx), (ly, gy) in zip(
                        (r[0] for r in x["resps"]), (r[0] for r in y["resps"])
                    ):
                        assert float(lx) == pytest.approx(float(ly), rel=1e-6, abs=1e-5)
                        assert gx == gy
                else:  # the server keeps the continuation's leading space, as OpenAI's does
                    assert x["resps"][0][0].strip() == y["resps"][0][0].strip()
            ra, rb = a["results"][task], b["results"][task]
            for metric in ("acc,none", "acc_norm,none", "exact_match,none"):
                if metric in rb:
                    assert ra[metric] == rb[metric], metric
    finally:
        torch.set_num_threads(threads)
        assert s.stop() == 0
