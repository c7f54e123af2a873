"""Families parity: Nakta against each family's own reference, on tiny random models.

For every family Nakta reads (Llama-3 / 3.1 / 3.2, Llama-2, Mistral, TinyLlama) a tiny random
model with that family's architecture (GQA ratio, FFN rule, RoPE theta and scaling, tied head,
vocabulary: the real 128,256 tokens for Llama-3) is written to disk in the family's own format
(Meta's ``params.json`` + ``consolidated.NN.pth`` in Meta's split, or an HF folder), then:

* the reference reads the same folder: Meta's Llama-3 code (``llama_models.llama3.model``,
  shards merged by ``llama_models.checkpoint``), ``llama_org`` (Meta's LLaMA code) for Llama-2's
  Meta format, transformers' ``LlamaForCausalLM`` / ``MistralForCausalLM`` (eager attention);
* Nakta loads it with ``nakta_model.load``;
* ``max_abs_logit_err``: the largest |logit difference| over every position of a batch of
  sequences (past the tiny original context of the scaled-RoPE cases), against the reference in
  fp32 (the truth); ``greedy_identical``: Nakta's greedy continuation (its KV-cache decode
  path) equals the truth's (the fp32 reference, full recompute each step).

bf16 rows are judged against the fp32 truth beside the reference run in bf16, judged alike (the
markdown shows both, with mean errors; the house's contract: Nakta no further from the truth
than the reference).

Mistral's sliding window is set to 12 tokens here (Mistral-7B's is 4,096): the 40-token rows and
the 32-token greedy runs go past it, so the window is exercised on both paths.

Usage: ``python accuracy_test/families_parity.py [--out DIR] [--dtypes fp32,bf16] [--device
cuda]``, writes
``DIR/families_parity.json`` (``{"rows": [{"preset", "format", "dtype", "reference",
"max_abs_logit_err", "greedy_identical"}]}``) and ``families_parity.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run by path: the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

__all__ = ["CASES", "Case", "main", "reference_logits_fn", "run_case", "write_case"]

LLAMA3_VOCAB = 128256
_SEQ, _BATCH, _PROMPT, _GEN = 40, 2, 8, 24
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# the scaled-RoPE HF cases: an original context of 16 so that positions up to 40 pass it
_TINY_L31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 16}  # fmt: skip
_TINY_L32 = {**_TINY_L31, "factor": 32.0}


# Mistral's window in the tiny case: shorter than the 40-token rows and the 32-token decodes
MISTRAL_WINDOW = 12


@dataclasses.dataclass(frozen=True)
class Case:
    """One row's model: ``params`` in Meta's ``params.json`` names, the folder ``format``, and
    what the format adds (HF: model_type, llama3 ``rope_scaling``, tied head; Meta: the
    Llama-3 split, ``use_scaled_rope``)."""

    preset: str
    format: str  # "meta" | "hf"
    reference: str
    params: dict
    model_type: str = "llama"
    rope_scaling: dict | None = None
    rope_style: str = "v5"  # what transformers 5 writes (rope_parameters)
    tie: bool = False
    llama3_split: bool = True  # Meta: Llama-3's VocabParallelEmbedding split


def _params(**kw) -> dict:
    base = {"dim": 64, "n_layers": 2, "n_heads": 8, "n_kv_heads": 2, "multiple_of": 32,
            "ffn_dim_multiplier": 1.3, "norm_eps": 1e-5, "rope_theta": 500000.0,
            "vocab_size": LLAMA3_VOCAB}  # fmt: skip
    return {**base, **kw}


_META3 = "llama_models.llama3"
_HF_LLAMA, _HF_MISTRAL = "transformers.LlamaForCausalLM", "transformers.MistralForCausalLM"
_L2 = _params(n_kv_heads=1, multiple_of=16, rope_theta=10000.0, vocab_size=32000)
CASES: tuple[Case, ...] = (
    Case("llama3-8B", "meta", _META3, _params()),
    Case("llama3-8B", "hf", _HF_LLAMA, _params()),
    Case("llama3.1-8B", "meta", _META3, {**_params(), "use_scaled_rope": True}),
    Case("llama3.1-8B", "hf", _HF_LLAMA, _params(), rope_scaling=_TINY_L31),
    Case("llama3.2-1B", "meta", _META3, {**_params(), "use_scaled_rope": True}, tie=True),
    Case("llama3.2-1B", "hf", _HF_LLAMA, _params(), rope_scaling=_TINY_L32, tie=True),
    Case(
        "mistral-7B",
        "hf",
        _HF_MISTRAL,
        _params(rope_theta=10000.0, vocab_size=32000, ffn_dim_multiplier=None, multiple_of=16),
        model_type="mistral",
    ),  # fmt: skip
    Case("llama2-70B", "meta", "llama_org", _L2, llama3_split=False),
    Case("llama2-70B", "hf", _HF_LLAMA, _L2, rope_style="v4"),
    Case(
        "tinyllama-1.1B",
        "hf",
        _HF_LLAMA,
        _params(
            n_kv_heads=1,
            ffn_dim_multiplier=None,
            multiple_of=16,
            rope_theta=10000.0,
            vocab_size=32000,
        ),
        rope_style="v4",
    ),  # fmt: skip
)


# ------------------------------------------------------------------------------- tiny folders


def tiny_weights(case: Case, seed: int = 0) -> dict[str, torch.Tensor]:
    """Unsplit Meta-named fp32 weights: matrices ~ N(0, 1/fan_in), embedding ~ N(0, 1), norms
    1 + N(0, 0.1) (a skipped ``* weight`` shows); a tied case's head is its embedding."""
    from nakta_model.layout import meta_shapes

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in meta_shapes(_args(case)).items():
        if len(shape) == 1:
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name == "tok_embeddings.weight":
            out[name] = torch.randn(shape, generator=gen)
        else:
            out[name] = torch.randn(shape, generator=gen) / shape[1] ** 0.5
    if case.tie:
        out["output.weight"] = out["tok_embeddings.weight"].clone()
    return out


def _args(case: Case):
    from nakta_model.config import ModelArgs

    return ModelArgs.from_meta_params(case.params)


def _hf_config(case: Case) -> dict:
    """The case's ``config.json``: its args as transformers states them (``rope_style``), the
    HF case's own RoPE scaling, tied head and window, a 2,048-token context."""
    from nakta_model.config import RopeScaling

    scaling = RopeScaling.from_dict(case.rope_scaling) if case.rope_scaling else None
    window = MISTRAL_WINDOW if case.model_type == "mistral" else None  # exercised: < rows
    args = _args(case).replace(
        rope_scaling=scaling, tie_word_embeddings=case.tie, sliding_window=window, max_seq_len=2048
    )
    cfg = args.to_hf_config(case.rope_style, model_type=case.model_type)
    return {**cfg, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}


def write_case(case: Case, folder: Path, weights: dict[str, torch.Tensor]) -> Path:
    """The family's own folder: Meta (2 shards, its split) or HF (2 safetensors + index, q/k
    rows permuted for rotate-half RoPE, no ``lm_head`` when tied)."""
    from safetensors.torch import save_file

    from nakta_model.layout import meta_split_dim, meta_to_hf_name, permute_for_hf

    folder.mkdir(parents=True, exist_ok=True)
    if case.format == "meta":
        shards: list[dict] = [{}, {}]
        for name, t in weights.items():
            d = meta_split_dim(name)
            if name == "tok_embeddings.weight" and case.llama3_split:
                d = 0  # Llama-3's VocabParallelEmbedding
            for i, s in enumerate(shards):
                s[name] = t.clone() if d is None else t.chunk(2, dim=d)[i].clone()
        for i, s in enumerate(shards):
            torch.save(s, folder / f"consolidated.{i:02d}.pth")
        (folder / "params.json").write_text(json.dumps(case.params))
        return folder
    args = _args(case)
    hf = {}
    for name, t in weights.items():
        if case.tie and name == "output.weight":
            continue
        if name.endswith("attention.wq.weight"):
            t = permute_for_hf(t, args.n_heads)
        elif name.endswith("attention.wk.weight"):
            t = permute_for_hf(t, args.n_kv_heads)
        hf[meta_to_hf_name(name)] = t.contiguous()
    names = sorted(hf)
    files = {}
    for i in range(2):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        part = {k: hf[k] for k in names[i::2]}
        save_file(part, str(folder / fname), metadata={"format": "pt"})
        files.update(dict.fromkeys(part, fname))
    index = {"metadata": {}, "weight_map": files}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(_hf_config(case), indent=2))
    return folder


# -------------------------------------------------------------------------------- references


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _llama_models(case: Case, folder: Path, dtype: torch.dtype, device: torch.device) -> Callable:
    from llama_models.checkpoint import maybe_reshard_state_dict
    from llama_models.llama3.args import ModelArgs as MetaArgs
    from llama_models.llama3.model import Transformer as MetaTransformer

    from llama_org.distributed import init_distributed, init_model_parallel

    init_distributed(torch.device("cpu"))
    init_model_parallel(1)
    paths = sorted(folder.glob("consolidated.*.pth"))
    old = torch.get_default_dtype()
    try:  # Meta's reader merges the shards itself (it sets a bf16 default tensor type)
        sd = maybe_reshard_state_dict(paths, n_kv_heads=_args(case).n_kv_heads)
    finally:
        torch.set_default_tensor_type(torch.FloatTensor)
        torch.set_default_dtype(old)
    params = json.loads((folder / "params.json").read_text())
    with _default_dtype(dtype):
        model = MetaTransformer(MetaArgs(**params, max_seq_len=_SEQ + 8, max_batch_size=_BATCH))
    model.load_state_dict({k: v.to(dtype) for k, v in sd.items()})
    model.to(device)  # its KV cache follows the inputs on the first forward
    return lambda tokens: model.forward(tokens, 0).float()


def _llama_org(case: Case, folder: Path, dtype: torch.dtype, device: torch.device) -> Callable:
    from llama_org import Llama
    from nakta_model.layout import merge_meta_shards

    shards = [torch.load(p, weights_only=True) for p in sorted(folder.glob("consolidated.*.pth"))]
    sd = merge_meta_shards(shards, _args(case))
    ref = Llama.from_state_dict(case.params, sd, _SEQ + 8, _BATCH, device=device, dtype=dtype)
    return lambda tokens: ref.model.forward(tokens, 0).float()


def _transformers(case: Case, folder: Path, dtype: torch.dtype, device: torch.device) -> Callable:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    model.to(device).eval()

    def logits(tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(tokens).logits.float()

    return logits


def reference_logits_fn(
    case: Case, folder: Path, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> Callable:
    """``tokens [B, S] -> fp32 logits [B, S, vocab]`` of the case's reference in ``dtype``."""
    device = torch.device(device)
    if case.reference == _META3:
        return _llama_models(case, folder, dtype, device)
    if case.reference == "llama_org":
        return _llama_org(case, folder, dtype, device)
    return _transformers(case, folder, dtype, device)


def _greedy(logits_fn: Callable, prompts: torch.Tensor, n: int) -> list[list[int]]:
    tokens = prompts
    for _ in range(n):
        nxt = logits_fn(tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens[:, prompts.shape[1] :].tolist()


# ------------------------------------------------------------------------------------ one row


def run_case(
    case: Case,
    work: Path,
    dtypes: Sequence[str] = ("fp32",),
    seed: int = 0,
    kernels: str | None = None,
    gen_len: int = _GEN,
    device: torch.device | str = "cpu",
) -> list[dict]:
    """The rows of one case (one per dtype), each with the markdown-only extra
    ``reference_err`` (the reference at that dtype against the fp32 truth)."""
    import nakta_model
    from nakta_model.generation import generate_tokens

    folder = write_case(case, work / f"{case.preset}-{case.format}", tiny_weights(case, seed))
    gen = torch.Generator().manual_seed(seed + 1)
    vocab = case.params["vocab_size"]
    tokens = torch.randint(3, vocab, (_BATCH, _SEQ), generator=gen).to(device)
    prompts = tokens[:, :_PROMPT]
    truth_fn = reference_logits_fn(case, folder, torch.float32, device)
    truth, truth_greedy = truth_fn(tokens), _greedy(truth_fn, prompts, gen_len)
    rows = []
    for name in dtypes:
        dtype = _DTYPES[name]
        ref = (
            truth_fn if dtype == torch.float32 else reference_logits_fn(case, folder, dtype, device)
        )
        model = nakta_model.load(folder, device, dtype, kernels=kernels)
        ours = model(tokens)
        got = generate_tokens(
            model, prompts.tolist(), gen_len, eos_id=-1, pad_id=-1, max_seq_len=_SEQ + 8
        )
        got = [g[_PROMPT:] for g in got]
        ref_logits = ref(tokens)
        ref_greedy = truth_greedy if ref is truth_fn else _greedy(ref, prompts, gen_len)
        rows.append(
            {
                "preset": case.preset,
                "format": case.format,
                "dtype": name,
                "reference": case.reference,
                "max_abs_logit_err": float((ours - truth).abs().max()),
                "greedy_identical": got == truth_greedy,
                # markdown only: the mean error, and the reference at this dtype judged alike
                "mean_abs_logit_err": float((ours - truth).abs().mean()),
                "reference_err": float((ref_logits - truth).abs().max()),
                "reference_mean_err": float((ref_logits - truth).abs().mean()),
                "reference_greedy_identical": ref_greedy == truth_greedy,
            }
        )
    return rows


# ------------------------------------------------------------------------------------ report


def markdown(rows: list[dict], device: str = "CPU") -> str:
    lines = [
        f"# Families parity (tiny random models, {device})",
        "",
        "Nakta against each family's reference reading the same folder (`accuracy_test/"
        "families_parity.py`; what each column means: its docstring and docs/families.md). "
        "Errors are against the reference in fp32 (the truth), over every position of 2 x 40 "
        "tokens; greedy: 24 tokens after an 8-token prompt, Nakta's KV-cache decode against the "
        "truth's recompute. At bf16 the reference run in bf16 is judged alike, in brackets. "
        f"Mistral's sliding window is {MISTRAL_WINDOW} tokens (4,096 in Mistral-7B), shorter "
        "than these sequences: exercised.",
        "",
        "| preset | format | dtype | reference | max abs dlogit (reference's) | "
        "mean abs dlogit (reference's) | greedy = truth's (reference's) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fp32 = r["dtype"] == "fp32"
        yes = {True: "yes", False: "NO"}

        def pair(ours: str, theirs: str, fp32: bool = fp32) -> str:
            return ours if fp32 else f"{ours} ({theirs})"

        lines.append(
            f"| {r['preset']} | {r['format']} | {r['dtype']} | {r['reference']} | "
            + pair(f"{r['max_abs_logit_err']:.3g}", f"{r['reference_err']:.3g}") + " | "
            + pair(f"{r['mean_abs_logit_err']:.3g}", f"{r['reference_mean_err']:.3g}") + " | "
            + pair(yes[r["greedy_identical"]], yes[r["reference_greedy_identical"]]) + " |"
        )  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    from nakta_model.cli import OneLineArgumentParser
    from nakta_model.io_utils import atomic_write_text

    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, bf16")
    p.add_argument("--presets", default="", help="comma list (default: every case)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    a = p.parse_args(argv)
    dtypes = [d for d in a.dtypes.split(",") if d]
    bad = [d for d in dtypes if d not in _DTYPES]
    if bad or not dtypes:
        p.error(f"--dtypes: {bad or dtypes} not in {sorted(_DTYPES)}")
    wanted = {x for x in a.presets.split(",") if x}
    unknown = wanted - {c.preset for c in CASES}
    if unknown:
        p.error(
            f"--presets: unknown {sorted(unknown)}; choose from {sorted({c.preset for c in CASES})}"
        )
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for case in CASES:
            if wanted and case.preset not in wanted:
                continue
            for row in run_case(case, Path(work), dtypes, device=a.device):
                rows.append(row)
                print(json.dumps(row), flush=True)
    keys = ("preset", "format", "dtype", "reference", "max_abs_logit_err", "greedy_identical")
    data = {"rows": [{k: r[k] for k in keys} for r in rows]}
    a.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(a.out / "families_parity.json", json.dumps(data, indent=2) + "\n")
    label = "CPU" if a.device == "cpu" else torch.cuda.get_device_name(torch.device(a.device))
    atomic_write_text(a.out / "families_parity.md", markdown(rows, label))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
