"""The weights the lm-eval speed benches run on: an HF LLaMA directory (given, or random at a
preset's shape), the same sentencepiece tokenizer for ``hf`` (checked to agree) and the Nakta
copy made by ``convert.py`` (timed)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from speed_bench.lm_eval_children import REPO, child_env, run_logged

__all__ = [
    "DTYPES",
    "UsageError",
    "Weights",
    "convert",
    "make_random_hf",
    "prepare_weights",
    "preset_args",
    "resolve_device",
    "status_of",
    "write_hf_tokenizer",
]

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # ours -> torch/HF names


class UsageError(ValueError):
    """A bad command line or input file: one ``error:`` line, exit code 2."""


def status_of(run: Callable[[], int]) -> int:
    """``run()``'s exit status; a :class:`UsageError` is its ``error:`` line and status 2
    (the drivers' ``main``)."""
    try:
        return run()
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def resolve_device(a) -> None:
    """``a.device`` (default: cuda when there is one) and ``a.dtype`` (default: bf16 on cuda,
    fp32 on the CPU) of a driver's arguments; a cuda device without CUDA is a UsageError."""
    import torch

    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {a.device}: CUDA is not available")
    a.dtype = a.dtype or ("bf16" if a.device.startswith("cuda") else "fp32")


@dataclasses.dataclass(frozen=True)
class Weights:
    hf_dir: Path
    hf_tokenizer: Path
    nakta_dir: Path
    sp_model: Path


def preset_args(name: str, vocab_size: int, max_seq_len: int):
    """The preset's shape with the tokenizer's vocabulary (a 512-piece tokenizer on ``tiny``)."""
    from nakta_model.config import preset

    try:
        args = preset(name)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return dataclasses.replace(args, vocab_size=vocab_size, max_seq_len=max_seq_len)


def make_random_hf(
    out: Path, args, dtype_name: str, device: str, seed: int, bos_eos: tuple[int, int] = (1, 2)
) -> None:
    """The preset's HF model (Llama, or Mistral with a sliding window: ``hf_config``) with seeded
    random weights, saved as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM

    from speed_bench.hf_speed import default_dtype, hf_config

    config = hf_config(args, args.max_seq_len)
    config.bos_token_id, config.eos_token_id = bos_eos  # the tokenizer's
    torch.manual_seed(seed)
    dtype = getattr(torch, DTYPES[dtype_name])
    with torch.device(device), default_dtype(dtype):
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)  # safetensors (transformers' default since 4.35)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def write_hf_tokenizer(out: Path, sp_model: str | Path, max_seq_len: int) -> Path:
    """``tokenizer.model`` + a ``tokenizer_config.json`` that ``AutoTokenizer`` converts; for
    Meta's Llama-3 tiktoken file, the ``tokenizer.json`` of an HF Llama-3 folder."""
    from nakta_model.tokenizer import load_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    if load_tokenizer(sp_model).kind == "tiktoken":
        return _write_hf_llama3_tokenizer(out, sp_model, max_seq_len)
    shutil.copyfile(sp_model, out / "tokenizer.model")
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": max_seq_len,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _write_hf_llama3_tokenizer(out: Path, tiktoken_file: str | Path, max_seq_len: int) -> Path:
    """An HF Llama-3 (base) tokenizer folder from Meta's file, as transformers converts it:
    Meta's regex and special tokens, BOS added by the post-processor, EOS <|end_of_text|>."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from nakta_model.tokenizer import LLAMA3_PATTERN, load_tokenizer

    tok = load_tokenizer(tiktoken_file)
    specials = sorted(tok.special_tokens, key=tok.special_tokens.get)
    converted = TikTokenConverter(
        vocab_file=str(tiktoken_file), pattern=LLAMA3_PATTERN, extra_special_tokens=specials
    ).converted()
    bos = "<|begin_of_text|>"
    converted.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.bos_id)]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=converted,
        bos_token=bos,
        eos_token="<|end_of_text|>",
        model_max_length=max_seq_len,
    ).save_pretrained(str(out))
    return out


def check_tokenizers_agree(hf_tokenizer: Path, sp_model: str | Path, texts: Sequence[str]) -> None:
    """hf and nakta must score the same tokens, or the comparison means nothing. The converted
    fast tokenizer is saved (``tokenizer.json``) so that hf's runs load it as a real HF
    checkpoint's would, instead of converting the sentencepiece model again in every run."""
    from transformers import AutoTokenizer

    from nakta_model.tokenizer import load_tokenizer

    hf = AutoTokenizer.from_pretrained(str(hf_tokenizer))
    hf.save_pretrained(str(hf_tokenizer))
    sp = load_tokenizer(sp_model)
    for text in texts:
        want = sp.encode(text, bos=True, eos=False)
        got = hf.encode(text)
        if got != want:
            raise UsageError(
                f"AutoTokenizer({hf_tokenizer}) and {sp_model} disagree on {text[:60]!r}: "
                f"{got[:12]} vs {want[:12]}"
            )


def hf_vocab_size(hf_dir: str | Path) -> int:
    return int(json.loads((Path(hf_dir) / "config.json").read_text())["vocab_size"])


def convert(hf_dir: Path, out: Path, dtype_name: str, log: Path, tp: int = 1) -> float:
    """``python convert.py HF OUT --dtype DTYPE [--tp TP]`` as a child process; its seconds."""
    cmd = [sys.executable, str(REPO / "convert.py"), str(hf_dir), str(out)]
    cmd += ["--dtype", dtype_name, "--quiet"] + (["--tp", str(tp)] if tp > 1 else [])
    t0 = time.perf_counter()
    rc = run_logged(cmd, child_env({}), log, timeout=None)
    if rc != 0:
        raise RuntimeError(f"convert.py failed with exit code {rc}; see {log}")
    return time.perf_counter() - t0


def _sample_texts(data: str, n: int = 40) -> list[str]:
    from nakta_model.tasks import hellaswag

    docs = hellaswag.load(data, limit=n)
    return [d.query + " " + c for d in docs for c in d.choices]


def prepare_weights(
    a: argparse.Namespace, work: Path, out: Path, texts: Sequence[str] | None = None
) -> tuple[Weights, dict]:
    """The HF directory (given or made), its tokenizer dir and the converted Nakta copy; the
    two tokenizers are checked to agree on ``texts`` (default: HellaSwag's from ``a.data``)."""
    from nakta_model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(a.tokenizer)
    n_words = tokenizer.n_words
    meta: dict = {"make_hf_s": None}
    if a.reuse_work:  # an earlier run's checkpoints (checked by _check_inputs)
        hf_dir = work / "hf"
        if hf_vocab_size(hf_dir) != n_words:
            raise UsageError(f"--reuse-work: {hf_dir} does not match --tokenizer {a.tokenizer}")
        meta.update(weights=f"{a.preset}-random-seed{a.seed}" if a.preset else hf_dir.name)
        meta.update(convert_s=None, reused_work=str(work))
        sp = Path(a.tokenizer).resolve()
        return Weights(hf_dir, work / "hf_tokenizer", work / "nakta", sp), meta
    if a.hf:
        hf_dir = Path(a.hf).resolve()
        if hf_vocab_size(hf_dir) != n_words:
            raise UsageError(
                f"--hf {a.hf} has vocab_size {hf_vocab_size(hf_dir)} but --tokenizer "
                f"{a.tokenizer} has {n_words} pieces"
            )
        meta["weights"] = hf_dir.name
    else:
        args = preset_args(a.preset, n_words, a.max_seq_len)
        hf_dir = work / "hf"
        t0 = time.perf_counter()
        make_random_hf(
            hf_dir, args, a.dtype, a.device, a.seed, (tokenizer.bos_id, tokenizer.eos_id)
        )
        write_hf_tokenizer(hf_dir, a.tokenizer, args.max_seq_len)
        meta["make_hf_s"] = time.perf_counter() - t0
        meta["weights"] = f"{a.preset}-random-seed{a.seed}"
        meta["vocab_size"] = n_words
    hf_tok = write_hf_tokenizer(work / "hf_tokenizer", a.tokenizer, a.max_seq_len)
    check_tokenizers_agree(hf_tok, a.tokenizer, texts or _sample_texts(a.data))
    nakta_dir = work / "nakta"
    meta["convert_s"] = convert(hf_dir, nakta_dir, a.dtype, out / "logs" / "convert.log")
    sp = Path(a.tokenizer).resolve()
    return Weights(hf_dir, hf_tok, nakta_dir, sp), meta
