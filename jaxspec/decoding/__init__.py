"""Decoding on the device: the one while_loop driver, plain and speculative loops, acceptance,
sampling, trees, the drafters and the decode method. Imports jaxspec.model, never above."""
