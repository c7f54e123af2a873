"""Measurement helpers shared by kernel_benchmark/, speed_bench/ and model_profile/."""
