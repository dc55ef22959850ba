"""Provides the model description: its shape from a Hugging Face config or a GGUF header, and the
builtin models."""
