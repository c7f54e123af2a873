"""HellaSwag parity: nakta vs llama_org on the same weights, the same requests, the same scoring.

    python -m accuracy_test.parity --checkpoint ../shared/data/stories260K \\
        --data ../shared/data/hellaswag_val_full.jsonl --dtype fp32 --device cpu \\
        --out accuracy_test/results/stories260K_fp32_cpu.json

    python -m accuracy_test.parity --preset 7B --random --tokenizer .data/llama_tokenizer.model \\
        --data .data/hellaswag_val_subset1000.jsonl --dtype bf16 --device cuda

    torchrun --nproc_per_node 2 -m accuracy_test.parity --tp 2 \\
        --checkpoint ../shared/data/stories260K_mp2 --data ...

    python accuracy_test/parity.py ...      # by path works too (from the root or accuracy_test/)

``--checkpoint`` is a Nakta (``convert.py``), Meta or HF folder; ``--tokenizer`` defaults to the
checkpoint's own ``tokenizer.model``. llama_org reads a Meta folder with Meta's own code; from a
Nakta or HF folder it is handed the same weights in memory, as Meta-named tensors cut into
its model-parallel shards (``models.llama_org_from_checkpoint``).

Under ``torchrun`` llama_org runs as Meta runs it (model parallel over the whole world, one
``consolidated.NN.pth`` per rank) and Nakta on the ``--tp x --dp`` grid of the same world
(each rank reading its ``--tp`` shard straight from the checkpoint; requests sharded over the
``--dp`` replicas). With ``--random``, ``--tp`` must equal the world size (Nakta takes
llama_org's shards).

Requests are built once (lm-eval's HellaSwag preprocessing and ``_encode_pair``) and scored by
both models: nakta through the shared-context engine (``scoring.score``), llama_org through the
plain scorer (``scoring.score_with_forward`` over ``Llama.model(tokens, 0)``), with the same
token budget, row limit and max length. Prints and saves (JSON + markdown, atomic) acc and
acc_norm of both, the log-likelihood differences, and every task whose prediction differs
(``flips``) with the reference's margin between the two choices involved.

With ``--dtype bf16|fp16`` an fp32 truth is scored too (``--truth fp32``, the default then;
``--truth none`` skips it): llama_org in fp32 over the same weights (the half-precision ones,
upcast exactly), and each half-precision model is compared to it: flips (acc, acc_norm), a
histogram of the truth's margins at those flips, max / mean |dll|. The verdict says whether
nakta is no further from the truth than llama_org (flips within two standard deviations
of llama_org's count, mean |dll| within 10%).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if not __package__:  # run by path: import from the repo root, not from this script's folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch

from accuracy_test import models
from nakta_model import scoring
from nakta_model.cli import (
    InputError,
    checked_on_every_rank,
    checkpoint_errors,
    checkpoint_tokenizer_path,
    exit_on_input_error,
    require_checkpoint,
    require_file,
)
from nakta_model.io_utils import atomic_write_text
from nakta_model.tasks import hellaswag

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="Nakta, Meta or HF checkpoint folder")
    p.add_argument("--tokenizer", help="tokenizer file (default: the checkpoint's own)")
    p.add_argument(
        "--data",
        required=True,
        help="HellaSwag jsonl (original or preprocessed) or llama.cpp .txt[.bz2]",
    )
    p.add_argument("--limit", type=int, default=None, help="first N tasks only")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")
    p.add_argument("--out", default=None, help="result JSON path (markdown written beside it)")
    p.add_argument("--preset", default=None, help="model shape for --random, e.g. 7B")
    p.add_argument("--random", action="store_true", help="same seeded random weights, no ckpt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token-budget", type=int, default=scoring.DEFAULT_TOKEN_BUDGET)
    p.add_argument("--batch-size", type=int, default=64, help="max rows per batch (both models)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--tp", type=int, default=1, help="Nakta tensor-parallel size (torchrun)")
    p.add_argument("--dp", type=int, default=1, help="Nakta data-parallel replicas (torchrun)")
    p.add_argument(
        "--quant", choices=["fp8"],
        help="also score nakta's FP8 twin of the same weights against the fp32 truth "
        "(needs --dtype bf16/fp16 and a GPU of compute capability >= 8.9)",
    )  # fmt: skip
    p.add_argument(
        "--truth",
        choices=["fp32", "none"],
        default=None,
        help="also score llama_org in fp32 and compare both models to it "
        "(default: fp32 when --dtype is bf16/fp16)",
    )
    a = p.parse_args(argv)
    a.truth = truth_mode(a)
    if a.random != (a.preset is not None):
        p.error("--random and --preset go together")
    if not a.random and not a.checkpoint:
        p.error("--checkpoint is required (or --preset NAME --random)")
    if a.limit is not None and a.limit < 1:
        p.error("--limit must be >= 1")
    if a.quant and (a.dtype == "fp32" or a.truth != "fp32"):
        p.error("--quant fp8 is judged against the fp32 truth: use --dtype bf16|fp16 "
                "without --truth none")  # fmt: skip
    return a


def truth_mode(a: argparse.Namespace) -> str:
    """``--truth``, defaulting to an fp32 truth pass when the run itself is not fp32."""
    chosen = getattr(a, "truth", None)
    return chosen or ("none" if a.dtype == "fp32" else "fp32")


def _git_commit() -> str | None:
    """The checkout's HEAD (provenance of a saved result), None outside git."""
    import subprocess

    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _metric_scores(doc: hellaswag.Doc, r: hellaswag.DocResult, metric: str) -> list[float]:
    """The per-choice values a metric takes the argmax of (raw or per-character ll)."""
    if metric == "acc":
        return list(r.lls)
    return [ll / len(c) for ll, c in zip(r.lls, doc.choices)]


def compare(
    docs: Sequence[hellaswag.Doc],
    lls_nakta: Sequence[float],
    lls_org: Sequence[float],
) -> dict:
    """Metrics of both models, log-likelihood differences and the per-task flips."""
    m_n, r_n = hellaswag.evaluate(docs, lls_nakta)
    m_o, r_o = hellaswag.evaluate(docs, lls_org)
    diffs = [abs(a - b) for a, b in zip(lls_nakta, lls_org)]
    flips, ref_margins = [], []
    for t, (doc, rn, ro) in enumerate(zip(docs, r_n, r_o)):
        for metric, pn, po in (("acc", rn.pred, ro.pred), ("acc_norm", rn.pred_norm, ro.pred_norm)):
            so, sn = _metric_scores(doc, ro, metric), _metric_scores(doc, rn, metric)
            if metric == "acc":
                top = sorted(so, reverse=True)
                ref_margins.append(top[0] - top[1] if len(top) > 1 else float("inf"))
            if pn == po:
                continue
            flips.append(
                {
                    "task": t,
                    "ind": doc.ind,
                    "metric": metric,
                    "label": doc.label,
                    "nakta": pn,
                    "llama_org": po,
                    # how close the reference was to nakta's choice (>= 0), and vice versa
                    "margin": so[po] - so[pn],
                    "nakta_margin": sn[pn] - sn[po],
                    "max_ll_diff": max(abs(a - b) for a, b in zip(rn.lls, ro.lls)),
                }
            )
    finite = [m for m in ref_margins if m != float("inf")]
    return {
        "nakta": m_n,
        "llama_org": m_o,
        "acc_diff_pt": 100 * (m_n["acc"] - m_o["acc"]),
        "acc_norm_diff_pt": 100 * (m_n["acc_norm"] - m_o["acc_norm"]),
        "n_flips": {
            "acc": sum(f["metric"] == "acc" for f in flips),
            "acc_norm": sum(f["metric"] == "acc_norm" for f in flips),
        },
        "flips": flips,
        "identical_predictions": not flips,
        "ll_abs_diff": {
            "max": max(diffs, default=0.0),
            "mean": statistics.fmean(diffs) if diffs else 0.0,
        },
        "reference_acc_margin_median": statistics.median(finite) if finite else None,
    }


# truth margins at the flips, binned by decade: a flip on a near-tie is rounding, not a bug
MARGIN_EDGES = (0.0, 1e-4, 1e-3, 1e-2, 1e-1, float("inf"))


def margin_histogram(margins: Sequence[float]) -> list[dict]:
    """Counts of ``margins`` in the ``MARGIN_EDGES`` bins ``[lo, hi)``."""
    bins = list(zip(MARGIN_EDGES[:-1], MARGIN_EDGES[1:]))
    return [{"lo": lo, "hi": hi, "count": sum(lo <= m < hi for m in margins)} for lo, hi in bins]


def truth_comparison(
    docs: Sequence[hellaswag.Doc], lls: Sequence[float], lls_truth: Sequence[float]
) -> dict:
    """One model against the fp32 truth: its metrics, flips, the truth's margins there, |dll|."""
    metrics, res = hellaswag.evaluate(docs, lls)
    _, res_t = hellaswag.evaluate(docs, lls_truth)
    margins: dict[str, list[float]] = {"acc": [], "acc_norm": []}
    for doc, r, rt in zip(docs, res, res_t):
        for metric, pred, pred_t in (
            ("acc", r.pred, rt.pred),
            ("acc_norm", r.pred_norm, rt.pred_norm),
        ):
            if pred != pred_t:
                st = _metric_scores(doc, rt, metric)
                margins[metric].append(st[pred_t] - st[pred])
    diffs = [abs(a - b) for a, b in zip(lls, lls_truth)]
    return {
        "acc": metrics["acc"],
        "acc_norm": metrics["acc_norm"],
        "n_flips": {k: len(v) for k, v in margins.items()},
        "flip_truth_margins": margins,
        "flip_margin_histogram": {k: margin_histogram(v) for k, v in margins.items()},
        "ll_abs_diff": {
            "max": max(diffs, default=0.0),
            "mean": statistics.fmean(diffs) if diffs else 0.0,
        },
    }


# nakta's mean |dll| may exceed llama_org's by this factor and still count as "no further":
# the two run different kernels (fused vs eager) of the same precision, so their rounding
# differs from request to request
MEAN_DLL_SLACK = 1.10


def flip_allowance(flips_nakta: int, flips_org: int) -> float:
    """Extra flips nakta may have: two standard deviations of a difference of two counts.

    Flips against the truth are rare events on near-ties; two half-precision models with the
    same error level differ in their counts by about sqrt(n1 + n2) (Poisson), so a strict
    ``<=`` would call a 1-vs-0 difference on 40 tasks a regression.
    """
    return 2.0 * math.sqrt(flips_nakta + flips_org)


def truth_verdict(nakta: dict, llama_org: dict) -> dict:
    """Is nakta no further from the fp32 truth than llama_org at the same dtype?"""
    flips_n, flips_o = sum(nakta["n_flips"].values()), sum(llama_org["n_flips"].values())
    mean_n, mean_o = nakta["ll_abs_diff"]["mean"], llama_org["ll_abs_diff"]["mean"]
    ratio = mean_n / mean_o if mean_o > 0 else (1.0 if mean_n == 0 else float("inf"))
    allowance = flip_allowance(flips_n, flips_o)
    return {
        "nakta_no_further": flips_n <= flips_o + allowance and ratio <= MEAN_DLL_SLACK,
        "flips": {"nakta": flips_n, "llama_org": flips_o},
        "flip_allowance": allowance,
        "mean_dll_ratio": ratio,
        "mean_dll_slack": MEAN_DLL_SLACK,
    }


def markdown(result: dict, max_flips: int | None = None) -> str:
    cfg = result["config"]
    lines = [
        f"# HellaSwag parity: nakta vs llama_org ({cfg['model']}, {cfg['dtype']}, {cfg['device']})",
        "",
        f"{cfg['n_tasks']} tasks from `{cfg['data']}`, {cfg['n_requests']} requests, "
        f"max length {cfg['max_length']}, token budget {cfg['token_budget']}, "
        f"batch rows {cfg['batch_size']}. torch {cfg['torch']}, device {cfg['device_name']}.",
        "",
        "| model | acc | acc_norm | seconds |",
        "|---|---|---|---|",
    ]
    for name in ("nakta", "llama_org"):
        m = result[name]
        lines.append(f"| {name} | {m['acc']:.4f} | {m['acc_norm']:.4f} | {m['seconds']:.1f} |")
    d = result["ll_abs_diff"]
    lines += [
        "",
        "Seconds are this run's wall time, not a benchmark (speed_bench/ measures speed; on the "
        "CPU nakta runs its PyTorch reference path).",
        "",
        f"- acc difference: {result['acc_diff_pt']:+.3f} pt; "
        f"acc_norm difference: {result['acc_norm_diff_pt']:+.3f} pt",
        f"- per-request log-likelihood |nakta - llama_org|: max {d['max']:.3g}, mean {d['mean']:.3g}",
        f"- flipped predictions: acc {result['n_flips']['acc']}, "
        f"acc_norm {result['n_flips']['acc_norm']} "
        f"(identical predictions: {result['identical_predictions']})",
    ]
    if result["reference_acc_margin_median"] is not None:
        lines.append(
            f"- median llama_org acc margin (best - second best ll) over all tasks: "
            f"{result['reference_acc_margin_median']:.3g}"
        )
    if result.get("truth"):
        lines += truth_markdown(result) + fp8_markdown(result)
    if result["flips"]:
        lines += [
            "",
            "## nakta vs llama_org flips",
            "",
            "| task | ind | metric | label | nakta | llama_org | margin | nakta_margin | max ll diff |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        shown = result["flips"] if max_flips is None else result["flips"][:max_flips]
        for f in shown:
            lines.append(
                f"| {f['task']} | {f['ind']} | {f['metric']} | {f['label']} | {f['nakta']} | "
                f"{f['llama_org']} | {f['margin']:.3g} | {f['nakta_margin']:.3g} | "
                f"{f['max_ll_diff']:.3g} |"
            )
        if len(shown) < len(result["flips"]):
            lines.append(f"\n({len(result['flips']) - len(shown)} more flips in the saved files)")
    return "\n".join(lines) + "\n"


# The fp32-truth sections of the report: nakta and llama_org at the run's dtype against llama_org in
# fp32 (with the verdict), and the FP8 column beside nakta against the same truth, said plainly.


def fp8_summary(bf: dict, f8: dict) -> dict:
    """How far nakta-fp8 is from the truth next to nakta at the run's dtype: extra flips (acc +
    acc_norm) and the ratio of mean |delta loglikelihood|."""
    flips_bf, flips_f8 = sum(bf["n_flips"].values()), sum(f8["n_flips"].values())
    mean_bf, mean_f8 = bf["ll_abs_diff"]["mean"], f8["ll_abs_diff"]["mean"]
    return {
        "flips": {"bf16": flips_bf, "fp8": flips_f8},
        "extra_flips": flips_f8 - flips_bf,
        "mean_abs_dll": {"bf16": mean_bf, "fp8": mean_f8},
        "mean_dll_ratio": mean_f8 / mean_bf if mean_bf > 0 else float("inf"),
        "acc_delta": f8["acc"] - bf["acc"],
        "acc_norm_delta": f8["acc_norm"] - bf["acc_norm"],
    }


def fp8_markdown(result: dict) -> list[str]:
    """The FP8 section of the parity markdown (empty without an FP8 comparison)."""
    truth = result.get("truth") or {}
    if "nakta_fp8" not in truth:
        return []
    dtype = result["config"]["dtype"]
    bf, f8, s = truth["nakta"], truth["nakta_fp8"], truth["fp8"]
    lines = [
        "",
        f"## FP8 (opt-in) beside {dtype}, against the same fp32 truth",
        "",
        "| model | acc | acc_norm | flips acc | flips acc_norm | max abs dll | mean abs dll |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, t in ((f"nakta-{dtype}", bf), ("nakta-fp8", f8)):
        lines.append(
            f"| {name} | {t['acc']:.4f} | {t['acc_norm']:.4f} | {t['n_flips']['acc']} | "
            f"{t['n_flips']['acc_norm']} | {t['ll_abs_diff']['max']:.3g} | "
            f"{t['ll_abs_diff']['mean']:.3g} |"
        )
    lines += [
        "",
        "Truth margin at the flips (how close to a tie the truth was where each model flipped):",
        "",
        f"| truth margin | nakta-{dtype} acc | nakta-{dtype} acc_norm | nakta-fp8 acc | "
        "nakta-fp8 acc_norm |",
        "|---|---|---|---|---|",
    ]
    hb, hf = bf["flip_margin_histogram"], f8["flip_margin_histogram"]
    for i, b in enumerate(hb["acc"]):
        counts = [hb["acc"][i], hb["acc_norm"][i], hf["acc"][i], hf["acc_norm"][i]]
        lines.append(
            f"| [{b['lo']:g}, {b['hi']:g}) | " + " | ".join(str(c["count"]) for c in counts) + " |"
        )
    more = s["extra_flips"]
    lines += [
        "",
        f"**FP8 is further from the fp32 truth than {dtype}: {s['flips']['fp8']} flips against "
        f"{s['flips']['bf16']} ({'+' if more >= 0 else ''}{more}), mean |dll| "
        f"{s['mean_abs_dll']['fp8']:.4g} against {s['mean_abs_dll']['bf16']:.4g} "
        f"({s['mean_dll_ratio']:.3g}x); acc {s['acc_delta']:+.4f}, acc_norm "
        f"{s['acc_norm_delta']:+.4f}.**"
        if more > 0 or s["mean_dll_ratio"] > 1
        else f"**FP8 is no further from the fp32 truth than {dtype} on these tasks: "
        f"{s['flips']['fp8']} flips against {s['flips']['bf16']}, mean |dll| ratio "
        f"{s['mean_dll_ratio']:.3g}x.**",
    ]
    return lines


def truth_markdown(result: dict) -> list[str]:
    truth = result["truth"]
    dtype = result["config"]["dtype"]
    lines = [
        "",
        f"## Against the fp32 truth (llama_org in fp32, the {dtype} weights upcast)",
        "",
        "| model | acc | acc_norm | flips acc | flips acc_norm | max abs dll | mean abs dll |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("nakta", "llama_org"):
        t = truth[name]
        lines.append(
            f"| {name}-{dtype} | {t['acc']:.4f} | {t['acc_norm']:.4f} | {t['n_flips']['acc']} | "
            f"{t['n_flips']['acc_norm']} | {t['ll_abs_diff']['max']:.3g} | "
            f"{t['ll_abs_diff']['mean']:.3g} |"
        )
    ref = truth["reference"]
    lines.append(f"| llama_org-fp32 (truth) | {ref['acc']:.4f} | {ref['acc_norm']:.4f} | | | | |")
    lines += [
        "",
        "Truth margin (truth's score of its pick minus its score of the model's pick) at the flips:",
        "",
        f"| truth margin | nakta-{dtype} acc | nakta-{dtype} acc_norm | "
        f"llama_org-{dtype} acc | llama_org-{dtype} acc_norm |",
        "|---|---|---|---|---|",
    ]
    hist = {n: truth[n]["flip_margin_histogram"] for n in ("nakta", "llama_org")}
    for i, b in enumerate(hist["nakta"]["acc"]):
        counts = [
            hist[n][m][i]["count"] for n in ("nakta", "llama_org") for m in ("acc", "acc_norm")
        ]
        lines.append(f"| [{b['lo']:g}, {b['hi']:g}) | " + " | ".join(map(str, counts)) + " |")
    v = truth["verdict"]
    word = "no further from" if v["nakta_no_further"] else "FURTHER from"
    lines += [
        "",
        f"**Verdict: nakta-{dtype} is {word} the fp32 truth than llama_org-{dtype}** "
        f"(flips {v['flips']['nakta']} vs {v['flips']['llama_org']}, allowed "
        f"+{v['flip_allowance']:.3g}; mean abs dll ratio {v['mean_dll_ratio']:.3g}, "
        f"allowed <= {v['mean_dll_slack']:g}).",
    ]
    return lines


def load_inputs(a: argparse.Namespace):
    """``(docs, tokenizer)``, every path checked first (cheap), before any model is built; a
    file that is missing or does not read as what it should be is an :class:`InputError`
    naming it."""
    from nakta_model.tokenizer import TokenizerError, load_tokenizer

    if not a.random:
        require_checkpoint(a.checkpoint)
    a.tokenizer = checkpoint_tokenizer_path(None if a.random else a.checkpoint, a.tokenizer)
    require_file(a.data, "--data", "a HellaSwag .jsonl, or llama.cpp .txt[.bz2]")
    try:
        tok = load_tokenizer(a.tokenizer)
    except TokenizerError as e:
        raise InputError(f"--tokenizer {a.tokenizer}: {e.reason}") from e
    try:
        docs = hellaswag.load(a.data, limit=a.limit)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise InputError(
            f"--data {a.data}: cannot read HellaSwag tasks from it ({type(e).__name__}: {e})"
        ) from e
    return docs, tok


def _score_reference(llama, requests, a, max_length: int, device, progress: bool) -> list:
    """llama_org's plain scoring over ``Llama.model(tokens, 0)`` (the dtype run and the truth)."""
    return scoring.score_with_forward(
        lambda t: llama.model(t, 0),
        requests,
        max_length=max_length,
        batch_size=a.batch_size,
        token_budget=a.token_budget,
        vocab_size=llama.model.vocab_size,
        device=device,
        progress=progress,
    )


def _free_device_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _truth_result(docs, res_n, res_o, res_t, seconds: float, res_f=None) -> dict:
    """Both half-precision models (and nakta-fp8) against the fp32 truth, and the verdict."""
    lls_t = [r[0] for r in res_t]
    m_t, _ = hellaswag.evaluate(docs, lls_t)
    out = {
        "nakta": truth_comparison(docs, [r[0] for r in res_n], lls_t),
        "llama_org": truth_comparison(docs, [r[0] for r in res_o], lls_t),
        "reference": {**m_t, "model": "llama_org", "dtype": "fp32", "seconds": seconds},
    }
    out["verdict"] = truth_verdict(out["nakta"], out["llama_org"])
    if res_f is not None:
        out["nakta_fp8"] = truth_comparison(docs, [r[0] for r in res_f], lls_t)
        out["fp8"] = fp8_summary(out["nakta"], out["nakta_fp8"])
    return out


def run(a: argparse.Namespace, parallel=None) -> dict:
    from nakta_model.data_parallel import map_requests
    from nakta_model.loading import load
    from nakta_model.parallel import ParallelConfigError, ParallelContext
    from nakta_model.sources import is_meta_checkpoint

    parallel = parallel or ParallelContext()
    docs, tok = checked_on_every_rank(load_inputs, a)
    if parallel.world_size > 1 and not a.random and is_meta_checkpoint(a.checkpoint):
        n = len(list(Path(a.checkpoint).glob("consolidated.*.pth")))
        if n != parallel.world_size:  # checked before any collective: the same verdict everywhere
            raise ParallelConfigError(
                f"llama_org runs Meta's model parallel (one shard per process): {a.checkpoint} "
                f"has {n} consolidated.*.pth shard(s), the world has {parallel.world_size} processes"
            )
    device = parallel.device or models.resolve_device(a.device)
    if a.quant:  # before both models are scored, not after
        from nakta_model.fp8 import check_fp8_device

        try:
            check_fp8_device(device)
        except ValueError as e:
            raise InputError(f"--quant {a.quant}: {e}") from None
    dtype = models.parse_dtype(a.dtype)
    requests = hellaswag.build_requests(docs, lambda s: tok.encode(s, bos=True, eos=False))
    longest = max(len(c) + len(x) - 1 for c, x in requests)
    if a.random:
        from nakta_model.config import PRESETS

        max_length = PRESETS[a.preset].max_seq_len
        cache_len = min(max_length, longest)
        model, llama = models.random_pair(
            a.preset, a.tokenizer, device, dtype, cache_len, a.batch_size, a.seed, parallel
        )
        model_name = f"{a.preset}-random-seed{a.seed}"
    else:
        with checkpoint_errors(a.checkpoint):
            model = load(a.checkpoint, device, dtype, parallel)
        max_length = model.args.max_seq_len
        cache_len = min(max_length, longest)
        with checkpoint_errors(a.checkpoint):
            llama = models.llama_org_from_checkpoint(
                a.checkpoint, a.tokenizer, device, dtype, cache_len, a.batch_size
            )
        model_name = Path(a.checkpoint).resolve().name
    check = [d.query for d in docs[:100]]
    if [llama.tokenizer.encode(s, bos=True, eos=False) for s in check] != [
        tok.encode(s, bos=True, eos=False) for s in check
    ]:
        raise RuntimeError("nakta and llama_org tokenizers disagree on the same text")
    progress = not a.no_progress and parallel.is_leader

    def score_nakta(reqs, model=model):
        return scoring.score(
            model,
            reqs,
            use_cache=True,
            token_budget=a.token_budget,
            max_length=max_length,
            max_rows=a.batch_size,
            progress=progress,
        )

    _sync(device)
    t0 = time.perf_counter()
    res_n = map_requests(score_nakta, requests, parallel)
    _sync(device)
    t1 = time.perf_counter()
    res_o = _score_reference(llama, requests, a, max_length, device, progress)
    _sync(device)
    t2 = time.perf_counter()
    res_f = None
    if a.quant:  # the FP8 twin of the same weights, scored the same way
        from nakta_model.loading import quantized

        model_f = quantized(model, a.quant)
        res_f = map_requests(lambda reqs: score_nakta(reqs, model_f), requests, parallel)
        del model_f
        _free_device_memory()
    t2f = time.perf_counter()  # FP8 scored in [t2, t2f)
    res_t = None
    if truth_mode(a) == "fp32" and dtype != torch.float32:
        params, state = models.fp32_weights(llama)
        del llama  # the half-precision reference is done: room for the fp32 one
        _free_device_memory()
        truth = models.llama_org_fp32(params, state, a.tokenizer, device, cache_len, a.batch_size)
        del state
        res_t = _score_reference(truth, requests, a, max_length, device, progress)
        _sync(device)
        del truth
        _free_device_memory()
    t3 = time.perf_counter()
    result = compare(docs, [r[0] for r in res_n], [r[0] for r in res_o])
    result["nakta"]["seconds"] = t1 - t0
    result["llama_org"]["seconds"] = t2 - t1
    if res_t is not None:
        result["truth"] = _truth_result(docs, res_n, res_o, res_t, t3 - t2f, res_f)
        if res_f is not None:
            result["truth"]["nakta_fp8"]["seconds"] = t2f - t2
    result["greedy_flag_mismatches"] = sum(x[1] != y[1] for x, y in zip(res_n, res_o))
    result["config"] = {
        "model": model_name,
        "checkpoint": a.checkpoint,
        "random": a.random,
        "preset": a.preset,
        "seed": a.seed,
        "tokenizer": Path(a.tokenizer).name,
        "data": Path(a.data).name,
        "limit": a.limit,
        "n_tasks": len(docs),
        "n_requests": len(requests),
        "dtype": models.dtype_name(dtype),
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "git_commit": _git_commit(),
        "world_size": parallel.world_size,
        "nakta_tp": parallel.tp_size,
        "nakta_dp": parallel.dp_size,
        "llama_org_mp": parallel.world_size,
        "max_length": max_length,
        "token_budget": a.token_budget,
        "batch_size": a.batch_size,
        "truth": "fp32" if res_t is not None else "none",
        "quant": a.quant,
        "nakta_scoring": "scoring.score (shared-context cache)",
        "llama_org_scoring": "scoring.score_with_forward over Llama.model(tokens, 0)",
        "nakta_kernels": getattr(model, "kernels", None),
    }
    return result


def default_out(a: argparse.Namespace, device: str) -> Path:
    name = f"{a.preset}-random" if a.random else Path(a.checkpoint).resolve().name
    quant = f"_{a.quant}" if getattr(a, "quant", None) else ""  # never the plain run's file
    return RESULTS / f"{name}_{a.dtype}{quant}_{device}.json"


def main(argv: Sequence[str] | None = None) -> int:
    import os

    from nakta_model.parallel import launch

    a = parse_args(argv)
    if a.tp * a.dp == 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return _finish(a, exit_on_input_error(run, a))
    # torchrun: every rank computes, rank 0 writes; bad grids exit 2 with one message
    return launch(
        lambda parallel: _finish(a, run(a, parallel), parallel.is_leader),
        a.tp,
        a.dp,
        device=a.device,
    )


def _finish(a: argparse.Namespace, result: dict, leader: bool = True) -> int:
    if not leader:
        return 0
    out = Path(a.out) if a.out else default_out(a, result["config"]["device"])
    atomic_write_text(out, json.dumps(result, indent=2, sort_keys=True) + "\n")
    atomic_write_text(out.with_suffix(".md"), markdown(result))
    print(markdown(result, max_flips=20))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
