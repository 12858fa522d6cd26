"""Integrations of sparsa with other libraries (transformers: sparsa.integrations.transformers)."""
