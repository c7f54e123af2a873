"""``lm_eval`` with Nakta's adapters registered: ``python -m accuracy_test.lm_eval_cli ARGS``.

lm-eval finds models by name in its registry; ``nakta`` and ``llama_org`` are registered when
``accuracy_test.lm_eval_adapter`` is imported, which the plain ``lm_eval`` command never does.
This wrapper imports it, then hands the command line to lm-eval's own CLI unchanged, e.g.

    python -m accuracy_test.lm_eval_cli --model nakta \\
        --model_args checkpoint=DIR,tokenizer=FILE,dtype=bf16 \\
        --include_path accuracy_test/tasks --tasks hellaswag_local --batch_size 64
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    from lm_eval.__main__ import cli_evaluate

    import accuracy_test.lm_eval_adapter  # noqa: F401  (registers "nakta" and "llama_org")

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
