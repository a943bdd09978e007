"""Compatibility layers between megatron-llep and the Megatron-Core versions it supports."""
