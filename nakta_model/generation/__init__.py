"""Text generation.

``engine.Generator``: continuous batching with a graph-captured fused decode step (``step``),
on-device sampling (``sampling``) and stop strings (``requests.StopStrings``); its pages are
``row_pages.RowPages``; ``streaming``: text handed out as it is decoded, with the clock (time to
first token, tokens/s); ``console``: the generate command's terminal side; ``meta_loop``: LLaMA-1's loop, token for token as Meta wrote it (the
reference the engine is checked against).
"""

from nakta_model.generation.engine import (
    GenerationRequest,
    GenerationResult,
    Generator,
    greedy_requests,
)
from nakta_model.generation.meta_loop import generate, generate_tokens, sample_top_p
from nakta_model.generation.requests import StopStrings
from nakta_model.generation.sampling import SamplingParams, sample_next
from nakta_model.generation.streaming import StreamTiming, TextStream, generate_streaming

__all__ = [
    "GenerationRequest",
    "GenerationResult",
    "Generator",
    "SamplingParams",
    "StopStrings",
    "StreamTiming",
    "TextStream",
    "generate",
    "generate_streaming",
    "generate_tokens",
    "greedy_requests",
    "sample_next",
    "sample_top_p",
]
