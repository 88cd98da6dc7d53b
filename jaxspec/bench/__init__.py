"""Benchmarks and their workloads (`jaxspec bench`). Nothing in the engine imports them; only the
command line does."""
