"""Synthetic evaluation data with the shapes of standard lm-eval tasks, for speed benchmarks.

Datasets cannot be downloaded here, and speed depends on the lengths and the prompt structure
(which parts of the prompts repeat), not on the words. These generators make deterministic
pseudo-English with those shapes:

* MMLU: 57 subjects; each has 5 dev questions (the fixed 5-shot prefix, lm-eval's
  ``sampler: first_n``) and 100-250 test questions; a question with its 4 options is ~60-150
  LLaMA tokens, so a 5-shot prompt is ~500-700 tokens shared by every question of the subject.
* BBH: a fixed 3-shot chain-of-thought prefix, then the question; generation stops at "\\n\\n".
* GSM8K: a fixed 8-shot "Question: ... Answer: ..." prefix (~800 tokens), up to 256 new tokens,
  stops at "Question:"; ``GSM8K_TEST_SIZE`` (1,319) problems like GSM8K's test split, of which
  any first ``n`` are the same whatever the count asked for.

Accuracy on this data means nothing (the answers are random); the structure is what matters.
"""

from __future__ import annotations

import random

__all__ = [
    "GSM8K_TEST_SIZE",
    "MMLU_SUBJECTS",
    "bbh_docs",
    "gsm8k_docs",
    "mmlu_docs",
    "sentence",
    "words",
]

MMLU_SUBJECTS = [
    "abstract_algebra",
    "anatomy",
    "astronomy",
    "business_ethics",
    "clinical_knowledge",
    "college_biology",
    "college_chemistry",
    "college_computer_science",
    "college_mathematics",
    "college_medicine",
    "college_physics",
    "computer_security",
    "conceptual_physics",
    "econometrics",
    "electrical_engineering",
    "elementary_mathematics",
    "formal_logic",
    "global_facts",
    "high_school_biology",
    "high_school_chemistry",
    "high_school_computer_science",
    "high_school_european_history",
    "high_school_geography",
    "high_school_government_and_politics",
    "high_school_macroeconomics",
    "high_school_mathematics",
    "high_school_microeconomics",
    "high_school_physics",
    "high_school_psychology",
    "high_school_statistics",
    "high_school_us_history",
    "high_school_world_history",
    "human_aging",
    "human_sexuality",
    "international_law",
    "jurisprudence",
    "logical_fallacies",
    "machine_learning",
    "management",
    "marketing",
    "medical_genetics",
    "miscellaneous",
    "moral_disputes",
    "moral_scenarios",
    "nutrition",
    "philosophy",
    "prehistory",
    "professional_accounting",
    "professional_law",
    "professional_medicine",
    "professional_psychology",
    "public_relations",
    "security_studies",
    "sociology",
    "us_foreign_policy",
    "virology",
    "world_religions",
]
assert len(MMLU_SUBJECTS) == 57
GSM8K_TEST_SIZE = 1319  # problems in GSM8K's test split

_ONSETS = [
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "j",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "w",
    "z",
    "br",
    "cl",
    "dr",
    "fl",
    "gr",
    "pl",
    "st",
    "tr",
    "sh",
    "ch",
]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "nd", "st", "m"]


def _lexicon(n: int = 3000, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    out: set[str] = set()
    while len(out) < n:
        syllables = rng.choice((1, 1, 1, 2, 2))
        out.add(
            "".join(
                rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                for _ in range(syllables)
            )
        )
    return sorted(out)


_LEXICON = _lexicon()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_LEXICON) for _ in range(n))


def sentence(rng: random.Random, lo: int, hi: int, end: str = ".") -> str:
    text = words(rng, rng.randint(lo, hi))
    return text[0].upper() + text[1:] + end


def _rng(*key: object) -> random.Random:
    return random.Random("|".join(map(str, key)))


def mmlu_docs(subject: str, split: str, n: int | None = None) -> list[dict]:
    """``dev`` (5 docs, the few-shot prefix) or ``test`` (100-250 docs, seeded by subject)
    questions: ``{"question", "choices" [4], "answer" int}`` like ``cais/mmlu``."""
    if subject not in MMLU_SUBJECTS:
        raise ValueError(f"subject must be one of the 57 MMLU subjects, got {subject!r}")
    if split not in ("dev", "test"):
        raise ValueError(f"split must be 'dev' or 'test', got {split!r}")
    size = _rng("mmlu-size", subject).randint(100, 250) if split == "test" else 5
    n = size if n is None else min(n, size)
    rng = _rng("mmlu", subject, split)
    docs = []
    for _ in range(n):
        question = " ".join(sentence(rng, 8, 16) for _ in range(rng.randint(1, 2)))
        question = question[:-1] + "?"
        choices = [sentence(rng, 1, 6, end="") for _ in range(4)]
        docs.append({"question": question, "choices": choices, "answer": rng.randrange(4)})
    return docs


def bbh_docs(split: str, n: int = 250) -> list[dict]:
    """``train`` (3 chain-of-thought shots) or ``test`` questions: ``{"input", "target"}``,
    the shots' targets a few reasoning sentences ending in "So the answer is X."."""
    rng = _rng("bbh", split)
    count = 3 if split == "train" else n
    docs = []
    for _ in range(count):
        question = " ".join(sentence(rng, 10, 25) for _ in range(rng.randint(2, 4)))
        steps = " ".join(sentence(rng, 8, 20) for _ in range(rng.randint(3, 6)))
        answer = rng.choice(["(A)", "(B)", "(C)", "(D)", "Yes", "No", "True", "False"])
        docs.append({"input": question, "target": f"{steps} So the answer is {answer}."})
    return docs


def gsm8k_docs(split: str, n: int = 250) -> list[dict]:
    """``train`` (8 shots) or ``test`` word problems: ``{"question", "answer"}`` with answers
    ending in ``#### <number>`` like GSM8K's."""
    rng = _rng("gsm8k", split)
    count = 8 if split == "train" else n
    docs = []
    for _ in range(count):
        parts = [sentence(rng, 4, 9) for _ in range(rng.randint(1, 3))]
        parts.insert(
            rng.randrange(len(parts)), f"It has {rng.randint(2, 99)} {rng.choice(_LEXICON)}."
        )
        question = " ".join(parts)[:-1] + "?"
        steps = " ".join(
            f"{words(rng, rng.randint(3, 8))} {rng.randint(2, 99)} * {rng.randint(2, 9)} = "
            f"<<{rng.randint(2, 900)}>>."
            for _ in range(rng.randint(1, 3))
        )
        docs.append({"question": question, "answer": f"{steps}\n#### {rng.randint(1, 999)}"})
    return docs
