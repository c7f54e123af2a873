"""Chat formats against their references: Meta's ``ChatFormat`` (llama-models) for a Llama-3
tokenizer, transformers' ``apply_chat_template`` for HF folders (Llama-3 and Mistral templates,
in tokenizer_config.json or chat_template.jinja).

Here too: chat through the commands (``nakta-generate --chat``, lm-eval's chat template), on a
tiny random Llama-3-vocabulary checkpoint.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys

import pytest
import torch
from checkpoint_factory import meta_state_dict
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


# ------------------------------------------------------------------------------------------------
# Chat through the commands, on a tiny random Llama-3-vocabulary checkpoint (Meta format, Meta's
# real ``tokenizer.model`` beside the weights):
#
# * ``nakta-generate --chat`` feeds the model Meta's ``ChatFormat`` ids (its greedy tokens equal a
# generation from those ids) and stops on every Llama-3 stop id; * the lm-eval adapter's
# ``apply_chat_template`` / ``tok_encode`` give Meta's ids (Meta folder) and transformers'
# ``apply_chat_template`` ids (HF template), and ``nakta-lm-eval --apply_chat_template`` runs a
# local task.
# ------------------------------------------------------------------------------------------------


generate_cli = importlib.import_module("nakta_model.generate")

PARAMS = {
    "dim": 16,
    "n_layers": 1,
    "n_heads": 2,
    "n_kv_heads": 1,
    "vocab_size": 128256,
    "multiple_of": 16,
    "norm_eps": 1e-5,
}
GREEDY = ["--temperature", "0", "--device", "cpu", "--max-new-tokens", "4"]
EOT, EOM, END = 128009, 128008, 128001


def _write(folder, state) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / "consolidated.00.pth")
    (folder / "params.json").write_text(json.dumps({**PARAMS, "max_seq_len": 256}))
    shutil.copyfile(meta_llama3_file(), folder / "tokenizer.model")


@pytest.fixture(scope="module")
def llama3_ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama3_tiny")
    _write(folder, meta_state_dict(PARAMS, seed=3))
    return folder


def _meta_dialog_ids(dialog) -> list[int]:
    pytest.importorskip("PIL")
    from llama_models.datatypes import RawMessage
    from llama_models.llama3.chat_format import ChatFormat
    from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer

    fmt = ChatFormat(MetaTokenizer(meta_llama3_file()))
    return fmt.encode_dialog_prompt([RawMessage(**m) for m in dialog]).tokens


@pytest.mark.usefixtures("one_torch_thread")
def test_generate_chat_feeds_metas_dialog_ids(llama3_ckpt, capsys):
    from nakta_model.generation.meta_loop import generate_tokens
    from nakta_model.loading import load

    out = generate_cli.main(
        ["--checkpoint", str(llama3_ckpt), "--chat", "--system", "Be brief.", "--prompt", "Hi!"]
        + GREEDY
    )
    ids = _meta_dialog_ids(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    )
    model = load(llama3_ckpt, "cpu", torch.float32)
    want = generate_tokens(model, [ids], 4, eos_id=-1)[0][len(ids) :]
    stops = [i for i, t in enumerate(want) if t in (EOT, EOM, END)]
    want = want[: stops[0]] if stops else want
    assert out[0]["tokens"] == want
    printed = capsys.readouterr().out
    assert printed.startswith("Hi!\n") and "<|start_header_id|>" not in printed  # reply only


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("stop", [EOT, EOM, END], ids=["eot", "eom", "end_of_text"])
def test_generation_stops_on_every_llama3_stop_id(stop, tmp_path, capsys):
    """A model that always predicts ``stop`` (residual passed through, one output row): the
    reply is empty and finished by a stop, not by the token budget."""
    state = meta_state_dict(PARAMS, seed=0)
    for key in state:
        if key.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            state[key].zero_()
    state["tok_embeddings.weight"][:] = 1.0
    state["norm.weight"][:] = 1.0
    state["output.weight"].zero_()
    state["output.weight"][stop] = 1.0
    _write(tmp_path / "ckpt", state)
    out = generate_cli.main(["--checkpoint", str(tmp_path / "ckpt"), "--prompt", "x", *GREEDY])
    assert (out[0]["tokens"], out[0]["finish"]) == ([], "stop")


@pytest.mark.usefixtures("one_torch_thread")
def test_interactive_chat_keeps_the_conversation(llama3_ckpt, monkeypatch, capsys):
    import io

    from nakta_model.generation import console

    seen = []
    real = console.encode_chat
    monkeypatch.setattr(console, "encode_chat", lambda tok, d: seen.append(d) or real(tok, d))
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\nAgain\n"))
    generate_cli.main(["--checkpoint", str(llama3_ckpt), "--chat", "--interactive", *GREEDY])
    assert [m["role"] for m in seen[-1]] == ["user", "assistant", "user"]
    assert seen[-1][0]["content"] == "Hello" and seen[-1][2]["content"] == "Again"
    assert capsys.readouterr().err.count("tokens/s") == 2


@pytest.mark.usefixtures("one_torch_thread")
def test_chat_without_a_chat_format_is_one_error_line(llama3_ckpt, tmp_path, capsys):
    if not LLAMA_SP.is_file():
        pytest.skip(f"{LLAMA_SP} is missing")
    argv = ["--checkpoint", str(llama3_ckpt), "--chat", "--prompt", "x", *GREEDY]
    with pytest.raises(SystemExit) as e:
        generate_cli.main([*argv, "--tokenizer", str(LLAMA_SP)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: --chat: tokenizer ") and "has no chat format" in err
    with pytest.raises(SystemExit):
        generate_cli.main(["--checkpoint", str(llama3_ckpt), "--system", "s", "--prompt", "x"])
    assert "error: --system goes with --chat" in capsys.readouterr().err


@pytest.mark.usefixtures("one_torch_thread")
def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, capsys):
    state = meta_state_dict({**PARAMS, "vocab_size": 32000}, seed=0)
    folder = tmp_path / "small"
    folder.mkdir()
    torch.save(state, folder / "consolidated.00.pth")
    (folder / "params.json").write_text(json.dumps({**PARAMS, "vocab_size": 32000}))
    argv = ["--checkpoint", str(folder), "--tokenizer", str(meta_llama3_file()), "--prompt", "x"]
    with pytest.raises(SystemExit):
        generate_cli.main(argv + GREEDY)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has 128256 tokens, more than the vocab_size 32000" in err


# ---------------------------------------------------------------------------------- lm-eval

DIALOG = [{"role": "system", "content": "Answer."}, {"role": "user", "content": "A cat sat"}]


def _nakta_lm(checkpoint, tokenizer=None):
    pytest.importorskip("lm_eval")
    from accuracy_test.lm_eval_adapter import NaktaLM

    return NaktaLM(checkpoint=str(checkpoint), tokenizer=tokenizer, device="cpu")


@pytest.mark.usefixtures("one_torch_thread")
def test_adapter_chat_gives_metas_ids_for_a_meta_folder(llama3_ckpt):
    lm = _nakta_lm(llama3_ckpt)
    text = lm.apply_chat_template(DIALOG)
    want = _meta_dialog_ids(DIALOG)
    assert lm.tok_encode(text) == want  # no second BOS, specials read as tokens
    assert lm._encode_many([text, "plain"], bos=True) == [want, lm.tok_encode("plain")]
    assert lm.tok_encode("plain")[0] == 128000
    assert lm.chat_template(True) == "llama3 (Meta's dialog format)"
    assert lm.chat_template(False) is None
    assert lm.tokenizer_name.endswith("tokenizer.model") and "/" not in lm.tokenizer_name
    assert lm.tok.stop_ids == (END, EOM, EOT)


@pytest.mark.usefixtures("one_torch_thread")
def test_adapter_chat_gives_transformers_ids_for_a_hf_template(llama3_ckpt, tmp_path):
    from transformers import AutoTokenizer

    hf = hf_llama3_folder(tmp_path / "hf", LLAMA3_TEMPLATE)
    lm = _nakta_lm(llama3_ckpt, str(hf / "tokenizer.json"))
    ref = AutoTokenizer.from_pretrained(str(hf))
    text = lm.apply_chat_template(DIALOG)
    assert text == ref.apply_chat_template(DIALOG, tokenize=False, add_generation_prompt=True)
    ids = ref.apply_chat_template(DIALOG, tokenize=True, add_generation_prompt=True)
    assert lm.tok_encode(text) == list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert lm.chat_template(True) == LLAMA3_TEMPLATE
    assert encode_chat(load_tokenizer(hf), DIALOG) == lm.tok_encode(text)


@pytest.mark.usefixtures("one_torch_thread")
def test_adapter_refuses_chat_without_a_chat_format(llama3_ckpt):
    if not LLAMA_SP.is_file():
        pytest.skip(f"{LLAMA_SP} is missing")
    from accuracy_test.lm_eval_args import ModelArgsError

    lm = _nakta_lm(llama3_ckpt)
    lm.tok = load_tokenizer(LLAMA_SP)  # (the vocab check would refuse it at load)
    with pytest.raises(ModelArgsError, match="--apply_chat_template: tokenizer .* no chat format"):
        lm.chat_template(True)


@pytest.mark.usefixtures("one_torch_thread")
def test_lm_eval_cli_apply_chat_template(llama3_ckpt, shared_data, monkeypatch, tmp_path):
    pytest.importorskip("lm_eval")
    import lm_eval.tasks

    from accuracy_test import lm_eval_cli

    tasks = lm_eval_cli.__file__.rsplit("/", 1)[0] + "/tasks"
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lm_eval.tasks.TaskManager)  # restored
    monkeypatch.setenv(lm_eval_cli.LOCAL_TASKS_ENV, "1")
    monkeypatch.setattr(sys, "argv", ["nakta-lm-eval"])
    monkeypatch.setenv("NAKTA_HELLASWAG_JSONL", str(shared_data / "hellaswag_val_full.jsonl"))
    out = tmp_path / "out"
    lm_eval_cli.main(
        ["--model", "nakta", "--model_args", f"checkpoint={llama3_ckpt}", "--include_path", tasks]
        + ["--tasks", "hellaswag_local", "--limit", "2", "--device", "cpu"]
        + ["--apply_chat_template", "--output_path", str(out), "--log_samples"]
    )
    samples = [json.loads(line) for f in out.rglob("samples_*.jsonl") for line in f.open()]
    assert len(samples) == 2
    context = samples[0]["arguments"]["gen_args_0"]["arg_0"]
    assert context.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n")
    assert context.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    results = next(out.rglob("results_*.json"))
    assert json.loads(results.read_text())["chat_template"] == "llama3 (Meta's dialog format)"
