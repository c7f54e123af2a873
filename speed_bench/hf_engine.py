"""``hf`` engine: HF transformers' ``LlamaForCausalLM`` with SDPA attention, same weights.

The peer most people would reach for. Built on the device from the shared Meta weights
(q/k rows permuted to HF's rotate-half layout, as HF's own conversion script does), run on
right-padded batches without a mask (causal attention makes right padding harmless), logits
for every position, scored through ``score_with_forward`` like ``llama_org``. Skipped with a
reason when ``transformers`` is not installed. One process only (no multi-GPU form).

The engine only; ``hf_speed.py`` is the command that times it (``run_all`` with these
engines).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from nakta_model.config import ModelArgs
from nakta_model.layout import meta_to_hf_name, permute_for_hf
from speed_bench.engine_api import Engine, EngineConfig
from speed_bench.weights import StateDict, WeightSource
from speed_bench.workload import Request


def unavailable_reason() -> str | None:
    """Why the HF engine cannot run here, or None."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not installed (pip install 'nakta[hf]')"
    return None


def meta_to_hf(meta: StateDict, args: ModelArgs) -> StateDict:
    """Meta names -> HF ``LlamaForCausalLM`` names; q/k rows permuted for rotate-half RoPE.

    Consumes ``meta`` (entries are popped) so the two never coexist beyond one tensor.
    """
    out: StateDict = {}
    for name in list(meta):
        w = meta.pop(name)
        if name.endswith("attention.wq.weight"):
            w = permute_for_hf(w, args.n_heads)
        elif name.endswith("attention.wk.weight"):
            w = permute_for_hf(w, args.n_kv_heads)
        out[meta_to_hf_name(name)] = w
    return out


def hf_config(args: ModelArgs, max_length: int):
    """The transformers config of ``args`` (:meth:`ModelArgs.to_hf_config`: Llama, Llama-3.1's
    RoPE scaling included, or Mistral with its window) with SDPA attention; the head stays a
    weight of its own (the random weights give every preset one)."""
    from transformers import AutoConfig

    cfg = args.replace(
        tie_word_embeddings=False, max_seq_len=max(args.max_seq_len, max_length)
    ).to_hf_config()
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg, attn_implementation="sdpa")


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Tensors created inside are ``dtype`` by default (HF builds its modules that way)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def hf_model(weights: WeightSource, device, dtype: torch.dtype, max_length: int):
    """HF's ``LlamaForCausalLM`` (SDPA attention) holding ``weights``, built on ``device`` in
    ``dtype`` and filled by assignment, in eval mode: every HF engine's model."""
    from transformers import AutoModelForCausalLM

    with torch.device(device), default_dtype(dtype):  # Llama, or Mistral with a window
        model = AutoModelForCausalLM.from_config(hf_config(weights.args, max_length))
    if model.config._attn_implementation != "sdpa":
        raise RuntimeError(f"HF picked attention {model.config._attn_implementation!r}")
    state = meta_to_hf(weights.state_dict(device, dtype), weights.args)
    model.load_state_dict(state, strict=True, assign=True)
    del state
    return model.eval().requires_grad_(False)


class HFEngine(Engine):
    name = "hf"

    def __init__(self, weights: WeightSource, cfg: EngineConfig):
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        self.cfg = cfg
        self.model = hf_model(weights, cfg.device, cfg.dtype, cfg.max_length)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, use_cache=False).logits

    def score(self, requests: Sequence[Request]) -> list[tuple[float, bool]]:
        return self.score_plain(self.forward, requests, self.cfg, self.model.config.vocab_size)

    def close(self) -> None:
        self.model = None
