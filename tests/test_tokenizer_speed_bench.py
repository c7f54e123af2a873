"""The lm-eval speed bench's HF tokenizer folder for Meta's Llama-3 file: ``AutoTokenizer`` on it
encodes HellaSwag as Nakta's tokenizer does (the bench's own agreement check passes) and a
disagreement is refused."""

from __future__ import annotations

import pytest
from tokenizer_assets import DATA, meta_llama3_file

pytest.importorskip("transformers")

from speed_bench import lm_eval_weights  # noqa: E402


def test_llama3_hf_tokenizer_folder_agrees_with_nakta(tmp_path):
    meta = meta_llama3_file()
    hellaswag = DATA / "hellaswag_val_full.jsonl"
    if not hellaswag.is_file():
        pytest.skip(f"{hellaswag} is missing")
    out = lm_eval_weights.write_hf_tokenizer(tmp_path / "hf_tok", meta, 8192)
    assert (out / "tokenizer.json").is_file() and not (out / "tokenizer.model").exists()
    texts = lm_eval_weights._sample_texts(str(hellaswag), n=20)
    lm_eval_weights.check_tokenizers_agree(out, meta, texts)  # raises on any difference
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(out))
    assert (hf.bos_token_id, hf.eos_token_id, len(hf)) == (128000, 128001, 128256)
    llama_sp = DATA / "llama_tokenizer.model"
    if llama_sp.is_file():  # the check is not vacuous: another tokenizer is refused
        with pytest.raises(lm_eval_weights.UsageError, match="disagree on"):
            lm_eval_weights.check_tokenizers_agree(out, llama_sp, texts)
