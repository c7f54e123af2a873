"""The front door stays short and its links stay true: README.md within 300 lines, the two
set-up commands in it exactly as CI and users run them, and every relative link of README.md and
docs/*.md (and of the results folders' indexes) naming a file or folder that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SETUP_COMMANDS = (
    'pip install -e ".[eval,hf]" && python -m speed_bench.run_all',
    'pip install -e ".[test,eval,hf]" && python -m pytest -q -n 2',
)
# [text](target) and [text](target "title"); images too. Code spans are dropped first, so a
# link written inside backticks as an example is not checked.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_BLOCK = re.compile(r"^```.*?^```", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def _markdown_files() -> list[Path]:
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    for bench in ("speed_bench", "kernel_benchmark", "model_profile", "accuracy_test"):
        pages += sorted((ROOT / bench / "results").glob("**/README.md"))
    return pages


def relative_links(text: str) -> list[str]:
    """The relative link targets of a markdown text, anchors and queries cut off."""
    text = _CODE_SPAN.sub("", _CODE_BLOCK.sub("", text))
    targets = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # http:, mailto:, an anchor in the same page
        path = target.split("#", 1)[0].split("?", 1)[0]
        if path:
            targets.append(path)
    return targets


def test_readme_is_at_most_300_lines():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= 300, f"README.md has {n} lines; move detail into docs/"


@pytest.mark.parametrize("command", SETUP_COMMANDS)
def test_readme_holds_the_setup_commands(command):
    assert command in README.read_text(encoding="utf-8")


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "python3 -m pytest -q -n 2\n" in ci
    assert "python3 -m pytest -q -m slow" in ci  # the tier the default leaves out


@pytest.mark.parametrize("page", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_names_an_existing_file(page):
    missing = [
        t
        for t in relative_links(page.read_text(encoding="utf-8"))
        if not (page.parent / t).exists()
    ]
    assert not missing, f"{page.relative_to(ROOT)} links to missing paths: {missing}"


def test_the_link_finder_sees_links_and_skips_urls_anchors_and_code():
    text = (
        "[a](docs/x.md#part) ![img](p.png) [web](https://x.org) [here](#top)\n"
        '`[not](code.md)`\n```\n[block](no.md)\n```\n[t](y.md "title")'
    )
    assert relative_links(text) == ["docs/x.md", "p.png", "y.md"]


def test_results_folders_hold_the_catalogue_only():
    """Superseded runs and A/B folders leave the tree (git keeps them): the committed result
    files stay few enough that every one is the current result an index names."""
    import shutil
    import subprocess

    if not (shutil.which("git") and (ROOT / ".git").exists()):
        pytest.skip("needs a git checkout")
    files = subprocess.run(
        ["git", "ls-files", "--", "*/results/*"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    assert 0 < len(files) <= 145, len(files)  # 135 at the last prune: room for a few new runs
    assert not [f for f in files if "_ab/" in f or "/ab/" in f], "A/B folders belong in git history"
