"""Sessions as records: a conversation's KV cache, history and sampler saved as one
SES extent, resumed with zero reprocessing, found by token prefix, forked with lineage.

Modules: :mod:`~inference.sessions.format` (the extent layout),
:mod:`~inference.sessions.prefix` (block prefix hashes and their edges),
:mod:`~inference.sessions.store` (named, versioned states in a store),
:mod:`~inference.sessions.live` (an engine's session: capture, restore,
continue, and ``run_with_session`` for ``czyx run --session``).
"""

from __future__ import annotations

from czyx.inference.sessions.errors import (
    ModelVersionMismatchError,
    SessionConflictError,
    SessionError,
    SessionExistsError,
    SessionFormatError,
    SessionNotFoundError,
    WrongTenantError,
)
from czyx.inference.sessions.format import BLOCK, SessionState
from czyx.inference.sessions.live import LiveSession, SessionRun, run_with_session
from czyx.inference.sessions.store import SessionDiff, SessionInfo, SessionStore, list_sessions

__all__ = [
    "BLOCK",
    "LiveSession",
    "ModelVersionMismatchError",
    "SessionConflictError",
    "SessionDiff",
    "SessionError",
    "SessionExistsError",
    "SessionFormatError",
    "SessionInfo",
    "SessionNotFoundError",
    "SessionRun",
    "SessionState",
    "SessionStore",
    "WrongTenantError",
    "list_sessions",
    "run_with_session",
]
