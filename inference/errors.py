"""Typed errors of the inference package.

Every deliberate failure of the engine, the expert slot cache, sampling or
generation derives from :class:`InferenceError` (itself a
:class:`czyx.errors.CzyxError`), so the CLI prints it as one line.
"""

from __future__ import annotations

from czyx.errors import CzyxError


class InferenceError(CzyxError):
    """Base class of the inference package's deliberate errors."""


class UnsupportedModelError(InferenceError):
    """The model's architecture or a config field is not implemented (named in the message)."""


class MissingTensorError(InferenceError):
    """A trunk tensor the architecture needs is absent or has the wrong shape."""


class CacheBudgetError(InferenceError):
    """The expert slot budget cannot hold what it must (one layer's top-k experts)."""


class SlotInUseError(InferenceError):
    """A slot still needed by the current layer was about to be reused."""


class SamplingError(InferenceError):
    """Invalid sampling parameters (temperature, top-k, top-p)."""


class TokenizerError(InferenceError):
    """The checkpoint's tokenizer could not be loaded or used."""


class DemoCheckError(InferenceError):
    """A guarantee the demo shows did not hold (a refusal allowed, runs that differ)."""


class ScopeRoutingError(InferenceError):
    """A scoped portal permits fewer experts at a layer than the model routes per token."""


class RecurrentStateError(InferenceError):
    """A hybrid model's recurrent state cannot be rewound, cut or restored as asked."""
