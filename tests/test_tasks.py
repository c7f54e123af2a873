"""HellaSwag loading, preprocessing, request tokenization and metrics, as lm-eval does them.

Checked against the behaviour documented in shared/data/README.md section 4 on the real rows,
and (when lm-eval is installed) against lm-eval's own ``process_docs`` and ``_encode_pair``.

One file for the offline tasks (nakta_model.tasks, accuracy_test/tasks): HellaSwag here, then the
MMLU-shaped group and the full GSM8K-shaped task.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from nakta_model.tasks import hellaswag as hs


@pytest.fixture
def subset(shared_data):
    path = shared_data / "hellaswag_val_subset1000.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return rows, hs.load_jsonl(path)


def test_preprocess_rules():
    assert hs.preprocess("  a [header] b  ") == "a b"
    assert hs.preprocess("Do it [title] Next step") == "Do it. Next step"
    assert hs.preprocess("[title] Start here.") == " Start here."  # strip happens first
    assert hs.preprocess("x [step] [substeps] y") == "x  y"  # one pass of "  " -> " "


def test_subset_matches_documented_counts(subset):
    rows, docs = subset
    assert len(docs) == 1000
    assert sum(c.startswith(" ") for d in docs for c in d.choices) == 134
    assert not any(d.query != d.query.strip() for d in docs)
    assert [d.label for d in docs] == [int(r["label"]) for r in rows]
    assert [d.ind for d in docs] == [r["ind"] for r in rows]


def test_title_ending_keeps_leading_space_and_ctx_b_capitalised(subset):
    rows, docs = subset
    row, doc = next((r, d) for r, d in zip(rows, docs) if r["ind"] == 670)
    assert row["endings"][0].startswith("[title] If you're outside")
    assert doc.choices[0].startswith(" If you're outside")
    assert doc.choices[0].endswith(
        "dribble.. If you're inside, the batsman lets you line up the batsman with you."
    )
    assert hs.doc_requests(doc)[0][1].startswith("  If")  # delimiter + kept space
    assert row["ctx_b"] == ""  # empty ctx_b: the trailing space is stripped
    assert doc.query.endswith("ball by rotating the fingers.")
    first = docs[0]  # ind 20022, ctx_b "a few women"
    assert first.query == (
        "Pole vault: Pole vault is a sport where you run with a pole and stop and swing "
        "your body. A few women"
    )


def test_full_file_differs_only_by_capitalisation_and_leading_space(shared_data, subset):
    rows, docs = subset
    positions = {}
    tsv = (shared_data / "hellaswag_val_subset1000_positions.tsv").read_text().splitlines()
    for line in tsv[1:]:
        ind, pos = line.split("\t")
        positions[int(ind)] = int(pos)
    full = hs.load_jsonl(shared_data / "hellaswag_val_full.jsonl")
    assert len(full) == 10042
    assert full[0].query.startswith("Roof shingle removal: A man is sitting on a roof. he")
    n_query = n_end = 0
    for doc in docs:
        f = full[positions[doc.ind]]
        assert f.label == doc.label
        n_query += f.query != doc.query
        assert f.query.lower() == doc.query.lower()
        for a, b in zip(f.choices, doc.choices):
            if a != b:
                assert b == " " + a
                n_end += 1
    assert (n_query, n_end) == (913, 134)


def test_load_limit_and_errors(tmp_path, shared_data):
    assert len(hs.load_jsonl(shared_data / "hellaswag_val_full.jsonl", limit=7)) == 7
    with pytest.raises(ValueError, match="not a file"):
        hs.load_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="limit"):
        hs.load_jsonl(shared_data / "hellaswag_val_full.jsonl", limit=0)
    with pytest.raises(ValueError, match="neither"):
        hs.process_doc({"endings": ["a"], "label": 0})
    with pytest.raises(ValueError, match="label"):
        hs.process_doc({"ctx": "q", "endings": ["a", "b"], "label": 2})
    with pytest.raises(TypeError, match="row"):
        hs.process_doc(["ctx"])


def test_matches_lm_eval_process_docs(subset):
    """lm-eval's own hellaswag utils give the same query/choices on all 1,000 rows."""
    utils = pytest.importorskip("lm_eval.tasks.hellaswag.utils")
    datasets = pytest.importorskip("datasets")
    rows, docs = subset
    cols = ["activity_label", "ctx_a", "ctx_b", "endings", "label"]
    ds = datasets.Dataset.from_list([{k: r[k] for k in cols} for r in rows])
    theirs = utils.process_docs(ds)
    for d, t in zip(docs, theirs):
        assert (d.query, list(d.choices), d.label) == (t["query"], t["choices"], t["gold"])


def test_encode_pair_moves_trailing_space():
    enc = lambda s: [1] + [ord(ch) for ch in s]  # a char-level "tokenizer" with BOS
    ctx, cont = hs.encode_pair(enc, "ab  ", "cd")
    assert ctx == [1, ord("a"), ord("b")]
    assert cont == [ord(" "), ord(" "), ord("c"), ord("d")]


def test_requests_with_llama_tokenizer_match_lm_eval(shared_data, subset):
    """Token requests equal lm-eval's ``TemplateLM._encode_pair`` with the same encoder."""
    _, docs = subset
    encode = hs.sentencepiece_encoder(shared_data / "llama_tokenizer.model")
    reqs = hs.build_requests(docs[:50], encode)
    assert len(reqs) == 200
    ctx0, cont0 = reqs[0]
    assert ctx0[0] == 1 and cont0[0] != 1  # BOS once, at the start of the context
    assert ctx0 == encode(docs[0].query)
    assert [r[0] for r in reqs[:4]] == [ctx0] * 4  # the 4 endings share the context tokens
    model_mod = pytest.importorskip("lm_eval.api.model")

    class _Enc(model_mod.TemplateLM):
        eot_token_id = 2

        def tok_encode(self, string, add_special_tokens=None, **kw):
            return encode(string)

        def _loglikelihood_tokens(self, requests, **kw):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            raise NotImplementedError

        def generate_until(self, requests, disable_tqdm=False):
            raise NotImplementedError

    lm = _Enc()
    want = [lm._encode_pair(c, x) for d in docs[:50] for c, x in hs.doc_requests(d)]
    assert [tuple(map(list, w)) for w in want] == [tuple(r) for r in reqs]


def test_metrics_normalise_by_characters_not_bytes():
    doc = hs.Doc(query="q", choices=("ééé", "abcd"), label=1)
    r = hs.score_doc(doc, [-3.3, -4.0])
    assert r.pred == 0  # raw: -3.3 > -4.0
    assert r.pred_norm == 1  # per char: -1.1 < -1.0 (per byte it would be 0: -0.55 > -1.0)
    metrics, results = hs.evaluate([doc, doc], [-3.3, -4.0, -5.0, -1.0])
    assert metrics == {"acc": 0.5, "acc_norm": 1.0}
    assert [x.pred for x in results] == [0, 1]
    assert hs.score_doc(doc, [-1.0, -1.0]).pred == 0  # ties: first wins (numpy argmax)
    with pytest.raises(ValueError, match="lls"):
        hs.evaluate([doc], [1.0])


def test_llamacpp_text_file_equals_full_jsonl(shared_data):
    txt = hs.load(shared_data / "hellaswag_val_full.txt.bz2")
    full = hs.load(shared_data / "hellaswag_val_full.jsonl")
    assert len(txt) == 10042
    assert txt == full
    assert hs.load(shared_data / "hellaswag_val_full.txt.bz2", limit=3) == full[:3]


# ------------------------------------------------------------------ validation while loading

_GOOD = {"ind": 5, "ctx": "A man is sitting on a roof. he", "endings": ["a", "b"], "label": 1}
_ORIG = {"activity_label": "Roof", "ctx_a": "A man sits.", "ctx_b": "he", "endings": ["a", "b"],
         "label": "0"}  # fmt: skip


def _jsonl(tmp_path, *lines) -> str:
    path = tmp_path / "hs.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(
    "bad, match",
    [
        ('{"ctx": "q", "endings": ["a"], ', r"line 3: not valid JSON"),
        ("[1, 2]", r"line 3: expected a JSON object, got list"),
        (json.dumps({k: v for k, v in _ORIG.items() if k != "activity_label"}),
         r"line 3: missing field 'activity_label'"),
        (json.dumps({**_ORIG, "ctx_b": None}), r"line 3: field 'ctx_b' must be a string"),
        (json.dumps({**_GOOD, "endings": ["a", ""]}), r"line 3: field 'endings'\[1\] is empty"),
        (json.dumps({**_ORIG, "endings": ["a", "[header]"]}),
         r"line 3: field 'endings'\[1\] is empty after preprocessing \(was '\[header\]'\)"),
        (json.dumps({**_GOOD, "endings": []}), r"line 3: field 'endings' must be a non-empty list"),
        (json.dumps({**_GOOD, "endings": "ab"}), r"line 3: field 'endings' must be a non-empty"),
        (json.dumps({**_GOOD, "endings": ["a", 2]}), r"line 3: field 'endings'\[1\] must be a str"),
        (json.dumps({**_GOOD, "label": 2}), r"line 3: field 'label' = 2 out of range for 2"),
        (json.dumps({**_GOOD, "label": -1}), r"line 3: field 'label' = -1 out of range"),
        (json.dumps({**_GOOD, "label": 1.5}), r"line 3: field 'label' must be an int, got 1.5"),
        (json.dumps({**_GOOD, "label": True}), r"line 3: field 'label' must be an int"),
        (json.dumps({**_GOOD, "label": "one"}), r"line 3: field 'label' must be an int"),
        (json.dumps({k: v for k, v in _GOOD.items() if k != "label"}),
         r"line 3: missing field 'label'"),
        (json.dumps({**_GOOD, "ind": "x"}), r"line 3: field 'ind' must be an int"),
    ],
)  # fmt: skip
def test_bad_rows_name_file_line_and_field(tmp_path, bad, match):
    path = _jsonl(tmp_path, json.dumps(_GOOD), "", bad, json.dumps(_GOOD))
    with pytest.raises(ValueError, match=f"^{re.escape(path)} " + match):
        hs.load(path)


def test_valid_rows_of_both_schemas_load_with_string_labels(tmp_path):
    docs = hs.load(_jsonl(tmp_path, json.dumps(_ORIG), json.dumps({**_GOOD, "label": "1"})))
    assert docs[0] == hs.Doc("Roof: A man sits. He", ("a", "b"), 0)
    assert docs[1] == hs.Doc(_GOOD["ctx"], ("a", "b"), 1, ind=5)


def test_empty_files_are_refused(tmp_path):
    for name, text in (("e.jsonl", ""), ("blank.jsonl", "\n  \n"), ("e.txt", "")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=f"{re.escape(str(tmp_path / name))}: no HellaSwag"):
            hs.load(tmp_path / name)


def _txt(tmp_path, lines) -> str:
    path = tmp_path / "hs.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(
    "task2, match",
    [
        (["ctx", "1", "a", "", "c", "d"], r"line 10: ending 1 is empty"),
        (["ctx", "x", "a", "b", "c", "d"], r"line 8: label must be an int in \[0, 4\), got 'x'"),
        (["ctx", "4", "a", "b", "c", "d"], r"line 8: label must be an int in \[0, 4\), got '4'"),
    ],
)
def test_llamacpp_text_errors_name_the_line(tmp_path, task2, match):
    path = _txt(tmp_path, ["q: ctx", "0", "a", "b", "c", "d", *task2])
    with pytest.raises(ValueError, match=f"^{re.escape(path)} " + match):
        hs.load(path)
    assert len(hs.load(_txt(tmp_path, ["q: ctx", "0", "a", "b", "c", "d"]))) == 1


def test_docs_are_checked_on_construction_and_evaluate_needs_docs():
    with pytest.raises(ValueError, match=r"choices\[1\] must be a non-empty str"):
        hs.Doc("q", ("a", ""), 0)  # acc_norm would divide by zero after the whole run
    with pytest.raises(ValueError, match="choices must be a non-empty tuple"):
        hs.Doc("q", (), 0)
    with pytest.raises(ValueError, match="label 2 out of range for 2 choices"):
        hs.Doc("q", ("a", "b"), 2)
    with pytest.raises(ValueError, match="docs is empty"):
        hs.evaluate([], [])


# ------------------------------------------------------------------------------------------------
# The ``mmlu_shaped_local`` group, one yaml with its 57 subjects inline, builds the very requests
# the 57 per-subject yaml files (one shared template) built before: same prompts, shots, choices
# and order. lm-eval 0.4.13 names an inline subtask ``<group>::<task>``, so the subject names are
# compared with that prefix taken off.
# ------------------------------------------------------------------------------------------------


TASKS = Path(__file__).resolve().parents[1] / "accuracy_test" / "tasks"

# sha256 of [(task, doc_id, idx, arguments)] for the first test question of every subject,
# computed from the 57 per-subject files (git: accuracy_test/tasks/mmlu_shaped_local/ before
# the inline group) with lm-eval 0.4.13.
OLD_REQUESTS_SHA256 = "d535f218a37b6889652fa3bf10de7c4d58bfa1a97e3f834c59616a942eb633cb"


def _group():
    import lm_eval.tasks

    manager = lm_eval.tasks.TaskManager(include_path=str(TASKS), include_defaults=False)
    return manager, manager.load(["mmlu_shaped_local"])


def test_the_group_holds_57_subjects_with_the_old_names_aliases_and_prompts():
    manager, loaded = _group()
    assert "mmlu_shaped_local" in manager.all_groups
    tasks = loaded["tasks"]
    assert len(tasks) == 57
    subjects = [name.removeprefix("mmlu_shaped_local::mmlu_shaped_") for name in tasks]
    assert subjects[0] == "abstract_algebra" and subjects[-1] == "world_religions"
    for subject, task in zip(subjects, tasks.values(), strict=True):
        c = task.config
        assert c.task_alias == subject and c.dataset_kwargs == {"subject": subject}
        about = subject.replace("_", " ")
        assert c.description == (
            f"The following are multiple choice questions (with answers) about {about}.\n\n"
        )
        assert (c.num_fewshot, c.fewshot_split, c.test_split) == (5, "dev", "test")
        assert [m["metric"] for m in c.metric_list] == ["acc"]
        assert c.metadata["version"] == 1.0
    group = loaded["groups"]["mmlu_shaped_local"]
    agg = group.aggregate_metric_list
    assert [(a.metric, a.weight_by_size) for a in agg] == [("acc", True)]
    assert float(group.version) == 1.0


def test_the_requests_are_those_of_the_old_per_subject_files():
    _, loaded = _group()
    out = []
    for name, task in loaded["tasks"].items():
        task.build_all_requests(limit=1)
        old_name = name.removeprefix("mmlu_shaped_local::")
        out += [(old_name, i.doc_id, i.idx, list(i.arguments)) for i in task.instances]
    assert len(out) == 57 * 4  # one question, four choices, per subject
    assert hashlib.sha256(json.dumps(out).encode()).hexdigest() == OLD_REQUESTS_SHA256


# ------------------------------------------------------------------------------------------------
# ``gsm8k_shaped_full_local``: GSM8K's test-split size (1,319 problems) of the GSM8K-shaped task,
# deterministic, its first 250 problems and every prompt the 250-doc task's own.
# ------------------------------------------------------------------------------------------------


def _tasks():
    import lm_eval.tasks

    manager = lm_eval.tasks.TaskManager(include_path=str(TASKS), include_defaults=False)
    return manager.load(["gsm8k_shaped_full_local", "gsm8k_shaped_local"])["tasks"]


def test_full_task_has_gsm8ks_size_and_the_small_tasks_docs_first():
    pytest.importorskip("lm_eval")
    from nakta_model.tasks.shaped import GSM8K_TEST_SIZE, gsm8k_docs

    tasks = _tasks()
    full, small = tasks["gsm8k_shaped_full_local"], tasks["gsm8k_shaped_local"]
    full_docs, small_docs = list(full.test_docs()), list(small.test_docs())
    assert GSM8K_TEST_SIZE == 1319
    assert len(full_docs) == 1319 and len(small_docs) == 250
    assert full_docs[:250] == small_docs
    assert len({d["question"] for d in full_docs}) > 1300  # not one problem repeated
    assert (
        full_docs
        == gsm8k_docs("test", 1319)
        == list(_tasks()["gsm8k_shaped_full_local"].test_docs())
    )
    assert list(full.fewshot_docs()) == list(small.fewshot_docs()) == gsm8k_docs("train")
    for key in ("generation_kwargs", "num_fewshot", "doc_to_text", "fewshot_delimiter"):
        assert getattr(full.config, key) == getattr(small.config, key), key
    assert full.config.generation_kwargs["max_gen_toks"] == 256
    assert "Question:" in full.config.generation_kwargs["until"]


def test_full_task_builds_the_same_8_shot_requests():
    pytest.importorskip("lm_eval")
    tasks = _tasks()
    got = {}
    for name in ("gsm8k_shaped_full_local", "gsm8k_shaped_local"):
        task = tasks[name]
        task.build_all_requests(limit=3)
        got[name] = [(i.doc_id, i.arguments) for i in task.instances]
    assert (
        got["gsm8k_shaped_full_local"] == got["gsm8k_shaped_local"]
        and len(got["gsm8k_shaped_local"]) == 3
    )
    context = got["gsm8k_shaped_local"][0][1][0]
    assert context.count("Question:") == 9 and context.endswith("Answer:")  # 8 shots + the problem
