"""Triton kernels, one file per operation (see ../shared/DESIGN.md, "Kernel files").

An op file reads top to bottom: kernels, launch configuration, input checks and launchers, the
autograd function (where a backward exists), public functions, the ``*_reference`` twin. The two
ops whose kernels alone run to hundreds of lines keep them in ``_<op>_kernels.py`` (rmsnorm,
decode_linear). Shared by all: ``_triton_math`` (device helpers: rounding, libdevice functions,
SiLU, RoPE pairs) and ``_checks`` (host-side input checks).

Launch configuration, the same idiom in every op file: ``_CONFIGS`` maps what the values depend
on (the kernel, a row width, dtype and batch bucket, a head dim) to a dict of launch values
(``BLOCK_*`` constexprs, ``num_warps``, ``num_stages``, and the knobs of a launch rule);
``_config(...)`` picks the entry for one call and derives what depends on the shape; ``_TUNE``
(empty) overrides any key, set only by the benchmarks (``kernel_benchmark.common.tuned``) and
the tests.
"""
