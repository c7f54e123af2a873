"""The families' speed rows in one summary (issue 40): Llama-3.x, Mistral, TinyLlama beside their peers.

    python -m speed_bench.families_report --root speed_bench/results/<device>/families

It measures nothing itself: it reads what ``lm_eval_speed`` (``--model nakta`` against ``--model
hf`` on the same random weights), ``decode_speed`` (``nakta`` and ``hf`` in one process) and
``throughput`` (``nakta`` / ``nakta_fp8`` and HF's static cache in one process) wrote under
``ROOT/<preset>/<measure>/``, and writes ``families_summary.json`` (``{"device_name", "runs":
[{"preset", "measure", "nakta", "peer", "peer_value"}]}``), ``families.csv`` / ``families.md``
and ``families.png`` into ROOT. A measure whose folder is missing is left out and named.

Measures: ``lm_eval_hellaswag_full_0shot_s`` (wall seconds; peer ``hf``), ``lm_eval_acc`` (the
same runs' acc; peer ``hf``), ``decode_b1_pct_floor`` (batch-1 decoding as a % of the copy-
bandwidth floor; peer ``hf``), ``throughput_128_128_tok_s`` and ``throughput_128_128_fp8_tok_s``
(output tok/s at the best row count; peer ``hf_static``: HF generate with a static cache at its
best batch), and ``throughput_128_128_fp8_kv8_tok_s`` when the FP8 run also ran an e4m3 KV cache
(``nakta_fp8_kv8``: FP8 weights and KV, as TensorRT-LLM's FP8 checkpoints run).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

if not __package__:  # run by path: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import pandas as pd

from bench_common.report import save_figure, write_json, write_table

# folder under ROOT/<preset>/ -> what it holds
LM_EVAL, DECODE, THROUGHPUT, THROUGHPUT_FP8 = "lm_eval", "decode", "throughput", "throughput_fp8"
# measures where a smaller number is better (the ratio column is then peer / nakta)
LOWER_IS_BETTER = {"lm_eval_hellaswag_full_0shot_s"}


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def lm_eval_rows(preset: str, summary: dict) -> list[dict]:
    """Wall time and acc of the 0-shot nakta run (its default batch) and hf's best run."""
    runs = [r for r in summary.get("runs", []) if not r.get("error") and r.get("num_fewshot") == 0]
    nakta = [r for r in runs if r["model"] == "nakta"]
    hf = [r for r in runs if r["model"] == "hf"]
    if not nakta or not hf:
        raise ValueError(f"{preset}: lm_eval summary needs a nakta and an hf 0-shot run")
    best_nakta = min(nakta, key=lambda r: r["wall_s"])
    best_hf = min(hf, key=lambda r: r["wall_s"])
    measure = "lm_eval_hellaswag_full_0shot_s" if best_nakta.get("limit") is None else (
        f"lm_eval_hellaswag_{best_nakta['n']}_0shot_s"
    )  # fmt: skip
    return [
        row(preset, measure, best_nakta["wall_s"], "hf", best_hf["wall_s"]),
        row(preset, "lm_eval_acc", best_nakta["acc"], "hf", best_hf["acc"]),
    ]


def decode_rows(preset: str, summary: dict) -> list[dict]:
    """Batch-1 % of the floor, nakta against hf, at the shortest prompt run."""
    b1 = [r for r in summary.get("runs", []) if r["batch"] == 1]
    by_engine = {}
    for r in sorted(b1, key=lambda r: r["prompt"], reverse=True):
        by_engine[r["engine"]] = r  # the shortest prompt wins
    if "nakta" not in by_engine:
        raise ValueError(f"{preset}: decode summary has no nakta batch-1 run")
    peer = by_engine.get("hf")
    return [
        row(
            preset,
            "decode_b1_pct_floor",
            by_engine["nakta"]["pct_of_floor"],
            "hf",
            peer["pct_of_floor"] if peer else None,
        )
    ]


def throughput_rows(
    preset: str, summary: dict, measure: str, engine: str, peer_summary: dict | None = None
) -> list[dict]:
    """Best output tok/s of ``engine`` over its row counts, against HF's best batch (in this
    summary, else in ``peer_summary``: the bf16 run of the same call holds HF's)."""
    runs = [r for r in summary.get("runs", []) if r.get("output_tok_s")]
    ours = [r for r in runs if r["engine"] == engine]
    if not ours:
        raise ValueError(f"{preset}: throughput summary has no {engine} run")
    hf = [r["output_tok_s"] for r in runs if r["engine"] == "hf"]
    if not hf and peer_summary is not None:
        hf = [r["output_tok_s"] for r in peer_summary.get("runs", []) if r.get("engine") == "hf"]
    best = max(r["output_tok_s"] for r in ours)
    return [row(preset, measure, best, "hf_static", max(hf) if hf else None)]


def row(preset: str, measure: str, nakta: float, peer: str, peer_value: float | None) -> dict:
    return {
        "preset": preset,
        "measure": measure,
        "nakta": float(nakta),
        "peer": peer,
        "peer_value": None if peer_value is None else float(peer_value),
    }


def _bf16_throughput(preset_dir: Path) -> dict | None:
    path = preset_dir / THROUGHPUT / "throughput_summary.json"
    return _read(path) if path.is_file() else None


def fp8_throughput_rows(root: Path, preset: str, summary: dict) -> list[dict]:
    """The FP8 run's rows: FP8 weights, and FP8 weights + e4m3 KV when it ran that engine; HF's
    best batch from the bf16 run of the same call."""
    peer = _bf16_throughput(root / preset)
    rows = throughput_rows(preset, summary, "throughput_128_128_fp8_tok_s", "nakta_fp8", peer)
    if any(r.get("engine") == "nakta_fp8_kv8" for r in summary.get("runs", [])):
        rows += throughput_rows(
            preset, summary, "throughput_128_128_fp8_kv8_tok_s", "nakta_fp8_kv8", peer
        )
    return rows


def collect(root: Path) -> tuple[dict, list[str]]:
    """``(summary, missing)``: every measure found under ``root/<preset>/``."""
    runs: list[dict] = []
    missing: list[str] = []
    device_name = None
    readers = (
        (LM_EVAL, "lm_eval_summary.json", lm_eval_rows),
        (DECODE, "decode_summary.json", decode_rows),
        (
            THROUGHPUT,
            "throughput_summary.json",
            lambda p, s: throughput_rows(p, s, "throughput_128_128_tok_s", "nakta"),
        ),
        (THROUGHPUT_FP8, "throughput_summary.json", lambda p, s: fp8_throughput_rows(root, p, s)),
    )
    for preset_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        for folder, name, read in readers:
            path = preset_dir / folder / name
            if not path.is_file():
                missing.append(f"{preset_dir.name}/{folder}")
                continue
            summary = _read(path)
            device_name = device_name or summary.get("device_name")
            runs.extend(read(preset_dir.name, summary))
    if not runs:
        raise ValueError(f"no families results under {root}")
    return {"device_name": device_name, "runs": runs}, missing


def ratio(r: dict) -> float | None:
    if not r["peer_value"] or r["measure"] == "lm_eval_acc":
        return None
    if r["measure"] in LOWER_IS_BETTER or r["measure"].endswith("_0shot_s"):
        return r["peer_value"] / r["nakta"]
    return r["nakta"] / r["peer_value"]


def write_outputs(summary: dict, root: Path, missing: Sequence[str]) -> None:
    write_json(summary, root / "families_summary.json")
    df = pd.DataFrame(summary["runs"])
    df["nakta_vs_peer"] = [ratio(r) for r in summary["runs"]]
    notes = (
        "nakta_vs_peer: how many times better nakta is (time: peer / nakta; rates: nakta / peer)."
    )
    if missing:
        notes += f" Not measured: {', '.join(missing)}."
    write_table(df, root, "families", f"LLaMA families on {summary['device_name']}", notes)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plotted = df[df["nakta_vs_peer"].notna()]
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * max(len(plotted), 1)))
    labels = [f"{p} {m}" for p, m in zip(plotted["preset"], plotted["measure"])]
    ax.barh(labels, plotted["nakta_vs_peer"], color="tab:blue")
    ax.axvline(1.0, color="grey", lw=1)
    ax.set_xlabel("nakta vs peer (x, higher is better for nakta)")
    ax.set_title(f"LLaMA families, {summary['device_name']}")
    save_figure(fig, root / "families.png")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, required=True, help="folder holding <preset>/<measure>/")
    a = p.parse_args(argv)
    if not a.root.is_dir():
        p.error(f"--root {a.root}: not a folder")
    try:
        summary, missing = collect(a.root)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_outputs(summary, a.root, missing)
    print((a.root / "families.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
