"""Calibration importance: mean squared activation per input column of each matrix.

Scope: accumulating, naming, merging and serialising the importance maps that
the quantizer (:mod:`store.quant.quantizer`) uses as error weights. Running
the model over text is the engine's job: it calls
:meth:`ImportanceCollector.add` with the input of each matrix in its forward
pass (``x`` of ``y = W @ x``), and the command that records the map stores
:meth:`ImportanceCollector.to_dict` at the model's coordinate.

Naming: :func:`store.quant.names.input_key` (re-exported here); matrices
that read the same input share one map, and each routed expert has its own
(only the tokens routed to it).

Sums are float64 (millions of tokens), the exported mean is float32.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from czyx.store.quant.errors import CalibrationError
from czyx.store.quant.names import input_key

__all__ = ["FORMAT_TAG", "ImportanceCollector", "Provenance", "collect", "input_key"]

#: Version tag of the serialised form.
FORMAT_TAG = "czyx-importance/1"


@dataclass(frozen=True)
class Provenance:
    """Where an importance map came from: the calibration text's hash and size."""

    text_sha256: str
    n_tokens: int
    source: str = ""

    @classmethod
    def for_text(cls, text: str | bytes, n_tokens: int, source: str = "") -> Provenance:
        """Provenance of ``text`` (hashed as UTF-8 when a ``str``)."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return cls(hashlib.sha256(data).hexdigest(), int(n_tokens), source)


class ImportanceCollector:
    """Accumulates ``sum(x**2)`` per input column and a row count, per named matrix input.

    Not thread-safe: use one collector per thread and :meth:`merge` them.
    """

    def __init__(self) -> None:
        self._sumsq: dict[str, np.ndarray] = {}
        self._count: dict[str, int] = {}

    def add(self, name: str, x: np.ndarray) -> None:
        """Add activations ``x [..., C]`` (each leading index is one row/token) to ``name``.

        Raises
        ------
        CalibrationError
            If ``x`` is not finite or its width differs from earlier rows of ``name``.
        """
        x = np.asarray(x)
        if x.ndim == 0:
            raise CalibrationError(f"importance {name}: activations must have a column axis")
        cols = x.shape[-1]
        rows = x.reshape(-1, cols)
        sq = np.einsum("ij,ij->j", rows, rows, dtype=np.float64)
        if not np.isfinite(sq).all():
            raise CalibrationError(f"importance {name}: non-finite activations")
        acc = self._sumsq.get(name)
        if acc is None:
            self._sumsq[name] = sq
            self._count[name] = rows.shape[0]
            return
        if acc.shape != sq.shape:
            raise CalibrationError(
                f"importance {name}: {cols} columns, earlier activations had {acc.shape[0]}"
            )
        acc += sq
        self._count[name] += rows.shape[0]

    def names(self) -> list[str]:
        """The names with at least one row, sorted."""
        return sorted(self._sumsq)

    def count(self, name: str) -> int:
        """Rows accumulated for ``name``."""
        return self._count.get(name, 0)

    def importance(self, name: str) -> np.ndarray:
        """``float32 [C]``: the mean squared activation of each column of ``name``'s input.

        Raises
        ------
        CalibrationError
            If nothing was accumulated for ``name``.
        """
        if name not in self._sumsq:
            raise CalibrationError(f"importance {name}: no activations recorded")
        return (self._sumsq[name] / self._count[name]).astype(np.float32)

    def importance_map(self, prior_tokens: float = 32.0) -> dict[str, np.ndarray]:
        """Every name's importance, routed experts shrunk toward their layer's.

        A routed expert sees only the tokens routed to it, so a rarely chosen
        expert's map rests on few tokens. Its mean is blended with the layer's
        as if ``prior_tokens`` tokens of the layer-wide distribution had been
        seen too: ``(sum_e + k * mean_layer) / (count_e + k)``. The prior of
        ``L{l}.E{e}.in`` is ``L{l}.moe_in`` (the same hidden state, all tokens);
        that of ``L{l}.E{e}.down_in`` is the pool of every expert's down input
        in the layer. Other names are their plain means.
        """
        out = {name: self.importance(name) for name in self.names()}
        pools: dict[str, tuple[np.ndarray, int]] = {}
        for name in self.names():
            layer, _, rest = name.partition(".")
            if rest.startswith("E") and rest.endswith(".down_in"):
                acc = pools.get(layer)
                s, c = self._sumsq[name], self._count[name]
                pools[layer] = (s.copy(), c) if acc is None else (acc[0] + s, acc[1] + c)
        k = float(prior_tokens)
        for name in self.names():
            layer, _, rest = name.partition(".")
            if not rest.startswith("E") or k <= 0:
                continue
            if rest.endswith(".down_in"):
                ps, pc = pools[layer]
                prior = ps / pc
            elif f"{layer}.moe_in" in self._sumsq:
                prior = self._sumsq[f"{layer}.moe_in"] / self._count[f"{layer}.moe_in"]
            else:
                continue
            if prior.shape != self._sumsq[name].shape:
                continue
            blended = (self._sumsq[name] + k * prior) / (self._count[name] + k)
            out[name] = blended.astype(np.float32)
        return out

    def merge(self, other: ImportanceCollector) -> None:
        """Add ``other``'s sums and counts into this collector."""
        for name, sq in other._sumsq.items():
            acc = self._sumsq.get(name)
            if acc is None:
                self._sumsq[name] = sq.copy()
                self._count[name] = other._count[name]
            elif acc.shape != sq.shape:
                raise CalibrationError(
                    f"importance {name}: cannot merge {sq.shape} into {acc.shape}"
                )
            else:
                acc += sq
                self._count[name] += other._count[name]

    def to_dict(self, provenance: Provenance) -> dict[str, object]:
        """A msgpack-friendly dict: tag, provenance, and per name the count and float64 sums.

        Sums (not means) are stored so that maps from several texts merge exactly.
        """
        return {
            "format": FORMAT_TAG,
            "provenance": {
                "text_sha256": provenance.text_sha256,
                "n_tokens": provenance.n_tokens,
                "source": provenance.source,
            },
            "matrices": {
                name: {
                    "count": self._count[name],
                    "cols": int(self._sumsq[name].shape[0]),
                    "sumsq": self._sumsq[name].astype("<f8").tobytes(),
                }
                for name in self.names()
            },
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> tuple[ImportanceCollector, Provenance]:
        """Inverse of :meth:`to_dict`.

        Raises
        ------
        CalibrationError
            On a wrong tag, missing field or inconsistent sizes (naming the matrix).
        """
        if not isinstance(data, dict) or data.get("format") != FORMAT_TAG:
            raise CalibrationError(f"not an importance map (expected format {FORMAT_TAG!r})")
        try:
            p = data["provenance"]
            prov = Provenance(str(p["text_sha256"]), int(p["n_tokens"]), str(p.get("source", "")))
            mats = data["matrices"]
        except (KeyError, TypeError, ValueError) as exc:
            raise CalibrationError(f"importance map: malformed provenance ({exc})") from None
        out = cls()
        for name, rec in dict(mats).items():
            try:
                count, cols, raw = int(rec["count"]), int(rec["cols"]), rec["sumsq"]
            except (KeyError, TypeError, ValueError) as exc:
                raise CalibrationError(f"importance {name}: malformed record ({exc})") from None
            if not isinstance(raw, bytes | bytearray) or len(raw) != 8 * cols or count <= 0:
                raise CalibrationError(
                    f"importance {name}: {cols} columns need {8 * cols} bytes and a positive count"
                )
            out._sumsq[str(name)] = np.frombuffer(raw, dtype="<f8").astype(np.float64)
            out._count[str(name)] = count
        return out, prov


def collect(
    model: object, token_chunks: list[np.ndarray] | tuple[np.ndarray, ...]
) -> ImportanceCollector:
    """Run ``model`` (an :class:`inference.engine.Engine`) over text, recording importance.

    Each chunk is prefilled from an empty KV cache (a calibration window), with
    the decoder's observer hook feeding an :class:`ImportanceCollector`: every
    matrix input of every layer, each routed expert seeing only its tokens.

    Parameters
    ----------
    model : Engine
        The float (or any) engine to calibrate with.
    token_chunks : sequence of numpy.ndarray
        Token id windows, each ``[T]``.
    """
    col = ImportanceCollector()
    decoder = model.model  # type: ignore[attr-defined]
    decoder.observer = col.add
    try:
        for chunk in token_chunks:
            model.reset()  # type: ignore[attr-defined]
            # all_logits: the head sees every position, as every other matrix does
            model.prefill(np.asarray(chunk, np.int64), all_logits=True)  # type: ignore[attr-defined]
    finally:
        decoder.observer = None
        model.reset()  # type: ignore[attr-defined]
    return col
