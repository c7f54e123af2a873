"""Chat through the commands, on a tiny random Llama-3-vocabulary checkpoint (Meta format, Meta's
real ``tokenizer.model`` beside the weights):

* ``nakta-generate --chat`` feeds the model Meta's ``ChatFormat`` ids (its greedy tokens equal
  a generation from those ids) and stops on every Llama-3 stop id;
* the lm-eval adapter's ``apply_chat_template`` / ``tok_encode`` give Meta's ids (Meta folder) and
  transformers' ``apply_chat_template`` ids (HF template), and ``nakta-lm-eval
  --apply_chat_template`` runs a local task.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys

import pytest
import torch
from checkpoint_factory import meta_state_dict
from tokenizer_assets import LLAMA3_TEMPLATE, LLAMA_SP, hf_llama3_folder, meta_llama3_file

from nakta_model.chat import encode_chat
from nakta_model.tokenizer import load_tokenizer

generate_cli = importlib.import_module("nakta_model.generate")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

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


def test_adapter_refuses_chat_without_a_chat_format(llama3_ckpt):
    if not LLAMA_SP.is_file():
        pytest.skip(f"{LLAMA_SP} is missing")
    from accuracy_test.lm_eval_args import ModelArgsError

    lm = _nakta_lm(llama3_ckpt)
    lm.tok = load_tokenizer(LLAMA_SP)  # (the vocab check would refuse it at load)
    with pytest.raises(ModelArgsError, match="--apply_chat_template: tokenizer .* no chat format"):
        lm.chat_template(True)


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
