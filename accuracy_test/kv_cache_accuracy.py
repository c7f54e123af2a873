"""FP8 KV cache accuracy (issue 42 item 4): the fp32 truth against a bf16 model with a bf16 KV
cache and with an e4m3 one (and an fp32 model with an e4m3 cache, the cache's own error alone),
on real checkpoints and on random weights at a real shape.

Next-token distributions: ``--contexts`` windows of ``--context-len`` tokens of HellaSwag text
(context plus its gold ending, concatenated, tokenized with the model's tokenizer; at most the
model's context), each run as one forward that writes its K/V into the cache and reads every
key back from it (so every position's attention sees quantized keys and values); per position
the top-1 agreement with the truth and KL(truth || variant). Greedy decodes: the ``Generator``
(paged cache, the decode step) from short story prompts, ``--new-tokens`` each (default: to the
model's context); per variant the tokens equal to the truth's and the first position where it
leaves the truth.

Models: each ``--checkpoint`` (real weights), and ``--preset NAME --layers N --tokenizer
PATH``: seeded random bf16 weights at the preset's width, heads and vocabulary, its first N
layers (the truth is those very weights in fp32; a context of ``--context-len`` and the new
tokens).

Writes ``--out`` (default ``accuracy_test/results/kv_cache_accuracy.json``): ``accuracy`` rows
in the shape issue 42 asks for (``model``, ``kv``, ``top1_agree_vs_fp32``, ``mean_kl_vs_fp32``,
plus the model's ``dtype``), and ``greedy`` rows, for every model.

    python -m accuracy_test.kv_cache_accuracy --checkpoint ../shared/data/stories260K \\
        --hellaswag ../shared/data/hellaswag_val_subset1000.jsonl \\
        --preset 7B --layers 4 --tokenizer ../shared/data/llama_tokenizer.model --new-tokens 512
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from nakta_model.config import preset
from nakta_model.fp8 import Precision
from nakta_model.generation import GenerationRequest, Generator
from nakta_model.io_utils import atomic_write_text
from nakta_model.loading import load, random_model
from nakta_model.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent
DEFAULT_OUT = ROOT / "results" / "kv_cache_accuracy.json"
# (model dtype, KV cache): the truth is fp32 / fp32
VARIANTS = ((torch.bfloat16, "bf16"), (torch.bfloat16, "fp8"), (torch.float32, "fp8"))
PROMPTS = ("Once upon a time", "Lily and Ben went to the park.", "The little dog was sad")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, action="append", default=[],
                   help="checkpoint folder (repeatable)")  # fmt: skip
    p.add_argument("--preset", default=None, help="random weights of this shape (with --layers)")
    p.add_argument("--layers", type=int, default=None, help="--preset: its first N layers")
    p.add_argument("--tokenizer", type=Path, default=None, help="--preset: tokenizer file")
    p.add_argument("--hellaswag", type=Path, required=True, help="HellaSwag jsonl (ctx, endings)")
    p.add_argument("--contexts", type=int, default=8, help="context windows (default 8)")
    p.add_argument("--context-len", type=int, default=400, help="tokens a window (default 400)")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="greedy tokens a prompt (default: to the model's context)")  # fmt: skip
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = p.parse_args(argv)
    if a.contexts < 1 or a.context_len < 2:
        p.error("--contexts must be >= 1 and --context-len >= 2")
    if a.new_tokens is not None and a.new_tokens < 1:
        p.error("--new-tokens must be >= 1")
    if a.preset is None and (a.layers is not None or a.tokenizer is not None):
        p.error("--layers and --tokenizer go with --preset")
    if not a.checkpoint and a.preset is None:
        p.error("give at least one --checkpoint or a --preset")
    if a.preset is not None:
        if a.layers is None or a.layers < 1 or a.tokenizer is None:
            p.error("--preset needs --layers N (>= 1) and --tokenizer PATH")
        try:
            preset(a.preset)
        except ValueError as e:
            p.error(f"--preset: {e}")
    for path in [*a.checkpoint, a.hellaswag, *([a.tokenizer] if a.tokenizer else [])]:
        if not path.exists():
            p.error(f"no such path {path}")
    return a


# a model source: (name, tokenizer, make(dtype, kv) -> model)
Source = tuple[str, object, Callable[[torch.dtype, str], object]]


def checkpoint_source(path: Path) -> Source:
    def make(dtype: torch.dtype, kv: str):
        return load(path, "cpu", dtype, kernels="reference", quant=Precision.parse(None, kv))

    return path.name, load_tokenizer(path), make


def random_source(name: str, layers: int, tokenizer: Path, max_seq_len: int) -> Source:
    """Seeded random bf16 weights at ``name``'s shape, ``layers`` deep; every variant (the fp32
    truth too) holds those very weights, upcast where the model is fp32."""
    tok = load_tokenizer(tokenizer)
    args = preset(name).replace(n_layers=layers, max_seq_len=max_seq_len, vocab_size=tok.n_words)
    base = random_model(args, "cpu", torch.bfloat16, seed=0, kernels="reference")

    def make(dtype: torch.dtype, kv: str):
        model = copy.deepcopy(base).to(dtype)
        model.set_kv_cache(kv)
        return model

    return f"{name}-random-{layers}of{preset(name).n_layers}layers", tok, make


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


def greedy(model, tok, kv: str, new_tokens: int | None = None) -> list[list[int]]:
    """Greedy tokens from each of ``PROMPTS``: ``new_tokens`` each, at most to the context."""
    n_ctx = model.args.max_seq_len
    prompts = [tok.encode(p, bos=True, eos=False) for p in PROMPTS]
    gen = Generator(model, max_batch=len(prompts), max_seq_len=n_ctx, graphs=False, kv_cache=kv)
    reqs = [GenerationRequest(p, min(new_tokens or n_ctx, n_ctx - len(p))) for p in prompts]
    return [r.tokens for r in gen.generate(reqs)]


def measure(source: Source, a: argparse.Namespace) -> tuple[list[dict], list[dict], int]:
    """One model's ``accuracy`` and ``greedy`` rows and its window length."""
    name, tok, make = source
    truth_model = make(torch.float32, "bf16")  # "bf16": the model's own dtype, fp32 here
    length = min(a.context_len, truth_model.args.max_seq_len)
    ctx = windows(tok, a.hellaswag, a.contexts, length)
    truth = cached_logits(truth_model, ctx)
    truth_greedy = greedy(truth_model, tok, "bf16", a.new_tokens)
    del truth_model
    accuracy, greedy_rows = [], []
    for dtype, kv in VARIANTS:
        model = make(dtype, kv)
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
        for prompt, want, got in zip(PROMPTS, truth_greedy, greedy(model, tok, kv, a.new_tokens)):
            same = [x == y for x, y in zip(want, got)]
            first = same.index(False) if False in same else len(same)
            greedy_rows.append({
                "model": name, "dtype": dname, "kv": kv, "prompt": prompt,
                "new_tokens": len(got), "equal_to_fp32": sum(same),
                "first_divergence": first,
            })  # fmt: skip
        print(f"{name} {dname} model, {kv} KV: {accuracy[-1]}", file=sys.stderr)
    return accuracy, greedy_rows, int(ctx.shape[1])


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    torch.manual_seed(0)
    t0 = time.time()
    sources = [checkpoint_source(path) for path in a.checkpoint]
    if a.preset is not None:
        context = max(a.context_len, 16 + (a.new_tokens or 0))
        sources.append(random_source(a.preset, a.layers, a.tokenizer, context))
    accuracy, greedy_rows, lengths = [], [], {}
    for source in sources:
        acc, gr, lengths[source[0]] = measure(source, a)
        accuracy += acc
        greedy_rows += gr
    result = {
        "models": list(lengths),
        "truth": "fp32 model (the same weights), fp32 KV cache",
        "contexts": {"windows": a.contexts, "tokens": lengths, "text": "HellaSwag"},
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
