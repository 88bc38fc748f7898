"""Typed errors: every user mistake surfaces as one of these, with a one-line message."""


class WallbreakerError(Exception):
    """Base of every error wallbreaker raises on purpose."""


class ModelNotFoundError(WallbreakerError):
    """The model path does not exist, or the default model's package is not installed."""


class ModelFormatError(WallbreakerError):
    """A model file is truncated, corrupted, or not what its header says."""


class UnsupportedModelError(WallbreakerError):
    """The file is well formed but uses an architecture or tensor type we do not run."""


class InvalidRequestError(WallbreakerError, ValueError):
    """A request the engine cannot serve: bad sampling parameters, empty or too-long prompt. `param`
    names the request's field at fault where it is not the prompt (the server's error says it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class WorkerFailedError(WallbreakerError):
    """A tensor-parallel rank died, hung past the collective timeout, or failed to start; the engine has shut down."""


class EngineError(WallbreakerError):
    """A model step failed on a request's own sequence; the engine goes on with the others."""
