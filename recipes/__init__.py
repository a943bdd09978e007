"""Model recipes (TransformerConfig builders) and the fine-tuning entry point."""
