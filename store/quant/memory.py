"""A model quantized in memory: any float consumer seen through a policy.

Scope: :class:`QuantizedConsumer` wraps a :class:`store.consumer.ModelConsumer`
whose experts and trunk are float, quantizes every tensor its policy names
(with the calibration importance map when given) once at construction, and
serves the result through the same interface: expert extents in the
quantized layout of :mod:`store.quant.extent`, trunk tensors both as float32
(``trunk``, dequantized: what a consumer that knows nothing of quantization
computes with) and packed (``trunk_quantized``, what the engine's kernels
use). A mounted quantized model exposes the same two methods from disk; this
class gives the quality measurements and the tests the identical numbers
without a mount.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

import numpy as np

from czyx.store.consumer import GLOBAL_ROLES, LAYER_ROLES, ExpertExtent, ModelConsumer
from czyx.store.io.experts import ExpertReads, open_expert_reads
from czyx.store.models.archs import ARCHS
from czyx.store.quant.errors import QuantError
from czyx.store.quant.extent import ExpertLayout, expert_format, pack_expert
from czyx.store.quant.formats import QuantFormat, dequantize, quantize
from czyx.store.quant.policy import Policy

#: Maps ``(layer, role, expert)`` to the name of that matrix's input in an
#: importance map (``inference.calibration.input_key`` has this signature).
InputKey = Callable[[int | None, str, int | None], str | None]

_ALIGN = 4096


class QuantizedConsumer:
    """``base`` quantized under ``policy``; a ``ModelConsumer`` plus ``trunk_quantized``.

    Parameters
    ----------
    base : ModelConsumer
        A float model (``expert_format`` ``"f32"``).
    policy : Policy
        Which roles are quantized to which format.
    importance : Mapping[str, numpy.ndarray] or None
        Importance map by input name (mean squared activation per column).
    input_key : callable or None
        Names the input of ``(layer, role, expert)`` in ``importance``; needed
        when ``importance`` is given.
    """

    def __init__(
        self,
        base: ModelConsumer,
        policy: Policy,
        importance: Mapping[str, np.ndarray] | None = None,
        input_key: InputKey | None = None,
    ) -> None:
        if base.info.expert_format != "f32":
            raise QuantError(f"QuantizedConsumer needs an f32 base, got {base.info.expert_format}")
        if importance is not None and input_key is None:
            raise QuantError("an importance map needs input_key to name matrix inputs")
        self.base = base
        self.policy = policy
        self._imp = importance or {}
        self._key = input_key
        self._trunk: dict[tuple[str, int | None], tuple[np.ndarray, QuantFormat, tuple]] = {}
        self._float: dict[tuple[str, int | None], np.ndarray] = {}
        info = base.info
        slot = np.zeros(info.expert_slot_nbytes, np.uint8)
        self._extents: dict[tuple[int, int], np.ndarray] = {}
        self.layout: ExpertLayout | None = None
        self._n_float_experts = 0
        spec = ARCHS.get(info.arch)
        if spec is None:
            raise QuantError(f"architecture {info.arch!r} has no store.archs spec")
        # Only the sparse layers have experts; any failure to read one of theirs
        # (missing extent, checksum, portal) propagates rather than leaving a hole.
        for layer in spec.sparse_layers(info.config):
            for e in range(info.n_experts):
                base.read_expert(layer, e, slot)
                gate, up, down = (np.array(v, np.float32) for v in base.expert_views(slot))
                if self.layout is None:
                    fmt = expert_format(policy, gate.shape[0], gate.shape[1])
                    if fmt is None:
                        self._n_float_experts += 1
                        continue
                    self.layout = ExpertLayout(fmt, gate.shape[0], gate.shape[1])
                self._extents[(layer, e)] = pack_expert(
                    gate,
                    up,
                    down,
                    self.layout.fmt,
                    self._importance(layer, "gate_proj", e),
                    self._importance(layer, "down_proj", e),
                )
        if self.layout is None:
            self.info = info
            self._extents.clear()
        else:
            n = self.layout.nbytes
            self.info = replace(
                info,
                expert_nbytes=n,
                expert_slot_nbytes=-(-n // _ALIGN) * _ALIGN,
                expert_format=self.layout.fmt.name,
            )

    def _importance(self, layer: int | None, role: str, expert: int | None) -> np.ndarray | None:
        if self._key is None:
            return None
        name = self._key(layer, role, expert)
        return None if name is None else self._imp.get(name)

    # ------------------------------------------------------------------ trunk

    def has_trunk(self, role: str, layer: int | None = None) -> bool:
        """Whether the base model has ``role`` (at ``layer``)."""
        return self.base.has_trunk(role, layer)

    def trunk_quantized(
        self, role: str, layer: int | None = None
    ) -> tuple[np.ndarray, QuantFormat, tuple[int, int]] | None:
        """``(packed buffer, format, shape)`` of a quantized trunk tensor, else ``None``."""
        key = (role, layer)
        if key in self._trunk:
            return self._trunk[key]
        if key in self._float:
            return None
        t = np.asarray(self.base.trunk(role, layer), dtype=np.float32)
        decision = self.policy.decide(role, t.shape)
        if decision.fmt is None:
            self._float[key] = t
            return None
        imp = self._importance(layer, role, None)
        buf = quantize(t, decision.fmt, imp)
        self._trunk[key] = (buf, decision.fmt, (int(t.shape[0]), int(t.shape[1])))
        return self._trunk[key]

    def trunk(self, role: str, layer: int | None = None) -> np.ndarray:
        """The tensor as float32 (dequantized when the policy quantizes it)."""
        q = self.trunk_quantized(role, layer)
        if q is None:
            return self._float[(role, layer)]
        buf, fmt, shape = q
        return dequantize(buf, fmt, shape)

    def model_nbytes(self) -> tuple[int, int]:
        """``(trunk bytes, routed-expert bytes)`` as stored under the policy (float = 4 B)."""
        trunk = 0
        for role in GLOBAL_ROLES:
            if self.has_trunk(role):
                trunk += self._tensor_nbytes(role, None)
        for layer in range(self.info.n_layers):
            for role in LAYER_ROLES:
                if self.has_trunk(role, layer):
                    trunk += self._tensor_nbytes(role, layer)
        if self.layout is not None:
            experts = len(self._extents) * self.layout.nbytes
        else:
            experts = self._n_float_experts * int(self.base.info.expert_nbytes)
        return trunk, experts

    def _tensor_nbytes(self, role: str, layer: int | None) -> int:
        q = self.trunk_quantized(role, layer)
        return int(q[0].size) if q is not None else int(self._float[(role, layer)].nbytes)

    # ------------------------------------------------------------------ experts

    def expert_extent(self, layer: int, router_byte: int) -> ExpertExtent:
        """The base's extent, or an in-memory one (``block=-1``) of the packed size."""
        if self.layout is None:
            return self.base.expert_extent(layer, router_byte)
        return ExpertExtent(block=-1, offset=0, length=self.info.expert_nbytes, checksum=0)

    def open_expert_reads(
        self, slots, *, readers: int = 2, native: bool | None = None, io: str | None = None
    ) -> ExpertReads:
        """The base's expert reads when unquantized, else reads of the in-memory extents."""
        if self.layout is None:
            return open_expert_reads(self.base, slots, readers=readers, native=native, io=io)
        return ExpertReads(
            slots,
            self.expert_extent,
            read_expert=self.read_expert,
            readers=readers,
            native=native,
            io=io,
        )

    def read_expert(self, layer: int, router_byte: int, slot: np.ndarray) -> None:
        """Copy the packed extent of ``(layer, router_byte)`` into ``slot`` (uint8).

        Raises
        ------
        QuantError
            ``slot`` has the wrong dtype or size, or the layer has no such expert.
        """
        if self.layout is None:
            self.base.read_expert(layer, router_byte, slot)
            return
        if slot.dtype != np.uint8 or slot.size != self.info.expert_slot_nbytes:
            raise QuantError(f"slot must be uint8[{self.info.expert_slot_nbytes}]")
        src = self._extents.get((layer, router_byte))
        if src is None:
            raise QuantError(f"layer {layer} has no routed expert {router_byte}")
        slot[: src.size] = src

    def expert_views(self, slot: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Float views from the base, or the three packed uint8 parts when quantized."""
        if self.layout is None:
            return self.base.expert_views(slot)
        return self.layout.split(slot)

    def close(self) -> None:
        """Close the base model."""
        self.base.close()
