"""model_profile.compile_profile: what a first run compiles, named.

The GPU run itself needs CUDA; here: the argument checks and how a compile is named."""

from __future__ import annotations

import pytest
from triton.compiler import ASTSource

from model_profile.compile_profile import parse_args, specialization
from nakta_model.kernels.packed_attention import _packed_attention_kernel


@pytest.mark.parametrize(
    ("argv", "match"),
    [(["--phases", "score,train"], "--phases takes"), (["--prompts", "0"], "--prompts must be")]
    + [(["--shared-prefix", "925"], "--shared-prefix must be in")],
)
def test_bad_arguments_are_refused(argv, match, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert match in capsys.readouterr().err


def test_a_compile_is_named_by_its_constexprs_and_specialised_arguments():
    names = list(_packed_attention_kernel.arg_names)
    src = ASTSource(
        _packed_attention_kernel, {n: "i32" for n in names}, constexprs={"TREE": True, "N_Q": 32},
        attrs={(names.index("stride_qt"),): [["tt.divisibility", 16]]},
    )  # fmt: skip
    assert specialization(src) == "TREE=True N_Q=32 stride_qt:16"
