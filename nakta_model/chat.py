"""A checkpoint's chat format: a dialog (``[{"role": ..., "content": ...}, ...]``) to prompt ids.

Two formats, picked from the tokenizer:

* Meta's Llama-3 dialog format for a Meta tiktoken tokenizer, token for token as
  ``llama_models/llama3/chat_format.py`` encodes a dialog: ``<|begin_of_text|>``, then per
  message ``<|start_header_id|>role<|end_header_id|>`` + ``"\\n\\n"`` + content + ``<|eot_id|>``
  (each part encoded on its own), then the assistant's header;
* an HF folder's ``chat_template`` (jinja), rendered as transformers' ``apply_chat_template``
  renders it (a sandboxed environment with ``trim_blocks`` / ``lstrip_blocks``, the
  ``loopcontrols`` extension, its ``tojson`` / ``raise_exception`` / ``strftime_now``, and the
  tokenizer's ``bos_token`` / ``eos_token`` ...), then encoded with its special tokens read.

:func:`render_chat` gives the text (what lm-eval's ``apply_chat_template`` returns);
:func:`encode_chat` the ids (what ``nakta-generate --chat`` feeds the model).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from nakta_model.tokenizer import TokenizerBase

__all__ = ["chat_format", "check_messages", "encode_chat", "render_chat"]

META_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "tool": "ipython"}
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for continue_final_message


def chat_format(tokenizer: TokenizerBase) -> str | None:
    """``"llama3"`` (Meta's dialog format), ``"template"`` (an HF chat_template) or None."""
    if tokenizer.kind == "tiktoken":
        return "llama3"
    if tokenizer.chat_template:
        return "template"
    return None


def _require_format(tokenizer: TokenizerBase) -> str:
    fmt = chat_format(tokenizer)
    if fmt is None:
        raise ValueError(
            f"tokenizer {tokenizer.path} has no chat format (a Meta Llama-3 tokenizer.model, or a "
            "HF folder whose tokenizer_config.json or chat_template.jinja holds a chat_template)"
        )
    return fmt


def check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as a list of dicts, each with a str ``role`` and a str ``content``."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] needs a str 'role' and a str 'content', got {m!r}")
        out.append(dict(m))
    if not out:
        raise ValueError("messages is empty: a chat needs at least one message")
    return out


def _meta_role(role: str, i: int) -> str:
    if role not in META_ROLES:
        raise ValueError(
            f"messages[{i}] has role {role!r}; Meta's Llama-3 format has {sorted(META_ROLES)}"
        )
    return META_ROLES[role]


# ------------------------------------------------------------------------------- Meta's format


def _meta_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    sp = tokenizer.special_tokens

    def header(role: str) -> list[int]:
        return [
            sp["<|start_header_id|>"],
            *tokenizer.encode(role, bos=False, eos=False),
            sp["<|end_header_id|>"],
            *tokenizer.encode("\n\n", bos=False, eos=False),
        ]

    ids = [sp["<|begin_of_text|>"]]
    for i, m in enumerate(messages):
        ids += header(_meta_role(m["role"], i))
        ids += tokenizer.encode(m["content"], bos=False, eos=False)
        last_open = not add_generation_prompt and i == len(messages) - 1
        if not last_open:  # continuing the final message: no end of turn after it
            ids.append(sp["<|eot_id|>"])
    if add_generation_prompt:
        ids += header("assistant")
    return ids


def _meta_text(messages: list[dict], add_generation_prompt: bool) -> str:
    parts = ["<|begin_of_text|>"]
    for i, m in enumerate(messages):
        role = _meta_role(m["role"], i)
        parts.append(f"<|start_header_id|>{role}<|end_header_id|>\n\n{m['content']}")
        if add_generation_prompt or i < len(messages) - 1:
            parts.append("<|eot_id|>")
    if add_generation_prompt:
        parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)


# ------------------------------------------------------------------------------ HF templates


@lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' own tojson: jinja's escapes HTML characters
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def _template_text(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    """transformers' ``apply_chat_template(..., tokenize=False)``; ``add_generation_prompt``
    False continues the final message (lm-eval passes ``continue_final_message=not
    add_generation_prompt``): the text ends right after its content."""
    import jinja2

    messages = [dict(m) for m in messages]
    if not add_generation_prompt:
        final = messages[-1]["content"]
        messages[-1]["content"] = final + _CONTINUE_TAG
    try:
        text = _compile(tokenizer.chat_template).render(
            messages=messages,
            tools=None,  # given as None, as transformers does: `tools is not none` is False
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **tokenizer.template_tokens,
        )
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat_template of {tokenizer.path}: {e}") from e
    if not add_generation_prompt:
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise ValueError(
                f"chat_template of {tokenizer.path} drops part of the final message: "
                "it cannot be continued"
            )
        at = text.rindex(tag)
        kept_spacing = text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG
        text = text[:at] if kept_spacing else text[:at].rstrip()
    return text


# ------------------------------------------------------------------------------------ public


def render_chat(
    tokenizer: TokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
) -> str:
    """The dialog as the prompt text the checkpoint's chat format makes (its special tokens as
    text); ``add_generation_prompt`` False leaves the final message open, to be continued."""
    fmt = _require_format(tokenizer)
    messages = check_messages(messages)
    if fmt == "llama3":
        return _meta_text(messages, add_generation_prompt)
    return _template_text(tokenizer, messages, add_generation_prompt)


def encode_chat(
    tokenizer: TokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
) -> list[int]:
    """The dialog's prompt ids: Meta's ``ChatFormat.encode_dialog_prompt`` for a Llama-3
    tokenizer (each part encoded on its own, as Meta does), else the HF template's text
    encoded as transformers' ``apply_chat_template(tokenize=True)`` does (no BOS added: the
    template writes it)."""
    fmt = _require_format(tokenizer)
    messages = check_messages(messages)
    if fmt == "llama3":
        return _meta_ids(tokenizer, messages, add_generation_prompt)
    return tokenizer.encode_special(_template_text(tokenizer, messages, add_generation_prompt))
