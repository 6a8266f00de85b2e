"""What a quantizing mount and a quantized model's reader need, in one place.

Scope: :class:`QuantCodec` turns float tensors into stored bytes under a
policy (and an importance map), and tells the mount what to record;
:func:`trunk_tensor` turns a stored trunk record back into the engine's two
faces (float32, and packed for the kernels); :func:`expert_parts` splits a
quantized expert slot. ``store.mount`` and ``store.model`` call these; they
keep the store's I/O, hashing and publication.

Records: a quantized trunk tensor's record carries ``"qfmt"`` (the format
name) beside its usual ``dtype``/``shape`` (the source tensor's); its extent
holds the packed bytes. A float tensor has no ``"qfmt"``. The expert space's
manifest carries ``expert.format`` (the extent's format), and the model
manifest a ``"quant"`` section (:meth:`QuantCodec.manifest`) so that a
quantized version never has the selector of its float source.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from czyx.store.quant.errors import QuantError
from czyx.store.quant.extent import ExpertLayout, expert_format, pack_expert
from czyx.store.quant.formats import QuantFormat, dequantize, get_format, quantize
from czyx.store.quant.names import input_key
from czyx.store.quant.policy import Policy


class QuantCodec:
    """Quantize a checkpoint's tensors under ``policy``.

    Parameters
    ----------
    policy : Policy
        Role classes to formats.
    importance : Mapping[str, numpy.ndarray] or None
        Importance by input name (``ImportanceCollector.importance_map()``).
    provenance : dict or None
        The importance map's provenance (text hash, token count), recorded.
    """

    def __init__(
        self,
        policy: Policy,
        importance: Mapping[str, np.ndarray] | None = None,
        provenance: dict | None = None,
    ) -> None:
        self.policy = policy
        self.importance = dict(importance or {})
        self.provenance = provenance

    def _imp(self, layer: int | None, role: str, expert: int | None) -> np.ndarray | None:
        name = input_key(layer, role, expert)
        return None if name is None else self.importance.get(name)

    def expert_layout(self, inter: int, hidden: int) -> ExpertLayout | None:
        """The quantized extent layout, or ``None`` when experts stay as stored."""
        fmt = expert_format(self.policy, inter, hidden)
        return None if fmt is None else ExpertLayout(fmt, inter, hidden)

    def encode_expert(
        self,
        layout: ExpertLayout,
        layer: int,
        expert: int,
        gate: np.ndarray,
        up: np.ndarray,
        down: np.ndarray,
    ) -> np.ndarray:
        """The extent bytes of routed expert ``(layer, expert)`` (float inputs, any dtype)."""
        return pack_expert(
            np.asarray(gate, np.float32),
            np.asarray(up, np.float32),
            np.asarray(down, np.float32),
            layout.fmt,
            self._imp(layer, "gate_proj", expert),
            self._imp(layer, "down_proj", expert),
        )

    def encode_expert_raw(
        self,
        layout: ExpertLayout,
        layer: int,
        expert: int,
        raw: np.ndarray,
        dtype: str,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """:meth:`encode_expert` from the source extent's bytes (gate | up | down in ``dtype``,
        a safetensors dtype name such as ``"F16"``), read in that dtype by the C
        quantizer: no float32 copy of the expert is made. ``out``: the extent
        buffer to fill (``uint8 [layout.nbytes]``), else a new one."""
        f, dtype = _source(raw, dtype)
        n = layout.inter * layout.hidden
        ih, hi = (layout.inter, layout.hidden), (layout.hidden, layout.inter)
        gate, up, down = f[:n].reshape(ih), f[n : 2 * n].reshape(ih), f[2 * n :].reshape(hi)
        return pack_expert(
            gate,
            up,
            down,
            layout.fmt,
            self._imp(layer, "gate_proj", expert),
            self._imp(layer, "down_proj", expert),
            dtype=dtype,
            out=out,
        )

    def encode_trunk_raw(
        self,
        role: str,
        layer: int | None,
        raw: np.ndarray,
        dtype: str,
        shape: tuple[int, ...],
        scratch: np.ndarray | None = None,
    ) -> tuple[np.ndarray, str | None]:
        """:meth:`encode_trunk` from a source tensor's bytes; float tensors come back as given.

        ``scratch``: a contiguous ``uint8`` buffer to pack into when it is large
        enough (the result is then a view of it), so that a caller storing one
        tensor after another allocates no fresh pages per tensor."""
        decision = self.policy.decide(role, tuple(shape))
        if decision.fmt is None:
            return raw, None
        arr, src_dtype = _source(raw, dtype)
        out = None
        if scratch is not None and len(shape) == 2 and shape[1] % decision.fmt.group_size == 0:
            n = decision.fmt.nbytes(int(shape[0]), int(shape[1]))
            out = scratch[:n] if scratch.nbytes >= n else None
        buf = quantize(
            arr.reshape(shape), decision.fmt, self._imp(layer, role, None), dtype=src_dtype, out=out
        )
        return buf, decision.fmt.name

    def encode_trunk(
        self, role: str, layer: int | None, tensor: np.ndarray
    ) -> tuple[np.ndarray, str | None]:
        """``(bytes to store, format name or None)`` of one trunk tensor.

        ``None``: the policy keeps it as stored (the caller writes its own bytes).
        """
        decision = self.policy.decide(role, np.shape(tensor))
        if decision.fmt is None:
            return np.empty(0, np.uint8), None
        buf = quantize(np.asarray(tensor, np.float32), decision.fmt, self._imp(layer, role, None))
        return buf, decision.fmt.name

    def manifest(self) -> dict[str, object]:
        """The manifest's ``"quant"`` section: policy, per-class formats, importance origin."""
        return {
            "policy": self.policy.name,
            "formats": {c: f for c, f in self.policy.formats},
            "importance": self.provenance,
        }


def _source(raw: np.ndarray, dtype: str) -> tuple[np.ndarray, str | None]:
    """A source tensor's elements for :func:`quantize`: read in place where the C
    quantizer reads ``dtype`` (f32, f16, bf16), else widened to float32 first."""
    from czyx.store.models.checkpoint import DTYPES, to_float32

    view = np.asarray(raw).view(DTYPES[dtype][0])
    if dtype in ("F32", "F16", "BF16"):
        return view, dtype
    return to_float32(view, dtype), None


def packed_trunk(
    record: Mapping[str, object], raw: np.ndarray
) -> tuple[np.ndarray, QuantFormat, tuple[int, int]]:
    """``(packed uint8 buffer, format, shape)`` of a stored trunk tensor with a ``"qfmt"``.

    What a resident quantized model keeps: its stored bytes only (the float32
    face is :func:`dequantize` of this, made when a caller asks for it).

    Raises
    ------
    QuantError
        If the record has no ``"qfmt"`` or the bytes do not fit it.
    """
    name = record.get("qfmt")
    if name is None:
        raise QuantError("trunk record has no qfmt: not a quantized tensor")
    fmt = get_format(str(name))
    shape = tuple(int(s) for s in record["shape"])  # type: ignore[union-attr]
    if len(shape) != 2:
        raise QuantError(f"quantized trunk tensor of shape {shape}: only matrices are")
    buf = np.ascontiguousarray(raw, np.uint8).reshape(-1)
    if buf.size != fmt.nbytes(*shape):
        raise QuantError(f"quantized trunk tensor {fmt.name} {shape}: {buf.size} bytes")
    return buf, fmt, (shape[0], shape[1])


def trunk_tensor(
    record: Mapping[str, object], raw: np.ndarray
) -> tuple[np.ndarray, tuple[np.ndarray, QuantFormat, tuple[int, int]] | None]:
    """``(float32 tensor, packed)`` of a stored trunk tensor with a ``"qfmt"``.

    Raises
    ------
    QuantError
        If the record has no ``"qfmt"`` or the bytes do not fit it.
    """
    packed = packed_trunk(record, raw)
    return dequantize(*packed), packed


def expert_parts(
    fmt_name: str, inter: int, hidden: int, slot: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Zero-copy packed ``(gate, up, down)`` uint8 views of a quantized expert slot."""
    return ExpertLayout(get_format(fmt_name), inter, hidden).split(
        np.asarray(slot).reshape(-1).view(np.uint8)
    )
