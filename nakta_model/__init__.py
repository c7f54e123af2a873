"""Nakta: a fast, honest LLaMA for scoring benchmarks and generation."""
