"""The ``NAKTA_*`` environment knobs: one registry (``nakta_model/knobs.py``), one docs table
(docs/knobs.md) listing the same names, no read of a ``NAKTA_*`` variable anywhere else in the
tree, and getters that parse each kind and name the variable when a value is bad."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from nakta_model import knobs

REPO = Path(__file__).resolve().parents[1]
MAX_KNOBS = 12  # issue 38's target: a user reads one short table


def _python_files() -> list[Path]:
    """The tree's own sources: hidden folders (.git, .venv, carried .data/.whl, scratch copies of
    other commits) and results aside."""
    skip = {"results", "node_modules"}

    def ours(parts: tuple[str, ...]) -> bool:
        return not skip & set(parts) and not any(part.startswith(".") for part in parts)

    return [p for p in REPO.rglob("*.py") if ours(p.relative_to(REPO).parts)]


def _nakta_constants(files: list[Path]) -> set[str]:
    """Names bound to a ``"NAKTA_..."`` string anywhere at module level (``TIMING_ENV = ...``)."""
    names = set()
    for path in files:
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
                and node.value.value.startswith("NAKTA_")
            ):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _names_a_knob(node: ast.AST, constants: set[str]) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.startswith("NAKTA_")
    if isinstance(node, ast.Name):
        return node.id in constants
    if isinstance(node, ast.Attribute):
        return node.attr in constants
    return False


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` or a bare ``environ``."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def environ_reads(source: str, constants: set[str]) -> list[int]:
    """Lines of ``source`` that read a ``NAKTA_*`` variable from the process environment:
    ``os.environ.get(X)``, ``os.getenv(X)``, ``os.environ[X]`` (not as an assignment target),
    ``X in os.environ``, with X a ``"NAKTA_..."`` literal or a constant bound to one."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
            f = node.func
            env_get = f.attr == "get" and _is_environ(f.value)
            getenv = f.attr == "getenv"
            if (env_get or getenv) and _names_a_knob(node.args[0], constants):
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if _is_environ(node.value) and _names_a_knob(node.slice, constants):
                lines.append(node.lineno)
        elif (
            isinstance(node, ast.Compare)
            and len(node.ops) == 1
            and isinstance(node.ops[0], (ast.In, ast.NotIn))
            and _is_environ(node.comparators[0])
            and _names_a_knob(node.left, constants)
        ):
            lines.append(node.lineno)
    return lines


def test_the_read_finder_finds_reads():
    src = (
        'import os\nA = "NAKTA_X"\nos.environ.get("NAKTA_Y")\nos.getenv(A)\n'
        "os.environ[m.A]\nA in os.environ\nos.environ['NAKTA_Z'] = '1'\nos.environ.get('HOME')\n"
    )
    assert environ_reads(src, {"A"}) == [3, 4, 5, 6]


def test_no_nakta_variable_is_read_outside_the_registry():
    files = _python_files()
    constants = _nakta_constants(files)
    found = []
    for path in files:
        if path == REPO / "nakta_model" / "knobs.py":
            continue
        for line in environ_reads(path.read_text(encoding="utf-8"), constants):
            found.append(f"{path.relative_to(REPO)}:{line}")
    assert found == [], "read NAKTA_* through nakta_model.knobs: " + ", ".join(found)


def _docs_table() -> list[str]:
    text = (REPO / "docs" / "knobs.md").read_text(encoding="utf-8")
    return re.findall(r"^\| `(NAKTA_[A-Z0-9_]+)` \|", text, re.MULTILINE)


def test_the_docs_table_lists_the_registry():
    names = _docs_table()
    assert len(names) == len(set(names)), "a knob listed twice"
    assert sorted(names) == sorted(knobs.KNOBS)
    assert len(knobs.KNOBS) <= MAX_KNOBS
    assert "docs/knobs.md" in (REPO / "README.md").read_text(encoding="utf-8")


def test_every_declared_knob_is_read_somewhere():
    """A knob nobody reads is documentation of nothing."""
    text = "\n".join(
        p.read_text(encoding="utf-8")
        for p in _python_files()
        if p != REPO / "nakta_model" / "knobs.py" and "tests" not in p.relative_to(REPO).parts
    )
    text += (REPO / "tests" / "conftest.py").read_text(encoding="utf-8")
    assert [n for n in knobs.KNOBS if n not in text] == []


def test_each_knob_is_declared_once_with_a_doc():
    for name, k in knobs.KNOBS.items():
        assert name == k.name and name.startswith("NAKTA_")
        assert k.kind in (bool, int, str, Path) and k.doc and len(k.doc) < 200
        assert k.default is None or isinstance(k.default, k.kind)


def test_getters_parse_and_name_the_variable(monkeypatch):
    monkeypatch.delenv("NAKTA_DEBUG", raising=False)
    assert knobs.get_bool("NAKTA_DEBUG") is False
    monkeypatch.setenv("NAKTA_DEBUG", "1")
    assert knobs.get_bool("NAKTA_DEBUG") is True
    monkeypatch.setenv("NAKTA_DEBUG", "0")
    assert knobs.get_bool("NAKTA_DEBUG") is False
    monkeypatch.setenv("NAKTA_DEBUG", " ")
    assert knobs.get_bool("NAKTA_DEBUG") is False  # empty: the default
    monkeypatch.delenv("NAKTA_LM_EVAL_LOCAL_TASKS", raising=False)
    assert knobs.get_bool("NAKTA_LM_EVAL_LOCAL_TASKS") is None  # unset: decide per request
    monkeypatch.setenv("NAKTA_PREFILL_BURST", "3")
    assert knobs.get_int("NAKTA_PREFILL_BURST") == 3
    monkeypatch.setenv("NAKTA_PREFILL_BURST", "many")
    with pytest.raises(ValueError, match="NAKTA_PREFILL_BURST must be an integer"):
        knobs.get_int("NAKTA_PREFILL_BURST")
    monkeypatch.setenv("NAKTA_SHARED_DATA", "~/data")
    assert knobs.get_path("NAKTA_SHARED_DATA") == Path("~/data").expanduser()
    monkeypatch.setenv("NAKTA_KERNELS", "triton")
    assert knobs.get_str("NAKTA_KERNELS") == "triton"
    assert knobs.raw("NAKTA_KERNELS") == "triton"
    with pytest.raises(KeyError, match="not a declared knob"):
        knobs.get_bool("NAKTA_NOT_A_KNOB")
    with pytest.raises(TypeError, match="NAKTA_KERNELS is a str knob"):
        knobs.get_int("NAKTA_KERNELS")
