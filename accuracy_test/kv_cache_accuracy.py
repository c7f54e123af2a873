"""FP8 KV cache accuracy on a real checkpoint (issue 42 item 4): the fp32 truth against a bf16
model with a bf16 KV cache and with an e4m3 one (and an fp32 model with an e4m3 cache, the
cache's own error alone).

Next-token distributions: ``--contexts`` windows of ``--context-len`` tokens of HellaSwag text
(context plus its gold ending, concatenated, tokenized with the checkpoint's tokenizer), each
run as one forward that writes its K/V into the cache and reads every key back from it (so
every position's attention sees quantized keys and values); per position the top-1 agreement
with the truth and KL(truth || variant). Greedy decodes: the ``Generator`` (paged cache, the
decode step) from short story prompts to the checkpoint's full context; per variant the tokens
equal to the truth's and the first position where it leaves the truth.

Writes ``--out`` (default ``accuracy_test/results/kv_cache_accuracy.json``): ``accuracy`` rows
in the shape issue 42 asks for (``model``, ``kv``, ``top1_agree_vs_fp32``, ``mean_kl_vs_fp32``,
plus the model's ``dtype``), and ``greedy`` rows.

    python -m accuracy_test.kv_cache_accuracy --checkpoint ../shared/data/stories260K \\
        --hellaswag ../shared/data/hellaswag_val_subset1000.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from nakta_model.fp8 import Precision
from nakta_model.generation import GenerationRequest, Generator
from nakta_model.io_utils import atomic_write_text
from nakta_model.loading import load
from nakta_model.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent
DEFAULT_OUT = ROOT / "results" / "kv_cache_accuracy.json"
# (model dtype, KV cache): the truth is fp32 / fp32
VARIANTS = ((torch.bfloat16, "bf16"), (torch.bfloat16, "fp8"), (torch.float32, "fp8"))
PROMPTS = ("Once upon a time", "Lily and Ben went to the park.", "The little dog was sad")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint folder")
    p.add_argument("--hellaswag", type=Path, required=True, help="HellaSwag jsonl (ctx, endings)")
    p.add_argument("--contexts", type=int, default=8, help="context windows (default 8)")
    p.add_argument("--context-len", type=int, default=400, help="tokens a window (default 400)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = p.parse_args(argv)
    if a.contexts < 1 or a.context_len < 2:
        p.error("--contexts must be >= 1 and --context-len >= 2")
    for name in ("checkpoint", "hellaswag"):
        if not getattr(a, name).exists():
            p.error(f"--{name}: no such path {getattr(a, name)}")
    return a


def windows(tok, path: Path, n: int, length: int) -> torch.Tensor:
    """``[n, length]`` token windows of HellaSwag text (BOS first), none overlapping."""
    ids: list[int] = []
    need = n * (length - 1)
    with path.open() as f:
        for line in f:
            row = json.loads(line)
            ids += tok.encode(
                row["ctx"] + " " + row["endings"][int(row["label"])], bos=False, eos=False
            )
            if len(ids) >= need:
                break
    if len(ids) < need:
        raise SystemExit(f"error: --hellaswag holds {len(ids)} tokens, {need} needed")
    body = torch.tensor(ids[:need]).view(n, length - 1)
    return torch.cat([torch.full((n, 1), tok.bos_id), body], 1)


def cached_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """fp32 log-probabilities ``[n, L, vocab]``: one cached forward a window (the K/V written
    to the cache, then every key read back from it)."""
    out = []
    for row in tokens:
        model.setup_cache(1, tokens.shape[1])
        with torch.no_grad():
            out.append(torch.log_softmax(model(row[None], 0)[0].float(), -1))
        model.clear_cache()
    return torch.stack(out)


def greedy(model, tok, kv: str) -> list[list[int]]:
    n_ctx = model.args.max_seq_len
    prompts = [tok.encode(p, bos=True, eos=False) for p in PROMPTS]
    gen = Generator(model, max_batch=len(prompts), max_seq_len=n_ctx, graphs=False, kv_cache=kv)
    reqs = [GenerationRequest(p, n_ctx - len(p)) for p in prompts]  # to the full context
    return [r.tokens for r in gen.generate(reqs)]


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    torch.manual_seed(0)
    tok = load_tokenizer(a.checkpoint)
    name = a.checkpoint.name
    t0 = time.time()
    truth_model = load(a.checkpoint, "cpu", torch.float32, kernels="reference")
    ctx = windows(tok, a.hellaswag, a.contexts, min(a.context_len, truth_model.args.max_seq_len))
    truth = cached_logits(truth_model, ctx)
    truth_greedy = greedy(truth_model, tok, "bf16")
    accuracy, greedy_rows = [], []
    for dtype, kv in VARIANTS:
        model = load(
            a.checkpoint, "cpu", dtype, kernels="reference", quant=Precision.parse(None, kv)
        )
        logp = cached_logits(model, ctx)
        kl = (truth.exp() * (truth - logp)).sum(-1)
        top1 = (logp.argmax(-1) == truth.argmax(-1)).float()
        dname = str(dtype).removeprefix("torch.")
        accuracy.append({
            "model": name, "dtype": dname, "kv": kv,
            "top1_agree_vs_fp32": round(top1.mean().item(), 6),
            "mean_kl_vs_fp32": float(f"{kl.mean().item():.4g}"),
            "max_kl_vs_fp32": float(f"{kl.max().item():.4g}"),
            "positions": int(top1.numel()),
        })  # fmt: skip
        for prompt, want, got in zip(PROMPTS, truth_greedy, greedy(model, tok, kv)):
            same = [x == y for x, y in zip(want, got)]
            first = same.index(False) if False in same else len(same)
            greedy_rows.append({
                "model": name, "dtype": dname, "kv": kv, "prompt": prompt,
                "new_tokens": len(got), "equal_to_fp32": sum(same),
                "first_divergence": first,
            })  # fmt: skip
        print(f"{name} {dname} model, {kv} KV: {accuracy[-1]}", file=sys.stderr)
    result = {
        "model": name,
        "truth": "fp32 model, fp32 KV cache",
        "contexts": {"windows": a.contexts, "tokens": int(ctx.shape[1]), "text": "HellaSwag"},
        "accuracy": accuracy,
        "greedy": greedy_rows,
        "wall_s": round(time.time() - t0, 1),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(a.out, json.dumps(result, indent=1) + "\n")
    print(f"results -> {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
