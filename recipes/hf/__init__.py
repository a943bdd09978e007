"""Hugging Face checkpoints in and out: the rules engine (``rules``), one table per model family
(``tables/``), streaming import (``importing``), export (``exporting``), the published precisions
(``quantization``) and the checkpoint files (``checkpoint``); ``python -m recipes.hf`` runs them."""
