"""A checkpoint seen through a conversion: the part FP8 and MXFP4 sources share.

Scope: the container protocol (names, ``in``, ``len``, context manager) and the source
manifest of a checkpoint that wraps a safetensors :class:`Checkpoint` (``inner``) and
presents some of its tensors converted to float. What each conversion reads and how it
decodes stays in its own module (:mod:`czyx.store.models.fp8`,
:mod:`czyx.store.models.mxfp4`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from czyx.store.models.checkpoint import Checkpoint
from czyx.store.models.gguf import ConversionPolicyError
from czyx.store.models.mount_source import source_manifest


class ConvertedCheckpoint:
    """Base of a converting checkpoint; subclasses set ``inner``, ``_names``, ``policy``,
    ``quantization_config`` and implement :meth:`conversion_facts`."""

    inner: Any
    _names: list[str]
    policy: str | None
    quantization_config: Any

    def _open_inner(
        self,
        path: str | os.PathLike[str],
        policy: str | None,
        policies: tuple[str, ...],
        holds: str,
    ) -> None:
        """Check the policy, open the inner checkpoint, split ``quantization_config`` off
        the config (``holds``: what the refusal says the checkpoint holds)."""
        if policy not in policies:
            raise ConversionPolicyError(
                f"{path} holds {holds}, which the store has no kernel for: mount with "
                f"--convert {'|'.join(policies)} (got {policy!r})"
            )
        self.policy = policy
        self.inner = Checkpoint(path)
        self.path = self.inner.path
        self.files = self.inner.files
        self.index_name = self.inner.index_name
        cfg = dict(self.inner.config)
        self.quantization_config = cfg.pop("quantization_config", None) or {}
        self.config = cfg

    def conversion_facts(self) -> dict[str, Any]:
        """``{"from": ..., "block": ...}``: what the source format is."""
        raise NotImplementedError

    def source_manifest(self) -> dict[str, Any]:
        """The safetensors source manifest plus the conversion's facts and policy."""
        base = source_manifest(self.inner)
        base["conversion"] = {
            **self.conversion_facts(),
            "quantization_config": self.quantization_config,
            "policy": self.policy,
        }
        return base

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def close(self) -> None:
        """Close the underlying checkpoint."""
        self.inner.close()

    def __enter__(self) -> ConvertedCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
