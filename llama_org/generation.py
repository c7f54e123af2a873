"""Meta's ``Llama`` entry point: build from a checkpoint folder, generate, complete text.

``Llama.build`` follows Meta's: initialize torch.distributed and fairscale model parallel,
require world size == number of ``consolidated.*.pth`` shards, let each rank load its own shard
into a model constructed directly in the target dtype on the target device. The generation loop
is LLaMA-1's (pad with the pad id, start at the shortest prompt, keep prompt tokens, cut at EOS)
in Llama-2's token-level API (``generate(prompt_tokens, ...)``, ``text_completion``), which also
stops early once every row has produced EOS (same output, fewer steps).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TypedDict

import fairscale.nn.model_parallel.initialize as fs_init
import torch
import torch.nn.functional as F

from llama_org.distributed import (
    default_tensor_type,
    init_distributed,
    init_model_parallel,
    resolve_device,
    resolve_dtype,
)
from llama_org.model import ModelArgs, Transformer
from llama_org.tokenizer import Tokenizer

# Keys Meta's checkpoints carry that are not parameters of the model (LLaMA-1: the RoPE table).
_IGNORED_CHECKPOINT_KEYS = {"rope.freqs"}
_MODEL_ARG_FIELDS = set(ModelArgs.__dataclass_fields__)


class CompletionPrediction(TypedDict, total=False):
    generation: str
    tokens: list[str]
    logprobs: list[float]


def find_shards(ckpt_dir: str | os.PathLike) -> list[Path]:
    """The ``consolidated.NN.pth`` files of a Meta checkpoint folder, in rank order."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"ckpt_dir {str(ckpt_dir)!r} is not a directory")
    shards = sorted(ckpt_dir.glob("consolidated.*.pth"))
    if not shards:
        raise FileNotFoundError(f"no consolidated.*.pth checkpoint files found in {ckpt_dir}")
    return shards


def read_params(ckpt_dir: str | os.PathLike) -> dict:
    path = Path(ckpt_dir) / "params.json"
    if not path.is_file():
        raise FileNotFoundError(f"params.json not found in checkpoint folder {ckpt_dir}")
    return json.loads(path.read_text())


def model_args_from_params(
    params: dict, max_seq_len: int, max_batch_size: int, vocab_size: int | None
) -> ModelArgs:
    """``params.json`` -> ModelArgs; the caller's cache sizes win over any stored in the file."""
    params = {k: v for k, v in params.items() if k not in ("max_seq_len", "max_batch_size")}
    unknown = set(params) - _MODEL_ARG_FIELDS
    if unknown:
        raise ValueError(
            f"params.json has keys the LLaMA-1/2 model does not know: {sorted(unknown)}"
        )
    args = ModelArgs(max_seq_len=max_seq_len, max_batch_size=max_batch_size, **params)
    if vocab_size is not None:  # Meta: model_args.vocab_size = tokenizer.n_words
        if args.vocab_size > 0 and args.vocab_size != vocab_size:
            raise ValueError(
                f"params.json vocab_size={args.vocab_size} but the tokenizer has {vocab_size} words"
            )
        args.vocab_size = vocab_size
    return args


def load_shard_into(model: Transformer, state_dict: dict) -> None:
    """``load_state_dict(strict=False)`` as Meta, but a missing weight is an error, not silence."""
    result = model.load_state_dict(state_dict, strict=False)
    unexpected = set(result.unexpected_keys) - _IGNORED_CHECKPOINT_KEYS
    if result.missing_keys or unexpected:
        raise ValueError(
            f"checkpoint does not match the model: missing {sorted(result.missing_keys)}, "
            f"unexpected {sorted(unexpected)}"
        )


class Llama:
    @staticmethod
    def build(
        ckpt_dir: str | os.PathLike,
        tokenizer_path: str | os.PathLike,
        max_seq_len: int,
        max_batch_size: int,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        seed: int = 1,
    ) -> Llama:
        """Load a Meta checkpoint folder; run under ``torchrun --nproc_per_node <n shards>``."""
        start_time = time.time()
        shards = find_shards(ckpt_dir)
        params = read_params(ckpt_dir)
        tokenizer = Tokenizer(model_path=tokenizer_path)
        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device)

        world_size = init_distributed(device)
        if world_size != len(shards):
            raise ValueError(
                f"Loading a checkpoint for MP={len(shards)} ({len(shards)} consolidated.*.pth "
                f"files in {ckpt_dir}) but world size is {world_size}: run it with "
                f"`torchrun --nproc_per_node {len(shards)}`"
            )
        init_model_parallel(world_size)
        # seed must be the same in all processes (sampling is replicated on every rank)
        torch.manual_seed(seed)

        checkpoint = torch.load(
            shards[fs_init.get_model_parallel_rank()], map_location="cpu", weights_only=True
        )
        model_args = model_args_from_params(
            params, max_seq_len, max_batch_size, vocab_size=tokenizer.n_words
        )
        model = _construct(model_args, device, dtype)
        load_shard_into(model, checkpoint)
        if fs_init.get_model_parallel_rank() == 0 and os.environ.get("LLAMA_ORG_QUIET") != "1":
            print(f"Loaded in {time.time() - start_time:.2f} seconds")
        return Llama(model, tokenizer)

    @staticmethod
    def from_state_dict(
        params: dict,
        state_dict: dict | None,
        max_seq_len: int,
        max_batch_size: int,
        tokenizer: Tokenizer | str | os.PathLike | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        seed: int = 1,
    ) -> Llama:
        """The reference from weights in memory, no files written (benchmarks, tests).

        ``state_dict`` is this rank's shard with Meta's key names (with one process: the whole
        checkpoint). ``None`` fills the weights with seeded random values on the device
        (matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norms = 1), e.g. a random 7B for a
        speed benchmark. Without a tokenizer, ``params['vocab_size']`` must be set and only
        token-level methods (``model``, ``generate``) work.
        """
        if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
            tokenizer = Tokenizer(model_path=tokenizer)
        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device)
        world_size = init_distributed(device)
        init_model_parallel(world_size)
        torch.manual_seed(seed)
        model_args = model_args_from_params(
            params,
            max_seq_len,
            max_batch_size,
            vocab_size=tokenizer.n_words if tokenizer is not None else None,
        )
        model = _construct(model_args, device, dtype)
        if state_dict is None:
            _random_init_(model, seed + fs_init.get_model_parallel_rank())
        else:
            load_shard_into(model, state_dict)
        return Llama(model, tokenizer)

    def __init__(self, model: Transformer, tokenizer: Tokenizer | None):
        self.model = model
        self.tokenizer = tokenizer

    @torch.inference_mode()
    def generate(
        self,
        prompt_tokens: list[list[int]],
        max_gen_len: int,
        temperature: float = 0.6,
        top_p: float = 0.9,
        logprobs: bool = False,
        echo: bool = False,
        eos_id: int | None = None,
        pad_id: int | None = None,
    ) -> tuple[list[list[int]], list[list[float]] | None]:
        """Greedy when ``temperature == 0``, else top-p sampling; returns (tokens, logprobs).

        ``eos_id`` / ``pad_id`` default to the tokenizer's (pass them when built without one).
        """
        params = self.model.params
        eos_id, pad_id = self._special_ids(eos_id, pad_id)
        bsz = len(prompt_tokens)
        if bsz < 1 or bsz > params.max_batch_size:
            raise ValueError(
                f"prompt_tokens has {bsz} prompts, expected 1..{params.max_batch_size}"
            )
        if any(len(t) == 0 for t in prompt_tokens):
            raise ValueError("prompt_tokens: every prompt needs at least one token (e.g. BOS)")
        if max_gen_len < 0:
            raise ValueError(f"max_gen_len must be >= 0, got {max_gen_len}")

        min_prompt_len = min(len(t) for t in prompt_tokens)
        max_prompt_len = max(len(t) for t in prompt_tokens)
        if max_prompt_len > params.max_seq_len:
            raise ValueError(
                f"longest prompt has {max_prompt_len} tokens > max_seq_len={params.max_seq_len}"
            )
        total_len = min(params.max_seq_len, max_gen_len + max_prompt_len)
        device = self._device()

        tokens = torch.full((bsz, total_len), pad_id, dtype=torch.long, device=device)
        for k, t in enumerate(prompt_tokens):
            tokens[k, : len(t)] = torch.tensor(t, dtype=torch.long, device=device)
        if logprobs:
            token_logprobs = torch.zeros_like(tokens, dtype=torch.float)

        prev_pos = 0
        eos_reached = torch.tensor([False] * bsz, device=device)
        input_text_mask = tokens != pad_id
        if min_prompt_len == total_len and logprobs:
            logits = self.model.forward(tokens, prev_pos)
            token_logprobs = -F.cross_entropy(
                input=logits.transpose(1, 2), target=tokens, reduction="none", ignore_index=pad_id
            )

        for cur_pos in range(min_prompt_len, total_len):
            logits = self.model.forward(tokens[:, prev_pos:cur_pos], prev_pos)
            if temperature > 0:
                probs = torch.softmax(logits[:, -1] / temperature, dim=-1)
                next_token = sample_top_p(probs, top_p)
            else:
                next_token = torch.argmax(logits[:, -1], dim=-1)

            next_token = next_token.reshape(-1)
            # only replace token if prompt has already been generated
            next_token = torch.where(input_text_mask[:, cur_pos], tokens[:, cur_pos], next_token)
            tokens[:, cur_pos] = next_token
            if logprobs:
                token_logprobs[:, prev_pos + 1 : cur_pos + 1] = -F.cross_entropy(
                    input=logits.transpose(1, 2),
                    target=tokens[:, prev_pos + 1 : cur_pos + 1],
                    reduction="none",
                    ignore_index=pad_id,
                )
            eos_reached |= (~input_text_mask[:, cur_pos]) & (next_token == eos_id)
            prev_pos = cur_pos
            if all(eos_reached):
                break

        if logprobs:
            token_logprobs = token_logprobs.tolist()
        out_tokens, out_logprobs = [], []
        for i, toks in enumerate(tokens.tolist()):
            # cut to max gen len
            start = 0 if echo else len(prompt_tokens[i])
            toks = toks[start : len(prompt_tokens[i]) + max_gen_len]
            probs = None
            if logprobs:
                probs = token_logprobs[i][start : len(prompt_tokens[i]) + max_gen_len]
            # cut to eos tok if any
            if eos_id in toks:
                eos_idx = toks.index(eos_id)
                toks = toks[:eos_idx]
                probs = probs[:eos_idx] if logprobs else None
            out_tokens.append(toks)
            out_logprobs.append(probs)
        return out_tokens, (out_logprobs if logprobs else None)

    def text_completion(
        self,
        prompts: list[str],
        temperature: float = 0.6,
        top_p: float = 0.9,
        max_gen_len: int | None = None,
        logprobs: bool = False,
        echo: bool = False,
    ) -> list[CompletionPrediction]:
        """Complete each prompt (BOS added); ``max_gen_len`` defaults to ``max_seq_len - 1``."""
        if self.tokenizer is None:
            raise ValueError("text_completion needs a tokenizer; this Llama was built without one")
        if max_gen_len is None:
            max_gen_len = self.model.params.max_seq_len - 1
        prompt_tokens = [self.tokenizer.encode(x, bos=True, eos=False) for x in prompts]
        generation_tokens, generation_logprobs = self.generate(
            prompt_tokens=prompt_tokens,
            max_gen_len=max_gen_len,
            temperature=temperature,
            top_p=top_p,
            logprobs=logprobs,
            echo=echo,
        )
        if logprobs:
            return [
                {
                    "generation": self.tokenizer.decode(t),
                    "tokens": [self.tokenizer.decode([x]) for x in t],
                    "logprobs": logprobs_i,
                }
                for t, logprobs_i in zip(generation_tokens, generation_logprobs)
            ]
        return [{"generation": self.tokenizer.decode(t)} for t in generation_tokens]

    def _special_ids(self, eos_id: int | None, pad_id: int | None) -> tuple[int, int]:
        if self.tokenizer is not None:
            eos_id = self.tokenizer.eos_id if eos_id is None else eos_id
            pad_id = self.tokenizer.pad_id if pad_id is None else pad_id
        if eos_id is None or pad_id is None:
            raise ValueError("generate without a tokenizer needs eos_id and pad_id")
        return eos_id, pad_id

    def _device(self) -> torch.device:
        return self.model.tok_embeddings.weight.device


def sample_top_p(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Top-p (nucleus) sampling: keep the smallest set of tokens whose mass reaches ``p``."""
    probs_sort, probs_idx = torch.sort(probs, dim=-1, descending=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    mask = probs_sum - probs_sort > p
    probs_sort[mask] = 0.0
    probs_sort.div_(probs_sort.sum(dim=-1, keepdim=True))
    next_token = torch.multinomial(probs_sort, num_samples=1)
    next_token = torch.gather(probs_idx, -1, next_token)
    return next_token


def _construct(args: ModelArgs, device: torch.device, dtype: torch.dtype) -> Transformer:
    """Meta's construction in the default dtype/device, then global defaults restored."""
    with default_tensor_type(device, dtype):
        model = Transformer(args)
    # fairscale's weights follow the legacy default tensor type; off CUDA they are on the CPU.
    model.to(device)
    return model.eval()


@torch.no_grad()
def _random_init_(model: Transformer, seed: int) -> None:
    """Seeded random weights generated on the model's device (fast even for 7B on a GPU)."""
    device = model.tok_embeddings.weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim == 1:
            p.fill_(1.0)
        elif name == "tok_embeddings.weight":
            p.normal_(0.0, 1.0, generator=gen)
        else:
            module = model.get_submodule(name.rsplit(".", 1)[0])
            p.normal_(0.0, module.in_features**-0.5, generator=gen)
