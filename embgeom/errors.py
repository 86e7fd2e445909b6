"""Errors of the library, each with a stable machine-readable ``type``.

The web layer maps types to HTTP status codes in one place (``service/errors.py``);
the library never speaks HTTP.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "EmbgeomError", "InvalidInput", "UnknownModel", "ModelLoadError", "NotFound",
    "Overloaded", "StoreUnavailable", "JobFenced", "GenerationDeleted", "CheckTooOld",
    "Conflict", "CheckpointRefused",
]


class EmbgeomError(Exception):
    """Base class: ``type`` is stable, ``message`` is for humans, ``detail`` is data."""

    type = "internal_error"

    def __init__(self, message: str, **detail: Any):
        super().__init__(message)
        self.message = message
        self.detail = detail

    def __reduce__(self):
        # Subclasses take other arguments than ``args`` holds: rebuilt from their state, an
        # error raised in a child process (figures are drawn in one) keeps its type and detail.
        return (_restore, (self.__class__, self.message, self.__dict__))


def _restore(cls, message: str, state: dict) -> EmbgeomError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class InvalidInput(EmbgeomError):
    type = "invalid_input"

    def __init__(self, message: str, type: str = "invalid_input", **detail: Any):
        super().__init__(message, **detail)
        self.type = type


class UnknownModel(EmbgeomError):
    type = "unknown_model"

    def __init__(self, name: str, known: list[str]):
        super().__init__(f"unknown model alias {name!r}; configured: {', '.join(known)}",
                         model=name, known=known)


class ModelLoadError(EmbgeomError):
    type = "model_unavailable"

    def __init__(self, name: str, reason: str):
        super().__init__(f"model {name!r} could not be loaded: {reason}", model=name)
        self.reason = reason


class NotFound(EmbgeomError):
    """Something addressed by the request does not exist; ``type`` says what."""

    def __init__(self, type: str, message: str, **detail: Any):
        super().__init__(message, **detail)
        self.type = type


class Overloaded(EmbgeomError):
    type = "overloaded"


class StoreUnavailable(EmbgeomError):
    type = "store_unavailable"


class JobFenced(EmbgeomError):
    """A worker lost its lease on a job: another worker now owns it."""

    type = "job_fenced"


class GenerationDeleted(EmbgeomError):
    """The collection was deleted while a checkpoint of it was being applied."""

    type = "collection_deleted"


class CheckTooOld(EmbgeomError):
    """A checkpoint write came too long after its in-flight check (a paused worker)."""

    type = "checkpoint_check_expired"


class CheckpointRefused(EmbgeomError):
    """Redis refused a checkpoint's command for a reason a retry does not remove by itself
    (a script error, WRONGTYPE, out of memory under ``noeviction``): the checkpoint is
    given up rather than retried blindly (see :mod:`embgeom.store.checkpoints`)."""

    type = "checkpoint_refused"


class Conflict(EmbgeomError):
    """The request conflicts with the current state; ``type`` says how."""

    def __init__(self, type: str, message: str, **detail: Any):
        super().__init__(message, **detail)
        self.type = type
