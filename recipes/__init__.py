"""The entry points (fine-tune, pretrain on Megatron-LM's loop, evaluate, generate, CAP's pipeline, Hugging
Face import/export, corpus and indexed-dataset builders) at the top; ``runtime/`` what they share,
``models/`` the model configs, ``hf/`` the Hugging Face conversion, ``data/`` the shipped data."""
