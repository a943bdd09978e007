"""Helpers for running real Megatron-Core MoE layers in multi-process CPU tests and benchmarks."""
