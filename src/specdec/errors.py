"""Typed errors. Every message names what is wrong; the CLI prints it on one line, the server maps it to 4xx."""

from __future__ import annotations


class SpecdecError(Exception):
    """Base of every error specdec raises on purpose."""


class ModelLoadError(SpecdecError):
    """A checkpoint directory is missing, incomplete or not loadable."""


class VocabMismatchError(SpecdecError):
    """Target and draft do not share one vocabulary."""


class InvalidRequestError(SpecdecError, ValueError):
    """A generation request has a bad argument (the message names the argument)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """The prompt (plus the tokens asked for) does not fit the model's context window."""


class UnsupportedError(SpecdecError):
    """A feature the request asks for is not supported (e.g. batch size > 1)."""
