"""decode_linear's launch configurations against the hardware they run on, without a GPU."""

from __future__ import annotations


def test_derived_tensor_core_configs_fit_hoppers_shared_memory():
    """Every derived or tuned tensor-core config of the 7B / 13B step shapes keeps its pipelined
    tiles within ``SMEM_BUDGET`` (an H200 refused the 7B LM head's derived 4-stage 128 x 256
    tile at 2, 4 and 16 rows: 296 KB asked, 227 KiB allowed); tiles stay as derived."""
    import torch

    from nakta_model.kernels import decode_linear as dl

    shapes = [("plain", 32000, 4096), ("rope", 12288, 4096), ("swiglu", 11008, 4096),
              ("residual", 4096, 11008), ("residual", 4096, 4096), ("plain", 32000, 5120),
              ("rope", 15360, 5120), ("swiglu", 13824, 5120), ("residual", 5120, 13824)]  # fmt: skip
    lowered = 0
    for batch in (2, 4, 8, 16, 32, 64):
        for variant, n, k in shapes:
            for w_dtype in (None, torch.float8_e4m3fn):
                c = dl._config(torch.bfloat16, batch, n, k, variant, torch.device("cpu"), w_dtype)
                if not c["USE_DOT"]:
                    continue
                w_bytes = 1 if w_dtype else 2
                stage = c["BLOCK_K"] * (c["BLOCK_M"] * 2 + c["TILE_N"] * w_bytes)
                assert c["num_stages"] * stage <= dl.SMEM_BUDGET or c["num_stages"] == 2
                assert c["num_stages"] >= 2
                lowered += (c["num_stages"] + 1) * stage > dl.SMEM_BUDGET
    assert lowered  # the 7B head's derived rows are among them
    head = dl._config(torch.bfloat16, 2, 32000, 4096, "plain", torch.device("cpu"))
    assert (head["BLOCK_N"], head["BLOCK_K"], head["num_stages"]) == (128, 256, 3)
