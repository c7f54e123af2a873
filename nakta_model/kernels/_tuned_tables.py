"""The one reader of the kernels' tuned launch-config files (``_*_tuned.json``).

Every file has the shape the tuners write (``kernel_benchmark/tune_fp8_decode.write_family``):
``{"devices": {family: {"entries": {key: {knob: int}}, ...}}}``. The kernels differ only in
how a key reads (``parse_key``) and which knobs a row holds; a malformed file is refused with
a ValueError naming it, never half-read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

__all__ = ["read_tuned"]


def read_tuned(
    path: Path,
    what: str,
    parse_key: Callable[[str], object],
    knobs: Sequence[str],
    defaults: Mapping[str, int] | None = None,
) -> dict[str, dict]:
    """``{family: {parse_key(key): {knob: int}}}`` of the file at ``path``; {} when absent.
    ``defaults`` fill knobs added after rows were written; ``parse_key`` raises ValueError for
    a key it does not take. Errors read ``"<path>: not a <what> config file (...)"``."""
    if not path.is_file():
        return {}
    try:
        tables: dict[str, dict] = {}
        for family, block in json.loads(path.read_text())["devices"].items():
            table = tables.setdefault(str(family), {})
            for key, cfg in block["entries"].items():
                cfg = {**(defaults or {}), **cfg}
                if set(cfg) != set(knobs):
                    raise ValueError(f"entry {key!r}: expected the knobs {tuple(knobs)}")
                table[parse_key(key)] = {name: int(cfg[name]) for name in knobs}
    except (ValueError, KeyError, TypeError, AttributeError) as ex:
        raise ValueError(f"{path}: not a {what} config file ({ex})") from ex
    return tables
