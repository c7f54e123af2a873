"""model_profile.throughput_profile's pieces that run without a GPU: its argument checks and
the per-kernel table it builds from the profiler's averages."""

from __future__ import annotations

import pytest

from model_profile import throughput_profile as tp


class _Event:
    def __init__(self, key, us, count):
        self.key, self.self_device_time_total, self.count = key, us, count


class _Prof:
    def key_averages(self):
        return [
            _Event("_attn_split_kernel", 300.0, 3),
            _Event("nvjet_sm90_tst_128x64_TNT", 100.0, 2),
            _Event("aten::mm", 100.0, 2),  # a host op: its kernels are counted under their names
            _Event("cudaGraphLaunch", 5.0, 1),
            _Event("_rms_norm_fwd_kernel", 0.0, 4),  # no device time
        ]


def test_kernel_table_counts_device_kernels_only():
    df = tp.kernel_table(_Prof())
    assert list(df["name"]) == ["_attn_split_kernel", "nvjet_sm90_tst_128x64_TNT"]
    assert list(df["category"]) == ["attention", "gemm"]
    assert df["share"].sum() == pytest.approx(1.0)
    assert df.loc[0, "mean_us"] == pytest.approx(100.0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompts", "0"], "--prompts must be >= 1"),
        (["--input-len", "8", "--shared-prefix", "8"], "--shared-prefix must be in"),
        (["--shared-prefix", "-1"], "--shared-prefix must be in"),
    ],
)
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        tp.parse_args(argv)
    assert message in capsys.readouterr().err
