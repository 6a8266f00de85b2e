"""Typed errors of reading checkpoints and mounting them as model spaces.

Every error names what it is about (file, tensor, field) in its message and
keeps those as attributes, so a caller (the CLI, a test) can print one line or
inspect the cause. They derive from :class:`czyx.errors.CzyxError`, the root
of deliberate czyx errors; the store's own errors (``store.errors``) are a
sibling hierarchy and pass through mount unchanged.
"""

from __future__ import annotations

from czyx.errors import CzyxError


class MountError(CzyxError):
    """Base of errors raised while reading, mounting, opening or exporting a model."""


class UnknownArchitectureError(MountError):
    """The checkpoint's ``config.json`` names an architecture czyx has no table for."""


class CheckpointError(MountError):
    """A checkpoint file or tensor is malformed; names the file and (if any) tensor."""

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        where = ", ".join(
            part
            for part in (f"file {file}" if file else "", f"tensor {tensor!r}" if tensor else "")
            if part
        )
        super().__init__(f"{message} ({where})" if where else message)
        self.file = file
        self.tensor = tensor


class HeaderError(CheckpointError):
    """A safetensors header that lies: bad JSON, offsets outside the data, overlaps,
    a byte length that does not match dtype size times shape, an unknown dtype."""


class TruncatedFileError(CheckpointError):
    """The file is shorter than its header says."""


class MissingTensorError(CheckpointError):
    """A tensor the architecture requires (or the index promises) is absent."""


class UnexpectedTensorError(CheckpointError):
    """A tensor the architecture table does not know, a duplicate, or an expert
    index beyond the configured expert count."""


class ShapeMismatchError(CheckpointError):
    """A tensor's shape or dtype disagrees with the config or its siblings."""


class ConfigError(MountError):
    """A ``config.json`` value of the wrong type or outside what a model can be
    (more experts per token than experts, a negative norm epsilon, a billion layers)."""


class ModelSpaceError(MountError):
    """A space is not a mounted model (or its manifest is inconsistent with its records)."""


class MissingTrunkRoleError(ModelSpaceError, KeyError):
    """The model has no tensor of a (valid) trunk role at that layer.

    A ``KeyError`` too: the consumer contract reports an absent tensor as one.
    """

    def __str__(self) -> str:  # KeyError would show the message's repr
        return str(self.args[0]) if self.args else ""


class ExpertIndexError(ModelSpaceError, IndexError):
    """A ``(layer, router byte)`` outside the model's layers or the 256 bytes."""
