"""``python -m nakta_model.generate`` (``nakta-generate``) on the real stories260K checkpoint.

Greedy text equals llama_org's (Meta's example CLI on the same folder) and the pinned NumPy
reference, from the Meta folder, its Nakta conversion and a HF folder of the same weights;
text streams in pieces that add up to the result; a batch from a file gives each prompt what it
gets alone; every bad argument or input is one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import importlib
import io
import json
import re
import sys

import pytest
import tomllib
import torch
from checkpoint_formats import FORMATS, broken_nakta, in_format
from cli_helpers import REPO, run_script, torchrun

import nakta_model
from nakta_model.generation.console import GenerationSession
from nakta_model.generation.engine import Generator
from nakta_model.generation.sampling import SamplingParams
from nakta_model.generation.streaming import TextStream, generate_streaming
from nakta_model.loading import load
from nakta_model.parallel import ParallelContext
from nakta_model.tokenizer import Tokenizer

generate_cli = importlib.import_module("nakta_model.generate")  # the package's `generate` is
# its Meta-loop function: the CLI module is reached by its full name

PROMPT = "Once upon a time"
GREEDY = ["--temperature", "0", "--device", "cpu"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def stories(shared_data):
    return shared_data / "stories260K"


@pytest.fixture
def reference(shared_data) -> dict:
    return json.loads((shared_data / "stories260K_greedy_reference.json").read_text())


def _generate(argv, capsys) -> tuple[list[dict], str, str]:
    out = generate_cli.main(argv)
    captured = capsys.readouterr()
    return out, captured.out, captured.err


def test_greedy_text_equals_llama_org(stories, reference, capsys):
    from llama_org.distributed import shutdown
    from llama_org.example_text_completion import main as llama_org_main

    argv = ["--ckpt_dir", str(stories), "--tokenizer_path", str(stories / "tokenizer.model")]
    argv += ["--prompt", PROMPT, "--temperature", "0", "--max_gen_len", "30", "--device", "cpu"]
    try:
        (llama_text,) = llama_org_main(argv)
    finally:
        shutdown()
    capsys.readouterr()
    (result,), out, err = _generate(
        ["--checkpoint", str(stories), "--prompt", PROMPT, "--max-new-tokens", "30", *GREEDY],
        capsys,
    )
    assert result["tokens"] == reference["tokens"][5:35]  # BOS + 4 prompt tokens first
    assert result["text"].lstrip() == llama_text
    assert out == PROMPT + result["text"] + "\n"  # the continuation keeps its leading space
    assert result["finish"] == "length"
    (timing,) = [line for line in err.splitlines() if "tokens/s" in line]
    assert re.search(r"30 tokens in [\d.]+ s: [\d.]+ tokens/s, time to first token \d+ ms", timing)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_checkpoint_format_gives_the_reference_tokens(fmt, stories, reference, tmp_path):
    """One argument for all three formats; the tokenizer is the checkpoint's own."""
    ckpt = in_format(stories, fmt, tmp_path)
    (result,) = generate_cli.main(
        ["--checkpoint", str(ckpt), "--prompt", "", "--max-new-tokens", "40", *GREEDY]
    )
    assert result["tokens"] == reference["tokens"][1:41]


def _session(stories, **settings) -> GenerationSession:
    a = generate_cli.parse_args(["--checkpoint", str(stories), "--prompt", "x", *GREEDY])
    for k, v in settings.items():
        setattr(a, k, v)
    model = load(stories, "cpu", torch.float32)
    return GenerationSession(a, model, Tokenizer(stories / "tokenizer.model"), ParallelContext())


def test_text_streams_in_pieces_that_add_up(stories):
    model = load(stories, "cpu", torch.float32)
    tok = Tokenizer(stories / "tokenizer.model")
    gen = Generator(model, max_batch=2, max_seq_len=128, chunk=4)
    streams = [TextStream(tok, tok.encode(p, bos=True, eos=False)) for p in (PROMPT, "Lily")]
    requests = [s.request(40, SamplingParams(), (tok.eos_id,)) for s in streams]
    pieces: dict[int, list[str]] = {0: [], 1: []}
    finishes = []

    def write(i, piece, finish):
        pieces[i].append(piece)
        if finish:
            finishes.append(i)

    results, timing = generate_streaming(gen, streams, requests, write)
    assert sorted(finishes) == [0, 1]
    for i, (p, r) in enumerate(zip((PROMPT, "Lily"), results)):
        assert len([x for x in pieces[i] if x]) >= 5  # chunks of 4 tokens, not one blob
        text = "".join(pieces[i])
        assert text == streams[i].shown
        assert p + text == tok.decode(tok.encode(p, bos=True, eos=False) + r.tokens)
    assert timing.generated_tokens == sum(len(r.tokens) for r in results)
    assert 0 < timing.first_token_s < timing.total_s


def test_a_stop_string_is_never_printed(stories, capsys):
    """The streamed text ends before the stop string, even when a piece ended inside it."""
    (plain,), _, _ = _generate(
        ["--checkpoint", str(stories), "--prompt", PROMPT, "--max-new-tokens", "60", *GREEDY],
        capsys,
    )
    stop = "Lily. She"
    assert stop in plain["text"]
    (cut,), out, _ = _generate(
        ["--checkpoint", str(stories), "--prompt", PROMPT, "--max-new-tokens", "60"]
        + ["--stop", stop, "--stop", "never there", *GREEDY],
        capsys,
    )
    assert cut["text"] == plain["text"][: plain["text"].index(stop)]
    assert cut["finish"] == "stop" and out == PROMPT + cut["text"] + "\n"


def test_stream_holds_back_a_possible_stop_prefix():
    class Chars:  # a tokenizer whose tokens are characters
        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    s = TextStream(Chars(), [ord("a")], stops=["xyz"])
    assert s.update([ord("b"), ord("x")], False) == "b"  # "x" may start the stop
    assert s.update([ord("b"), ord("x"), ord("q")], False) == "xq"
    assert s.update([ord(c) for c in "bxqxy"], False) == ""
    assert s.update([ord(c) for c in "bxqxyz"], False) == ""  # the stop: cut, nothing shown
    assert s.shown == "bxq"


def test_a_batch_from_a_file_gives_each_prompt_its_own_greedy_text(stories, tmp_path, capsys):
    prompts = ["Lily and Tom", PROMPT, "The little dog ran to the park because"]
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join([prompts[0], "", *prompts[1:]]) + "\n")
    alone = [
        generate_cli.main(
            ["--checkpoint", str(stories), "--prompt", p, "--max-new-tokens", "24", *GREEDY]
        )[0]
        for p in prompts
    ]
    capsys.readouterr()
    batch, out, err = _generate(
        ["--checkpoint", str(stories), "--prompts-file", str(f), "--max-new-tokens", "24"] + GREEDY,
        capsys,
    )
    assert [r["tokens"] for r in batch] == [r["tokens"] for r in alone]
    assert out == "".join(r["prompt"] + r["text"] + "\n\n" for r in batch)
    assert "[3 prompt(s)" in err


def test_interactive_reads_a_prompt_per_line(stories, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{PROMPT}\n\nLily\n"))
    out = generate_cli.main(
        ["--checkpoint", str(stories), "--interactive", "--max-new-tokens", "8", *GREEDY]
    )
    captured = capsys.readouterr()
    assert out is None
    lines = captured.out.splitlines()
    assert len(lines) == 2 and lines[0].startswith(PROMPT) and lines[1].startswith("Lily")
    assert captured.err.count("tokens/s") == 2


def test_interactive_goes_on_after_a_line_too_long(stories, monkeypatch, capsys):
    """One line past max_seq_len is an error line; the session reads the next one."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("Lily " * 600 + "\nLily\n"))
    out = generate_cli.main(
        ["--checkpoint", str(stories), "--interactive", "--max-new-tokens", "8", *GREEDY]
    )
    captured = capsys.readouterr()
    assert out is None and captured.out.startswith("Lily")
    assert re.search(r"error: prompt 1 has \d+ tokens; the model's max_seq_len", captured.err)
    assert captured.err.count("tokens/s") == 1


def test_max_new_tokens_cut_by_the_context_is_one_warning_line(stories, capsys):
    """A prompt that leaves fewer positions than --max-new-tokens: a warning naming both
    numbers, and generation stops at the context's end."""
    tok = Tokenizer(str(stories / "tokenizer.model"))
    limit = nakta_model.loading.checkpoint_args(stories).max_seq_len
    prompt = "Lily " * 505
    n_prompt = len(tok.encode(prompt, bos=True, eos=False))
    room = limit - n_prompt
    assert 0 < room < 12, (n_prompt, limit)  # the prompt leaves less than --max-new-tokens
    (result,), _, err = _generate(
        ["--checkpoint", str(stories), "--prompt", prompt, "--max-new-tokens", "12", *GREEDY],
        capsys,
    )
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert warnings == [
        f"warning: prompt 1 has {n_prompt} tokens and the model's max_seq_len is {limit}: "
        f"at most {room} new tokens, not --max-new-tokens 12"
    ]
    assert len(result["tokens"]) <= room


def test_an_fp8_checkpoint_generates_with_quant_fp8(stories, tmp_path, capsys):
    """An FP8 checkpoint is refused without ``--quant fp8`` (the error names the flag) and
    generates with it (the CPU runs FP8 under the interpreter, as the tests do)."""
    import convert

    ckpt = convert.convert(stories, tmp_path / "fp8", quiet=True, quant="fp8")
    argv = ["--checkpoint", str(ckpt), "--prompt", PROMPT, "--max-new-tokens", "6", *GREEDY]
    with pytest.raises(SystemExit) as exc:
        generate_cli.main(argv)
    assert exc.value.code == 2 and "--quant fp8" in capsys.readouterr().err
    out = generate_cli.main([*argv, "--quant", "fp8"])
    assert len(out[0]["tokens"]) == 6 and out[0]["finish"] == "length"


def test_sampling_is_seeded(stories):
    argv = ["--checkpoint", str(stories), "--prompt", PROMPT, "--max-new-tokens", "30"]
    argv += ["--device", "cpu", "--temperature", "1.0", "--top-k", "50"]
    a = generate_cli.main([*argv, "--seed", "1"])[0]["tokens"]
    assert generate_cli.main([*argv, "--seed", "1"])[0]["tokens"] == a
    assert generate_cli.main([*argv, "--seed", "2"])[0]["tokens"] != a


def _bad_cases(stories, tmp_path) -> dict[str, tuple[list[str], str]]:
    nakta = in_format(stories, "nakta", tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    garbage = tmp_path / "garbage.model"
    garbage.write_text("not a model")
    ok = ["--checkpoint", str(stories), "--prompt", "x"]
    return {
        "checkpoint-missing": (
            ["--checkpoint", str(tmp_path / "nope"), "--prompt", "x"],
            r"--checkpoint .*nope: no such directory",
        ),
        "not-a-checkpoint": (
            ["--checkpoint", str(tmp_path), "--prompt", "x"],
            r"--checkpoint .*: not a checkpoint, no params.json or config.json in it",
        ),
        "truncated-shard": (
            ["--checkpoint", str(broken_nakta(nakta, "truncated", tmp_path)), "--prompt", "x"],
            r"--checkpoint .*-truncated: cannot load it: CheckpointError: .*truncated\?",
        ),
        "corrupted-shard": (
            ["--checkpoint", str(broken_nakta(nakta, "corrupted", tmp_path)), "--prompt", "x"],
            r"--checkpoint .*-corrupted: cannot load it: .*sampled sha256 differs",
        ),
        "tokenizer-missing": ([*ok, "--tokenizer", str(tmp_path / "t")], r"--tokenizer .*t: no"),
        "tokenizer-garbage": ([*ok, "--tokenizer", str(garbage)], r"not a SentencePiece model"),
        "no-prompt": (["--checkpoint", str(stories)], r"one of the arguments --prompt"),
        "prompts-file-empty": (
            ["--checkpoint", str(stories), "--prompts-file", str(empty)],
            r"--prompts-file .*empty.txt: no prompt in it",
        ),
        "temperature": ([*ok, "--temperature", "-1"], r"--temperature must be a finite number"),
        "top-p": ([*ok, "--top-p", "0"], r"--top-p must be in \(0, 1\]"),
        "top-k": ([*ok, "--top-k", "-2"], r"--top-k must be an int >= 0"),
        "max-new-tokens": ([*ok, "--max-new-tokens", "0"], r"--max-new-tokens must be >= 1"),
        "not-a-number": ([*ok, "--max-new-tokens", "many"], r"invalid int value: 'many'"),
        "dtype": ([*ok, "--dtype", "int8"], r"argument --dtype: invalid choice"),
        "device": ([*ok, "--device", "tpu"], r"--device tpu: "),
        "prompt-too-long": (
            ["--checkpoint", str(stories), "--prompt", "Lily " * 600],
            r"prompt 1 has \d+ tokens; the model's max_seq_len 512 leaves no room",
        ),
    }


CASES = [
    "checkpoint-missing", "not-a-checkpoint", "truncated-shard", "corrupted-shard",
    "tokenizer-missing", "tokenizer-garbage", "no-prompt", "prompts-file-empty", "temperature",
    "top-p", "top-k", "max-new-tokens", "not-a-number", "dtype", "device", "prompt-too-long",
]  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_every_bad_argument_is_one_error_line(case, stories, tmp_path, capsys):
    argv, pattern = _bad_cases(stories, tmp_path)[case]
    with pytest.raises(SystemExit) as exc:
        generate_cli.main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert lines[-1].startswith("error: ") and re.search(pattern, lines[-1]), captured.err
    assert [line for line in lines if not line.startswith("loading ")] == lines[-1:]
    assert captured.out == ""


def test_runs_as_a_module_and_by_path_without_a_traceback(stories):
    ok = run_script(
        ["-m", "nakta_model.generate", "--checkpoint", str(stories), "--prompt", PROMPT]
        + ["--max-new-tokens", "10", *GREEDY],
        REPO,
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith(PROMPT) and "tokens/s" in ok.stderr
    bad = run_script(["nakta_model/generate.py", "--checkpoint", "/nope", "--prompt", "x"], REPO)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "error: --checkpoint /nope: no such directory (expected a checkpoint folder: Nakta "
        "(convert.py's params.json + manifest.json), Meta (params.json + consolidated.*.pth) or "
        "HF (config.json + weights))"
    ]


def test_the_console_script_and_the_package_function_both_stay(stories, reference):
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["nakta-generate"] == "nakta_model.generate:main"
    # importing the CLI module must not hide nakta_model.generate(model, tok, prompts, n)
    model = load(stories, "cpu", torch.float32)
    tok = Tokenizer(stories / "tokenizer.model")
    (text,) = nakta_model.generate(model, tok, [""], max_gen_len=20)
    assert text == tok.decode(reference["tokens"][1:21])


@pytest.mark.slow
def test_under_torchrun_tp2_rank0_prints_the_same_text(stories, reference):
    rc, output = torchrun(
        ["-m", "nakta_model.generate", "--checkpoint", str(stories), "--prompt", PROMPT]
        + ["--max-new-tokens", "30", *GREEDY],
        REPO,
    )
    assert rc == 0, output
    tok = Tokenizer(stories / "tokenizer.model")
    text = tok.decode(reference["tokens"][1:35])
    assert output.count(text) == 1, output  # rank 0 only
    assert output.count("tokens/s") == 1 and "tp=2" in output
