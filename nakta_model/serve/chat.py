"""Chat messages -> prompt token ids: the ONE place the server turns a conversation into a
prompt.

A checkpoint with a chat format (Meta's Llama-3 dialog format, or an HF folder's
``chat_template``) is encoded by ``nakta_model.chat.encode_chat``, token for token as the
reference does. A base model with none gets a plain fallback: each message as ``role: content``
on its own line, then ``assistant:`` for the reply, encoded with BOS.
"""

from __future__ import annotations

from nakta_model.chat import chat_format, encode_chat

__all__ = ["chat_prompt", "plain_chat_text"]


def plain_chat_text(messages: list[dict]) -> str:
    """The fallback's text: ``role: content`` lines and an open ``assistant:`` turn."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines + ["assistant:"])


def chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the prompt that asks the model for the next assistant message."""
    if chat_format(tokenizer) is not None:
        return encode_chat(tokenizer, messages)
    return tokenizer.encode(plain_chat_text(messages), bos=True, eos=False)
