"""kvtier: keeps LLM KV-cache blocks in the right memory tier."""

__version__ = "0.1.0"
