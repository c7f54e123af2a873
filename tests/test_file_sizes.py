"""No source file of the tree is over 800 lines: files with one job each (DESIGN.md).

Size is a smell past that, not a reason to cut one idea in two: a file that must grow past it
is split along its jobs, never into ``_<op>_kernels.py`` halves of one kernel.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 800
# One idea, one file, even when long (issue 38, item 7): a decode kernel's Triton code, launch
# tables, checks, launcher and reference read top to bottom in one file.
ONE_IDEA = {
    "nakta_model/kernels/decode_linear.py": 1300,
    "nakta_model/kernels/decode_attention.py": 1100,
}


def _sources() -> list[Path]:
    """Every .py file of the tree (hidden and carried folders such as .data/ or .whl/ aside)."""
    out = []
    for path in REPO.rglob("*.py"):
        rel = path.relative_to(REPO)
        if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
            continue
        out.append(path)
    return sorted(out)


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_the_tree_is_read():
    names = {p.relative_to(REPO).as_posix() for p in _sources()}
    assert {"convert.py", "nakta_model/loading.py", "tests/test_file_sizes.py"} <= names


def test_no_source_file_is_over_800_lines():
    long = {
        rel: n
        for p in _sources()
        if (n := _lines(p)) > ONE_IDEA.get(rel := p.relative_to(REPO).as_posix(), MAX_LINES)
    }
    assert long == {}, f"files over {MAX_LINES} lines: {long}"
