"""llama_org: the reference LLaMA as Meta wrote it (fairscale model-parallel layers).

Nakta is checked against this package; it never imports ``nakta_model`` (and vice versa).
"""

from llama_org.generation import Llama, sample_top_p
from llama_org.model import ModelArgs, Transformer
from llama_org.tokenizer import Tokenizer

__all__ = ["Llama", "ModelArgs", "Tokenizer", "Transformer", "sample_top_p"]
