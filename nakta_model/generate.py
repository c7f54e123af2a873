"""Text generation from the command line: a prompt in, text streamed out, tokens/s at the end.

    python -m nakta_model.generate --checkpoint CKPT --prompt "Once upon a time"
    nakta-generate --checkpoint CKPT --prompts-file prompts.txt --temperature 0   # batched
    nakta-generate --checkpoint CKPT --interactive                                # a prompt a line
    nakta-generate --checkpoint CKPT --chat --interactive    # a conversation, in the chat format
    torchrun --nproc_per_node 2 -m nakta_model.generate --checkpoint CKPT --prompt "..."  # tp 2

CKPT is a Nakta (``convert.py``), Meta or HF folder, read by ``nakta_model.load``; the tokenizer
is the checkpoint's own (``tokenizer.json`` or ``tokenizer.model``, read by
``nakta_model.tokenizer.load_tokenizer``) unless ``--tokenizer`` names one. Text goes to
stdout as it is decoded (several prompts: in order, each streamed once those before it are
done); the timing line (tokens/s, time to first token) goes to stderr. Under ``torchrun`` the
model is split over every process (tp = world size) and only rank 0 prints. Sampling defaults
are Meta's example's (temperature 0.6, top-p 0.9); ``--temperature 0`` is greedy, token for
token what llama_org's loop gives. ``--chat`` wraps each prompt in the checkpoint's chat format
(Meta's Llama-3 dialog format, or an HF folder's ``chat_template``; ``--system`` adds a system
message) and prints the reply only; with ``--interactive`` the conversation carries on from
line to line. Generation stops at any of the tokenizer's stop ids (Llama-3: ``<|eot_id|>``,
``<|eom_id|>`` and ``<|end_of_text|>``). Every bad argument or input is one ``error:`` line,
exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING

if not __package__:  # run by path: import from the repo root, not from this script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from nakta_model.cli import (
    InputError,
    OneLineArgumentParser,
    checked_on_every_rank,
    checkpoint_errors,
    checkpoint_tokenizer_path,
    exit_on_input_error,
    require_checkpoint,
    require_file,
)

if TYPE_CHECKING:
    from nakta_model.loading import CheckpointDir

_DTYPES = ("bf16", "fp16", "fp32")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineArgumentParser(prog="nakta-generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="Nakta, Meta or HF checkpoint folder")
    p.add_argument(
        "--tokenizer",
        help="tokenizer.model (SentencePiece or Llama-3 tiktoken) or HF tokenizer.json "
        "(default: the checkpoint's own)",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    src.add_argument("--prompts-file", help="a text file, one prompt a line, generated batched")
    src.add_argument("--interactive", action="store_true", help="read prompts from stdin")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.6, help="0: greedy")
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--top-k", type=int, default=0, help="0: no cut")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="each prompt is a user message in the checkpoint's chat format (Meta's Llama-3 "
        "dialog format or the HF folder's chat_template); --interactive keeps the conversation",
    )
    p.add_argument("--system", help="a system message first (with --chat)")
    p.add_argument("--dtype", choices=_DTYPES, help="default: bf16 on a GPU, fp32 on the CPU")
    p.add_argument("--device", help="cpu | cuda | cuda:N (default: cuda when present)")
    p.add_argument(
        "--quant", choices=["fp8"],
        help="fp8: e4m3 block matrices (needed for an FP8 checkpoint; a GPU of compute "
        "capability >= 8.9)",
    )  # fmt: skip
    p.add_argument(
        "--kv-cache", choices=["bf16", "fp8"], default="bf16",
        help="the KV cache's dtype: bf16 (the model's dtype) or fp8 (e4m3 K/V with a scale per "
        "token and KV head: twice the positions in the same memory; a GPU of capability >= 8.9)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="sampling seed (every rank the same)")
    p.add_argument(
        "--warmup", type=int, help="untimed runs first (default: 1 on a GPU: compile, capture)"
    )
    a = p.parse_args(argv)
    if a.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    if a.warmup is not None and a.warmup < 0:
        p.error(f"--warmup must be >= 0, got {a.warmup}")
    try:
        from nakta_model.generation.sampling import SamplingParams

        a.sampling = SamplingParams(a.temperature, a.top_k, a.top_p)
    except ValueError as e:
        p.error(str(e).replace("temperature", "--temperature").replace("top_", "--top-"))
    if any(not s for s in a.stop):
        p.error("--stop needs a non-empty string")
    if a.system is not None and not a.chat:
        p.error("--system goes with --chat")
    from nakta_model.fp8 import Precision

    a.precision = Precision.parse(a.quant, a.kv_cache)  # parsed once here: passed down
    return a


def read_prompts(a: argparse.Namespace) -> list[str]:
    """The prompts of ``--prompt`` or ``--prompts-file`` (one a line, blank lines skipped)."""
    if a.prompt is not None:
        return a.prompt
    if a.prompts_file is None:
        return []
    f = require_file(a.prompts_file, "--prompts-file", "a text file, one prompt a line")
    try:
        lines = f.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--prompts-file {f}: cannot read it as UTF-8 text ({e})") from e
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise InputError(f"--prompts-file {f}: no prompt in it (one a line)")
    return prompts


def check_inputs(a: argparse.Namespace) -> tuple[CheckpointDir, Path, list[str]]:
    """Every path and the tokenizer checked before the weights are read: ``(checkpoint opened,
    tokenizer, prompts)``; the tokenizer's ids must fit the checkpoint's vocabulary. The
    checkpoint's settings are read here, once: the load reads only its weights."""
    from nakta_model.chat import chat_format
    from nakta_model.loading import CheckpointDir
    from nakta_model.tokenizer import TokenizerError, check_fits_vocab, load_tokenizer

    require_checkpoint(a.checkpoint)
    with checkpoint_errors(a.checkpoint):
        opened = CheckpointDir.open(a.checkpoint)
    args = opened.args
    tok_path = checkpoint_tokenizer_path(a.checkpoint, a.tokenizer, vocab_size=args.vocab_size)
    try:
        tok = load_tokenizer(tok_path)
        check_fits_vocab(tok, args.vocab_size, a.checkpoint)
    except TokenizerError as e:
        raise InputError(f"--tokenizer {tok_path}: {e.reason}") from e
    except ValueError as e:
        raise InputError(str(e)) from e
    if a.chat and chat_format(tok) is None:
        raise InputError(
            f"--chat: tokenizer {tok_path} has no chat format (a Meta Llama-3 tokenizer.model, "
            "or a HF folder with a chat_template)"
        )
    return opened, tok_path, read_prompts(a)


def main(argv: list[str] | None = None) -> list[dict] | None:
    """The command; returns, on rank 0, every generation (``prompt``, ``text``, ``tokens``,
    ``finish``) in prompt order."""
    a = parse_args(argv)
    from nakta_model.parallel import ParallelContext, launch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        return launch(lambda parallel: _run(a, parallel), world, 1, device=a.device)
    device = exit_on_input_error(_device, a.device)
    return exit_on_input_error(_run, a, ParallelContext(device=device))


def _device(name: str | None):
    """The one process's device: ``--device``, else CUDA when present, else the CPU."""
    import torch

    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as e:
        raise InputError(f"--device {name}: {e}") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"--device {name}: CUDA is not available here")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise InputError(f"--device {name}: expected cpu, cuda or cuda:N")
    return device


def _run(a, parallel) -> list[dict] | None:
    import torch

    from nakta_model.generation.console import GenerationSession, dtype_name
    from nakta_model.loading import load
    from nakta_model.tokenizer import load_tokenizer

    opened, tok_path, prompts = checked_on_every_rank(check_inputs, a)
    device = parallel.device
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        a.dtype or ("bf16" if device.type == "cuda" else "fp32")
    ]
    if parallel.is_leader:
        tp = f", tp={parallel.tp_size}" if parallel.tp_size > 1 else ""
        print(
            f"loading {a.checkpoint} ({dtype_name(dtype)}, {device}{tp})",
            file=sys.stderr,
            flush=True,
        )
    try:  # the device's verdict, before the weights are read
        a.precision.check_device(device)
    except ValueError as e:
        flag = "--kv-cache fp8" if "kv_cache" in str(e) else f"--quant {a.quant}"
        raise InputError(f"{flag}: {e}") from None
    with checkpoint_errors(a.checkpoint):
        model = load(opened, device, dtype, parallel, quant=a.precision)
    session = GenerationSession(a, model, load_tokenizer(tok_path), parallel)
    if a.interactive:
        session.interactive()
        return None
    return session.run(prompts)


class _CallableModule(types.ModuleType):
    """``nakta_model.generate`` is also the package's Meta-loop function
    (``nakta_model.generate(model, tokenizer, prompts, max_gen_len)``); importing this module
    under that name replaces the package attribute, so the module forwards calls to it."""

    def __call__(self, *args, **kwargs):
        from nakta_model.generation.meta_loop import generate

        return generate(*args, **kwargs)


if __name__ == "__main__":
    main()
else:
    sys.modules[__name__].__class__ = _CallableModule
