"""Hugging Face checkpoints in and out: streaming import, export, dequantization, one conversion table per model family."""
