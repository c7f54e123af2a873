"""The fp32-truth sections of a parity report: nakta and llama_org at the run's dtype against
llama_org in fp32 (with the verdict), and the FP8 column: nakta-fp8 beside nakta, both against
the same truth, and how much further FP8 is, said plainly.

``parity.py`` computes the comparisons (``--quant fp8`` scores the FP8 twin of the same loaded
weights, ``nakta_model.loading.quantized``); this module only words them.
"""

from __future__ import annotations

__all__ = ["fp8_markdown", "fp8_summary", "truth_markdown"]


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
