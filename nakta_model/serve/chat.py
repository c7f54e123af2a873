"""Chat messages -> prompt token ids: the ONE place the server turns a conversation into a
prompt, so the checkpoint's own chat format can be plugged in here.

When the tokenizer offers ``encode_chat(messages) -> list[int]`` (a checkpoint whose format is
known: Llama-2 ``[INST]``, Llama-3 headers, ...), that is used. Otherwise a plain fallback for
base models with no chat format: each message as ``role: content`` on its own line, then
``assistant:`` for the reply, encoded with BOS.
"""

from __future__ import annotations

__all__ = ["chat_prompt", "plain_chat_text"]


def plain_chat_text(messages: list[dict]) -> str:
    """The fallback's text: ``role: content`` lines and an open ``assistant:`` turn."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines + ["assistant:"])


def chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the prompt that asks the model for the next assistant message."""
    own = getattr(tokenizer, "encode_chat", None)
    if callable(own):
        return list(own(messages))
    return tokenizer.encode(plain_chat_text(messages), bos=True, eos=False)
