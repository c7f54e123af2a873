"""Text generation: LLaMA-1's loop (``meta_loop``) and on-device sampling (``sampling``)."""

from nakta_model.generation.meta_loop import generate, generate_tokens, sample_top_p
from nakta_model.generation.sampling import SamplingParams, sample_next

__all__ = ["SamplingParams", "generate", "generate_tokens", "sample_next", "sample_top_p"]
