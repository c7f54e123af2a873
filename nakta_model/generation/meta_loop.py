"""Text generation with the KV cache: Meta's LLaMA-1 loop, token for token.

Same semantics as LLaMA-1's ``LLaMA.generate``: prompts get BOS, the batch is padded with
``pad_id`` and decoding starts at the shortest prompt, prompt tokens are kept where a row is
still inside its prompt, output is cut to ``prompt + max_gen_len`` and at the first EOS, and the
decoded text includes the prompt. Greedy (``temperature == 0``) therefore reproduces
``llama_org`` exactly on the same weights; top-p sampling follows Meta's ``sample_top_p``.
The loop stops early once every row has produced EOS (same output, fewer steps).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["generate", "generate_tokens", "sample_top_p"]


def sample_top_p(
    probs: torch.Tensor, p: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Nucleus sampling: keep the smallest prefix of sorted tokens whose mass reaches ``p``."""
    probs_sort, probs_idx = torch.sort(probs, dim=-1, descending=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    probs_sort[probs_sum - probs_sort > p] = 0.0
    probs_sort.div_(probs_sort.sum(dim=-1, keepdim=True))
    next_token = torch.multinomial(probs_sort, num_samples=1, generator=generator)
    return torch.gather(probs_idx, -1, next_token)


@torch.inference_mode()
def generate_tokens(
    model,
    prompt_tokens: Sequence[Sequence[int]],
    max_gen_len: int,
    *,
    eos_id: int,
    pad_id: int = -1,
    temperature: float = 0.0,
    top_p: float = 0.9,
    max_seq_len: int | None = None,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Prompt + generated token ids per row (cut to ``max_gen_len`` new tokens and at EOS).

    ``max_seq_len`` caps prompt + generation (default ``model.args.max_seq_len``, like Meta's
    ``params.max_seq_len``).
    """
    bsz = len(prompt_tokens)
    if bsz < 1:
        raise ValueError("prompt_tokens must hold at least one prompt")
    if any(len(t) == 0 for t in prompt_tokens):
        raise ValueError("every prompt needs at least one token (e.g. BOS)")
    if not isinstance(max_gen_len, int) or max_gen_len < 0:
        raise ValueError(f"max_gen_len must be an int >= 0, got {max_gen_len!r}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    max_seq_len = max_seq_len or model.args.max_seq_len
    min_prompt = min(len(t) for t in prompt_tokens)
    max_prompt = max(len(t) for t in prompt_tokens)
    if max_prompt > max_seq_len:
        raise ValueError(f"longest prompt has {max_prompt} tokens > max_seq_len={max_seq_len}")
    total_len = min(max_seq_len, max_gen_len + max_prompt)
    device = model.device

    tokens = torch.full((bsz, total_len), pad_id, dtype=torch.long, device=device)
    for k, t in enumerate(prompt_tokens):
        tokens[k, : len(t)] = torch.tensor(list(t), dtype=torch.long, device=device)
    input_text_mask = tokens != pad_id

    had_cache = (model.max_batch_size, model.max_seq_len)
    if model.max_batch_size < bsz or model.max_seq_len < total_len:
        model.setup_cache(max(bsz, model.max_batch_size), max(total_len, model.max_seq_len))
    try:
        eos_reached = torch.zeros(bsz, dtype=torch.bool, device=device)
        prev_pos = 0
        for cur_pos in range(min_prompt, total_len):
            logits = model.forward_last(tokens[:, prev_pos:cur_pos], prev_pos)
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                next_token = sample_top_p(probs, top_p, generator)
            else:
                next_token = torch.argmax(logits, dim=-1)
            next_token = next_token.reshape(-1)
            # only replace the token if the prompt has already been consumed
            next_token = torch.where(input_text_mask[:, cur_pos], tokens[:, cur_pos], next_token)
            tokens[:, cur_pos] = next_token
            eos_reached |= (~input_text_mask[:, cur_pos]) & (next_token == eos_id)
            prev_pos = cur_pos
            if bool(eos_reached.all()):
                break
    finally:
        if had_cache == (0, 0):
            model.clear_cache()

    out = []
    for i, t in enumerate(tokens.tolist()):
        t = t[: len(prompt_tokens[i]) + max_gen_len]
        if eos_id in t:
            t = t[: t.index(eos_id)]
        out.append(t)
    return out


def generate(
    model,
    tokenizer,
    prompts: Sequence[str],
    max_gen_len: int,
    temperature: float = 0.0,
    top_p: float = 0.9,
    *,
    max_seq_len: int | None = None,
    generator: torch.Generator | None = None,
) -> list[str]:
    """Complete each prompt (BOS added); returns prompt + completion text per prompt (LLaMA-1)."""
    if isinstance(prompts, str):
        raise TypeError("prompts must be a list of strings, not a single string")
    prompt_tokens = [tokenizer.encode(p, bos=True, eos=False) for p in prompts]
    out = generate_tokens(
        model,
        prompt_tokens,
        max_gen_len,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        temperature=temperature,
        top_p=top_p,
        max_seq_len=max_seq_len,
        generator=generator,
    )
    return [tokenizer.decode(t) for t in out]
