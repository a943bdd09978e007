"""One conversion table per model family (Hugging Face <-> Megatron-Core names, transforms, config
translation), as data for :mod:`recipes.hf.rules`."""
