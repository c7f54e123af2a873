"""``python -m nakta_model.serve``: the same as ``nakta-serve``."""

from nakta_model.serve.cli import main

main()
