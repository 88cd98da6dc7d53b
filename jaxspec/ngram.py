"""The public path of n-gram lookup settings (`from jaxspec.ngram import Ngram`); the drafter lives in
jaxspec.decoding.ngram."""

from jaxspec.decoding.ngram import Ngram, NgramDrafter

__all__ = ["Ngram", "NgramDrafter"]
