"""Adapters that put an inference framework's KV cache under kvtier.

Each lives in its own module and imports its framework only there:
``kvtier.integrations.transformers`` needs ``pip install kvtier[transformers]``.
"""
