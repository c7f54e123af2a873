"""Real tokenizer files for the tokenizer and chat tests, from installed packages (no download):
Meta's Llama-3 ``tokenizer.model`` (``llama-models``), Mistral's SentencePiece models
(``mistral-common``), and HF folders transformers converts from them. A missing package or
file skips the test that asked for it."""

from __future__ import annotations

import atexit
import functools
import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
LLAMA_SP = DATA / "llama_tokenizer.model"
MISTRAL_SP = {"v1": "tokenizer.model.v1", "v3": "mistral_instruct_tokenizer_240323.model.v3"}

# Meta-Llama-3-8B-Instruct's chat_template (tokenizer_config.json)
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# Mistral-7B-Instruct-v0.1's chat_template
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}"
)


def package_file(package: str, *parts: str) -> Path:
    """A file shipped inside an installed package; skips when either is missing."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        pytest.skip(f"{package} is not installed")
    path = Path(spec.origin).parent.joinpath(*parts)
    if not path.is_file():
        pytest.skip(f"{package} ships no {'/'.join(parts)}")
    return path


def meta_llama3_file() -> Path:
    return package_file("llama_models", "llama3", "tokenizer.model")


def mistral_sp(version: str) -> Path:
    return package_file("mistral_common", "data", MISTRAL_SP[version])


def hf_llama3_folder(out: Path, chat_template: str | None = None) -> Path:
    """A HF Llama-3.1-style tokenizer folder as transformers converts Meta's file: BOS added
    by the post-processor, eos ``<|eot_id|>``, generation_config's three stop ids. The
    conversion (the 128K-token BPE merges, seconds of CPU) runs once per test process; each
    call gets its own copy of the files in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    for f in _converted_hf_llama3().iterdir():
        shutil.copyfile(f, out / f.name)
    if chat_template is not None:
        set_chat_template(out, chat_template)
    return out


@functools.cache
def _converted_hf_llama3() -> Path:
    pytest.importorskip("transformers")
    from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    meta_file = meta_llama3_file()
    meta = MetaTokenizer(meta_file)
    specials = sorted(meta.special_tokens, key=meta.special_tokens.get)
    converted = TikTokenConverter(
        vocab_file=str(meta_file), pattern=meta.pat_str, extra_special_tokens=specials
    ).converted()
    bos = "<|begin_of_text|>"
    converted.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, meta.bos_id)]
    )
    out = Path(tempfile.mkdtemp(prefix="nakta-hf-llama3-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    PreTrainedTokenizerFast(
        tokenizer_object=converted, bos_token=bos, eos_token="<|eot_id|>"
    ).save_pretrained(out)
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]})
    )
    return out


def hf_from_sentencepiece(sp_model: Path, out: Path, chat_template: str | None = None) -> Path:
    """A HF folder (tokenizer.json only) converted by transformers from a SentencePiece model,
    the way HF's Llama-2 / Mistral folders were made."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(sp_model, out / "tokenizer.model")
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": True,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    AutoTokenizer.from_pretrained(str(out)).save_pretrained(str(out))
    (out / "tokenizer.model").unlink()  # only tokenizer.json left: what is checked is HF's
    assert (out / "tokenizer.json").is_file()
    if chat_template is not None:
        set_chat_template(out, chat_template)
    return out


def set_chat_template(folder: Path, template: str, as_file: bool = False) -> None:
    """``template`` in tokenizer_config.json, or (``as_file``) in chat_template.jinja."""
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    if as_file:
        (folder / "chat_template.jinja").write_text(template)
    else:
        (folder / "chat_template.jinja").unlink(missing_ok=True)
        config["chat_template"] = template
    config_path.write_text(json.dumps(config))
