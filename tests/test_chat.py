"""Chat formats against their references: Meta's ``ChatFormat`` (llama-models) for a Llama-3
tokenizer, transformers' ``apply_chat_template`` for HF folders (Llama-3 and Mistral templates,
in tokenizer_config.json or chat_template.jinja)."""

from __future__ import annotations

import pytest
from tokenizer_assets import (
    LLAMA3_TEMPLATE,
    LLAMA_SP,
    MISTRAL_TEMPLATE,
    hf_from_sentencepiece,
    hf_llama3_folder,
    meta_llama3_file,
    mistral_sp,
    set_chat_template,
)

from nakta_model.chat import chat_format, encode_chat, render_chat
from nakta_model.tokenizer import load_tokenizer

DIALOGS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 2?"},
    ],
    [
        {"role": "user", "content": "  Name a llama 🦙 \n"},
        {"role": "assistant", "content": "Kuzco."},
        {"role": "user", "content": "\nAnother, with <|eot_id|> in it?"},
    ],
    [
        {"role": "user", "content": "\n\n\nstarts with line breaks"},
        {"role": "assistant", "content": " \n"},
        {"role": "user", "content": "\n"},
    ],
    [{"role": "user", "content": ""}],
]
ALTERNATING = [d for d in DIALOGS if d[0]["role"] == "user"]  # what Mistral's template takes


@pytest.fixture(scope="module")
def meta_tok():
    return load_tokenizer(meta_llama3_file())


@pytest.fixture(scope="module")
def hf_llama3(tmp_path_factory):
    return hf_llama3_folder(tmp_path_factory.mktemp("hf_llama3"), LLAMA3_TEMPLATE)


def _raw(dialog):
    from llama_models.datatypes import RawMessage

    return [RawMessage(role=m["role"], content=m["content"]) for m in dialog]


@pytest.mark.parametrize("dialog", DIALOGS)
def test_meta_dialog_equals_meta_chat_format(meta_tok, dialog):
    pytest.importorskip("PIL")  # llama_models' chat_format imports it
    from llama_models.llama3.chat_format import ChatFormat
    from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer

    ref = ChatFormat(MetaTokenizer(meta_llama3_file()))
    want = ref.encode_dialog_prompt(_raw(dialog)).tokens
    assert chat_format(meta_tok) == "llama3"
    assert encode_chat(meta_tok, dialog) == want
    assert meta_tok.decode(want) == render_chat(meta_tok, dialog)
    if "<|" not in str(dialog):  # the rendering reads back to Meta's ids (what lm-eval encodes)
        assert meta_tok.encode_special(render_chat(meta_tok, dialog)) == want


def test_meta_dialog_continuing_the_final_message(meta_tok):
    dialog = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I"}]
    ids = encode_chat(meta_tok, dialog, add_generation_prompt=False)
    assert ids[-1] != meta_tok.token_id("<|eot_id|>")
    assert meta_tok.decode(ids).endswith(
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello, I"
    )
    assert render_chat(meta_tok, dialog, add_generation_prompt=False) == meta_tok.decode(ids)


def _hf_check(folder, dialogs):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(folder))
    tok = load_tokenizer(folder)
    assert chat_format(tok) == "template"
    for dialog in dialogs:
        text = ref.apply_chat_template(dialog, tokenize=False, add_generation_prompt=True)
        assert render_chat(tok, dialog) == text
        ids = ref.apply_chat_template(dialog, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert encode_chat(tok, dialog) == list(ids)
        if dialog[-1]["role"] == "assistant" or len(dialog) == 1:
            try:
                cont = ref.apply_chat_template(
                    dialog, tokenize=False, add_generation_prompt=False, continue_final_message=True
                )
            except ValueError:  # the template rewrites the final message: refused alike
                with pytest.raises(ValueError, match="drops part of the final message"):
                    render_chat(tok, dialog, add_generation_prompt=False)
                continue
            assert render_chat(tok, dialog, add_generation_prompt=False) == cont


def test_hf_llama3_template_equals_transformers(hf_llama3):
    _hf_check(hf_llama3, [d for d in DIALOGS if d[-1]["content"]])


@pytest.mark.parametrize("version", ["v1", "v3"])
def test_hf_mistral_template_equals_transformers(version, tmp_path):
    folder = hf_from_sentencepiece(mistral_sp(version), tmp_path / version, MISTRAL_TEMPLATE)
    _hf_check(folder, ALTERNATING)
    set_chat_template(folder, MISTRAL_TEMPLATE, as_file=True)  # transformers >= 4.43's file
    _hf_check(folder, ALTERNATING[:1])


def test_hf_template_errors_are_value_errors(tmp_path):
    folder = hf_from_sentencepiece(mistral_sp("v1"), tmp_path / "m", MISTRAL_TEMPLATE)
    tok = load_tokenizer(folder)
    with pytest.raises(ValueError, match="Conversation roles must alternate"):
        encode_chat(tok, [{"role": "assistant", "content": "x"}])


def test_no_chat_format_and_bad_messages(meta_tok):
    if not LLAMA_SP.is_file():
        pytest.skip(f"{LLAMA_SP} is missing")
    sp = load_tokenizer(LLAMA_SP)
    assert chat_format(sp) is None
    with pytest.raises(ValueError, match=r"llama_tokenizer.model has no chat format"):
        encode_chat(sp, DIALOGS[0])
    with pytest.raises(ValueError, match="messages is empty"):
        encode_chat(meta_tok, [])
    with pytest.raises(TypeError, match="messages must be a list of dicts, got str"):
        encode_chat(meta_tok, "hi")
    with pytest.raises(ValueError, match=r"messages\[0\] needs a str 'role' and a str 'content'"):
        encode_chat(meta_tok, [{"role": "user"}])
    with pytest.raises(ValueError, match=r"messages\[0\] has role 'bot'"):
        encode_chat(meta_tok, [{"role": "bot", "content": "x"}])


# what transformers gives a template beyond the messages: tools / documents as None, its tojson
# (no HTML escaping, non-ASCII kept), namespace, strftime_now, trim_blocks / lstrip_blocks
FEATURES_TEMPLATE = """{{ bos_token }}{% if tools is not none %}TOOLS{% endif %}
{% if documents is defined and documents is not none %}DOCS{% endif %}
{% set ns = namespace(n=0) %}
{% for m in messages %}
    {% set ns.n = ns.n + 1 %}
    {{ m['role'] }}: {{ m['content'] | tojson }}{% if loop.last %} [{{ ns.n }}]{% endif %}

{% endfor %}
{{ strftime_now('%Y') }}{% if add_generation_prompt %}<|start_header_id|>{% endif %}"""


def test_hf_template_features_equal_transformers(hf_llama3):
    import shutil

    folder = hf_llama3.parent / "features"
    shutil.copytree(hf_llama3, folder, dirs_exist_ok=True)
    set_chat_template(folder, FEATURES_TEMPLATE)
    dialogs = [*DIALOGS[:3], [{"role": "user", "content": '<b>&"quotes" ünï</b>'}]]
    _hf_check(folder, dialogs)


def test_the_server_encodes_a_chat_in_the_checkpoints_format(meta_tok):
    """nakta-serve's /v1/chat/completions prompt: the checkpoint's chat format when it has one
    (Meta's ids here), the plain ``role: content`` fallback for a base model's tokenizer."""
    from nakta_model.serve.chat import chat_prompt, plain_chat_text

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert chat_prompt(meta_tok, messages) == encode_chat(meta_tok, messages)
    if not LLAMA_SP.is_file():
        pytest.skip(f"{LLAMA_SP} is missing")
    sp = load_tokenizer(LLAMA_SP)
    assert chat_prompt(sp, messages) == sp.encode(plain_chat_text(messages), bos=True, eos=False)
