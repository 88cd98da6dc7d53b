"""Offline batch jobs: records in, crash-safe output, settings, local and Ray executors, the canary,
summaries and the metrics log. Imports jaxspec.serving and below, never the benchmarks."""
