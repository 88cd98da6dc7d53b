"""Serving requests: validation, padded batches, the static and continuous schedulers, completions
and their statistics, and generate(). Imports jaxspec.decoding and jaxspec.model, never above."""
