"""kvq: a research harness for KV-cache quantization of LLMs."""

__version__ = "0.1.0"
