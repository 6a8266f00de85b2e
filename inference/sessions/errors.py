"""Typed errors of saved sessions.

Every refusal of the sessions package (a state that does not belong to the
caller's tenant, a state saved against another model version, a malformed or
corrupt SES extent, a concurrent save) derives from :class:`SessionError`, an
:class:`~inference.errors.InferenceError`, so the CLI prints it as one line.
"""

from __future__ import annotations

from czyx.inference.errors import InferenceError


class SessionError(InferenceError):
    """Base class of the sessions package's deliberate errors."""


class SessionNotFoundError(SessionError, KeyError):
    """No session of that name (or no saved state at that version) exists."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "session not found"


class SessionExistsError(SessionError):
    """A fork or first save was aimed at a name that already has saved states."""


class SessionConflictError(SessionError):
    """Another writer saved the same session version first; reload and retry."""


class ModelVersionMismatchError(SessionError):
    """The session was saved against a different model version (selector or shapes)."""


class WrongTenantError(SessionError):
    """The session belongs to another tenant than the one asking."""


class SessionFormatError(SessionError):
    """A SES extent or record is malformed: bad magic, version, field or offset."""


class RecurrentCutError(SessionError):
    """A hybrid model's state was asked for at fewer positions than it was saved with.

    Its recurrent (linear-attention) state exists only at the saved length: a
    cut fork or a prefix of it cannot be resumed without reprocessing.
    """
