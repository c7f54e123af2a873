"""The house's arrows, read from the source (every import statement, function-level ones too):
CLIs -> nakta_model -> kernels, no import cycle anywhere (inside a folder or across folders:
a bench and its tuner, the speed_bench engines and the scripts that time them share a lower
layer instead), llama_org and nakta_model independent, the bench helpers and the CLIs outside
the user package.

    python tests/test_structure.py        # prints nakta_model's import graph

Here too, the rest of the house's shape: no source file over 800 lines, every GPU script under
scripts/ parses with the settings it names, and the tests' own tiers (``tiers.slow_beyond``).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
from tiers import slow_beyond

REPO = Path(__file__).resolve().parents[1]
TOP = (
    "nakta_model",
    "llama_org",
    "bench_common",
    "kernel_benchmark",
    "speed_bench",
    "accuracy_test",
    "model_profile",
)
OUTSIDE_THE_PACKAGE = {t for t in TOP if t != "nakta_model"} | {"convert"}


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the project (results/ folders hold data only)."""
    out = {"convert": REPO / "convert.py"}
    for top in TOP:
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            if "results" in rel.parts:
                continue
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


def _imported(node: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The project modules one import statement names."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, base] if base else package)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    found = set()
    for name in names:
        while name and name not in known:  # `import a.b.c` of a package: its longest module
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (itself excluded)."""
    modules = _modules()
    known = set(modules)
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _imported(node, module, is_package, known)
        graph[module] = edges - {module}
    return graph


def _top(module: str) -> str:
    return module.split(".")[0]


def _cycle(graph: dict[str, set[str]], nodes: set[str]) -> list[str] | None:
    """One import cycle among ``nodes``, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph[n] & nodes):
            if state.get(m) == 1:
                return path[path.index(m) :] + [m]
            if m not in state and (found := visit(m)):
                return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(nodes):
        if n not in state and (found := visit(n)):
            return found
    return None


GRAPH = import_graph()


def _edges(source, target) -> list[str]:
    return sorted(
        f"{a} -> {b}" for a, deps in GRAPH.items() for b in deps if source(a) and target(b)
    )


def test_the_graph_sees_the_known_arrows():
    """The reader works: arrows that exist are found (function-level imports included)."""
    assert {"nakta_model.model", "nakta_model.sources"} <= GRAPH["nakta_model.loading"]
    assert "nakta_model.checkpoint" in GRAPH["nakta_model.parallel"]  # validate_grid, lazily
    assert "nakta_model.kernels.rope" in GRAPH["nakta_model.model"]
    assert {"nakta_model.checkpoint", "nakta_model.sources"} <= GRAPH["convert"]


def test_every_package_of_the_repo_is_read():
    """A new top-level package joins the graph (and so the cycle check) or this fails."""
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")}
    assert packages == set(TOP), sorted(packages ^ set(TOP))


def test_no_import_cycle_anywhere():
    """Over every module of the tree: no two files (or longer loops) import each other."""
    cycle = _cycle(GRAPH, set(GRAPH))
    assert cycle is None, " -> ".join(cycle)


@pytest.mark.parametrize("top", [*TOP, "convert"])
def test_no_import_cycle_inside_each_folder(top):
    """Per folder, so a failure names where the loop is."""
    cycle = _cycle(GRAPH, {m for m in GRAPH if _top(m) == top})
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph, set(graph)) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}, {"a", "b"}) is None


def test_speed_bench_engines_sit_below_the_scripts():
    """The engines (and their API) never import a speed script; the scripts use them."""
    engines = {
        "speed_bench.engine_api", "speed_bench.engines", "speed_bench.nakta_engine",
        "speed_bench.llama_engine", "speed_bench.hf_engine", "speed_bench.run_measure",
    }  # fmt: skip
    scripts = {"speed_bench.run_all", "speed_bench.nakta_speed", "speed_bench.llama_speed"}
    scripts |= {"speed_bench.hf_speed", "speed_bench.decode_speed"}
    assert _edges(lambda m: m in engines, lambda m: m in scripts) == []


def test_no_import_cycle_inside_nakta_model():
    nodes = {m for m in GRAPH if _top(m) == "nakta_model"}
    assert _cycle(GRAPH, nodes) is None, " -> ".join(_cycle(GRAPH, nodes))
    assert "nakta_model.loading" not in GRAPH["nakta_model.model"]
    assert "nakta_model.model" not in GRAPH["nakta_model.parallel"]


def test_nakta_model_imports_nothing_of_the_rest_of_the_house():
    inside = lambda m: _top(m) == "nakta_model"  # noqa: E731
    assert _edges(inside, lambda m: _top(m) in OUTSIDE_THE_PACKAGE) == []


def test_llama_org_and_nakta_model_never_import_each_other():
    assert _edges(lambda m: _top(m) == "llama_org", lambda m: _top(m) != "llama_org") == []
    assert _edges(lambda m: _top(m) == "nakta_model", lambda m: _top(m) == "llama_org") == []


def test_arrows_point_into_the_kernels_never_out():
    """The one exception is the knob registry, a leaf that imports no project module."""
    kernel = lambda m: m.startswith("nakta_model.kernels")  # noqa: E731
    assert _edges(kernel, lambda m: not kernel(m) and m != "nakta_model.knobs") == []
    assert GRAPH["nakta_model.knobs"] == set()


def test_bench_helpers_and_clis_keep_their_places():
    # bench_common serves the benches and needs only nakta_model's atomic writes
    bench = lambda m: _top(m) == "bench_common"  # noqa: E731
    assert _edges(bench, lambda m: _top(m) not in ("bench_common", "nakta_model")) == []
    # model_profile builds engines through speed_bench's public modules only (the scoring
    # engines, and the throughput benchmark's engines and workload for throughput_profile)
    public = {"speed_bench.engines", "speed_bench.weights", "speed_bench.workload",
              "speed_bench.throughput_engines", "speed_bench.throughput"}  # fmt: skip
    assert (
        _edges(
            lambda m: _top(m) == "model_profile",
            lambda m: _top(m) == "speed_bench" and m not in public,
        )
        == []
    )
    # nobody calls the convert.py script: its logic lives in nakta_model
    assert _edges(lambda m: m != "convert", lambda m: m == "convert") == []


# ------------------------------------------------------------------------------------------------
# No source file of the tree is over 800 lines: files with one job each (DESIGN.md).
#
# Size is a smell past that, not a reason to cut one idea in two: a file that must grow past it is
# split along its jobs, never into ``_<op>_kernels.py`` halves of one kernel.
# ------------------------------------------------------------------------------------------------


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
    assert {"convert.py", "nakta_model/loading.py", "tests/test_structure.py"} <= names


def test_no_source_file_is_over_800_lines():
    long = {
        rel: n
        for p in _sources()
        if (n := _lines(p)) > ONE_IDEA.get(rel := p.relative_to(REPO).as_posix(), MAX_LINES)
    }
    assert long == {}, f"files over {MAX_LINES} lines: {long}"


# ------------------------------------------------------------------------------------------------
# The GPU jobs under scripts/ run only on a lent GPU, where a syntax error or a wrong setting
# costs device time: every script parses (``bash -n``), scripts/ holds the few reproduction
# scripts the docs name, and the throughput job, driven with a fake ``nvidia-smi`` and
# ``python3``, runs the catalogue's command for each setting and archives what it wrote (and
# nothing older).
# ------------------------------------------------------------------------------------------------


SCRIPTS = sorted((REPO / "scripts").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_gpu_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_scripts_are_the_few_reproduction_scripts_the_docs_name():
    names = {p.name for p in (REPO / "scripts").iterdir()}
    assert len(names) <= 8, sorted(names)
    assert {"gpu_env.sh", "fetch_device_wheels.sh"} <= names
    doc = (REPO / "docs" / "benchmarks-and-reproducing.md").read_text(encoding="utf-8")
    for name in names - {"gpu_env.sh"}:
        assert f"scripts/{name}" in doc, name


FAKE_PY = """#!/usr/bin/env bash
echo "$*" >> {calls}
case "$*" in
  *device_slug*) echo fake-gpu ;;
  *speed_bench.throughput*)
    out=$(echo "$*" | sed -E 's/.*--out ([^ ]+).*/\\1/')
    mkdir -p "$out" && echo "| run |" > "$out/throughput.md" ;;
esac
"""


def _run(tmp_path: Path, args: list[str], **env_extra: str):
    work = tmp_path / "repo"
    (work / "scripts").mkdir(parents=True)
    for name in ("gpu_env.sh", "reproduce_throughput.sh"):
        shutil.copy(REPO / "scripts" / name, work / "scripts" / name)
    old = work / "speed_bench" / "results" / "fake-gpu" / "speed.md"  # a committed result
    old.parent.mkdir(parents=True)
    old.write_text("| old |\n")
    bin_dir, calls, out = tmp_path / "bin", tmp_path / "calls.txt", tmp_path / "out"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 'name, memory.used'\n")
    (bin_dir / "python3").write_text(FAKE_PY.format(calls=calls))
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "OUT": str(out), "PATH": f"{bin_dir}:{os.environ['PATH']}", **env_extra}
    proc = subprocess.run(
        ["bash", "scripts/reproduce_throughput.sh", *args], cwd=work, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = calls.read_text().splitlines() if calls.exists() else []
    return proc, [ln for ln in lines if "speed_bench.throughput" in ln], out


@pytest.mark.skipif(not shutil.which("tar"), reason="needs tar")
def test_throughput_job_runs_the_catalogue_command_and_archives_its_files(tmp_path):
    proc, runs, out = _run(tmp_path, [])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(runs) == 1
    assert "--preset 7B --prompts 1000 --input-len 128 --output-len 128" in runs[0]
    assert "--engines nakta,hf --max-batch 64,128,256,384 --hf-batches 128,64" in runs[0]
    assert runs[0].endswith("--out speed_bench/results/fake-gpu/throughput")
    with tarfile.open(out / "throughput.tar.gz") as t:
        assert t.getnames() == ["speed_bench/results/fake-gpu/throughput/throughput.md"]
    assert (out / "throughput_log.txt").is_file()


@pytest.mark.skipif(not shutil.which("tar"), reason="needs tar")
def test_throughput_job_fp8_switch_size_and_bad_job(tmp_path):
    proc, runs, _ = _run(tmp_path / "a", [], QUANT="fp8", SIZE="13B", HF_BATCHES="")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--preset 13B " in runs[0] and "--engines nakta,nakta_fp8 --max-batch 384 " in runs[0]
    assert runs[0].endswith("--out speed_bench/results/fake-gpu/throughput_fp8")
    proc, runs, _ = _run(tmp_path / "b", [], HF_BATCHES="")
    assert "--engines nakta --max-batch 64,128,256,384 --out" in runs[0]  # HF left out
    proc, runs, _ = _run(tmp_path / "c", ["nonsense"])
    assert proc.returncode == 2 and runs == [] and "unknown job nonsense" in proc.stdout


# ------------------------------------------------------------------------------------------------
# ``tiers.slow_beyond``: the default tier keeps exactly the named combinations.
# ------------------------------------------------------------------------------------------------


def test_only_the_named_combinations_stay_fast_and_tuples_fill_several_arguments():
    params = slow_beyond({"a": (1, 2), "b": (3, 4)}, {"x": "x", "y": "y"}, fast={("b", "x")})
    assert [p.id for p in params] == ["a-x", "a-y", "b-x", "b-y"]
    assert [p.values for p in params] == [(1, 2, "x"), (1, 2, "y"), (3, 4, "x"), (3, 4, "y")]
    fast = [p.id for p in params if not any(m.name == "slow" for m in p.marks)]
    assert fast == ["b-x"]


def test_a_fast_name_outside_the_axes_is_refused():
    with pytest.raises(ValueError, match=r"not in the axes: \[\('a', 'z'\)\]"):
        slow_beyond({"a": 1}, {"x": 2}, fast={("a", "z")})


if __name__ == "__main__":
    for module in sorted(m for m in GRAPH if _top(m) == "nakta_model"):
        deps = sorted(d for d in GRAPH[module] if _top(d) == "nakta_model")
        print(f"{module} -> {', '.join(deps) or '-'}")
