"""The public path of suffix drafting settings (`from jaxspec.suffix import Suffix`); the drafter
lives in jaxspec.decoding.suffix."""

from jaxspec.decoding.suffix import Suffix, SuffixDrafter

__all__ = ["Suffix", "SuffixDrafter"]
