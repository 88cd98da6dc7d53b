"""Exceptions users can act on: each names the field or file at fault and what is allowed."""


class JaxspecError(ValueError):
    """Base class of every error jaxspec raises for bad input."""


class ConfigError(JaxspecError):
    """A model config.json is missing, malformed or describes an unsupported model."""


class CheckpointError(JaxspecError):
    """A checkpoint file or tensor is missing, unexpected, mis-shaped or corrupt."""


class InputError(JaxspecError):
    """A prompt or a generation setting is outside what is allowed."""
