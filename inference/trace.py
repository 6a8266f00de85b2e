"""Routing traces: which experts a MoE model selected, per token and layer.

Scope: the trace value, its on-disk format (save / load / validate), and a
builder from Hugging Face ``transformers`` router outputs that works on any
MoE causal LM exposing ``output_router_logits`` (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, ...). Analysis lives in :mod:`inference.locality`.

File format (``.npz``, version 1; written by :meth:`RoutingTrace.save`,
loaded with ``allow_pickle=False``):

=============  =========================  ===========================================
member         dtype / shape              meaning
=============  =========================  ===========================================
``experts``    uint8 ``[T, L, k]``        selected router indices (the class value
               (uint16 above 256 experts)  before any remapping), in the model's
                                          top-k order (highest weight first)
``weights``    float32 ``[T, L, k]``      the router weight the model applied to each
                                          selected expert (after its top-k
                                          normalisation, if the model has one)
``segments``   int32 ``[T]``              sequence id of each token, non-decreasing;
                                          token ``t`` follows ``t-1`` only when both
                                          have the same id
``meta``       0-d unicode (JSON)         ``format`` ("czyx-routing-trace"),
                                          ``version`` (1), ``model_id``,
                                          ``text_sha256``, ``top_k``, ``n_experts``,
                                          ``moe_layers`` (model layer index of each
                                          of the L trace layers), ``weights_kind``
=============  =========================  ===========================================

Rows within a ``(t, l)`` hold distinct experts. ``experts`` is uint8 up to
256 experts a layer (a router index is the class byte) and uint16 above, up to
:data:`czyx.expert_key.MAX_EXPERTS` (:func:`index_dtype`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from czyx.expert_key import CLASS_VALUES, MAX_EXPERTS
from czyx.inference.locality.errors import TraceError

FORMAT = "czyx-routing-trace"
VERSION = 1


@dataclass(frozen=True)
class RoutingTrace:
    """Per-token, per-MoE-layer expert selections of one model on one text.

    Attributes
    ----------
    experts : np.ndarray
        uint8 ``[T, L, k]`` selected router indices (uint16 above 256 experts).
    weights : np.ndarray
        float32 ``[T, L, k]`` router weights of the selections.
    segments : np.ndarray
        int32 ``[T]`` non-decreasing sequence ids.
    model_id : str
        Free-form identifier of the model (a name, a path or a content hash).
    text_sha256 : str
        Hex SHA-256 of the traced text (bytes), for provenance.
    n_experts : int
        Routed experts per layer (``E``), at most 256.
    moe_layers : tuple[int, ...]
        Model layer index of each trace layer (length ``L``).
    weights_kind : str
        What ``weights`` holds, e.g. ``"topk_renormalized"`` or ``"softmax"``.
    """

    experts: np.ndarray
    weights: np.ndarray
    segments: np.ndarray
    model_id: str
    text_sha256: str
    n_experts: int
    moe_layers: tuple[int, ...] = field(default=())
    weights_kind: str = "topk_renormalized"

    def __post_init__(self) -> None:
        if not self.moe_layers and getattr(self.experts, "ndim", 0) == 3:
            object.__setattr__(self, "moe_layers", tuple(range(self.experts.shape[1])))
        self.validate()

    @property
    def n_tokens(self) -> int:
        """Number of traced tokens ``T``."""
        return int(self.experts.shape[0])

    @property
    def n_layers(self) -> int:
        """Number of MoE layers ``L``."""
        return int(self.experts.shape[1])

    @property
    def top_k(self) -> int:
        """Experts selected per token and layer ``k``."""
        return int(self.experts.shape[2])

    def validate(self, source: str = "trace") -> None:
        """Check dtypes, shapes and value ranges; raise :class:`TraceError` naming the field.

        Parameters
        ----------
        source : str
            Name used in error messages (the file path when loading).
        """
        e, w, s = self.experts, self.weights, self.segments
        if not isinstance(self.n_experts, int) or not 1 <= self.n_experts <= MAX_EXPERTS:
            raise TraceError(f"{source}: n_experts {self.n_experts} outside [1, {MAX_EXPERTS}]")
        want = index_dtype(self.n_experts)
        if not isinstance(e, np.ndarray) or e.dtype != want or e.ndim != 3:
            raise TraceError(
                f"{source}: 'experts' must be {want.name} [T, L, k] for {self.n_experts} "
                f"experts, got {_desc(e)}"
            )
        if not isinstance(w, np.ndarray) or w.dtype != np.float32 or w.shape != e.shape:
            raise TraceError(
                f"{source}: 'weights' must be float32 of shape {e.shape}, got {_desc(w)}"
            )
        if not isinstance(s, np.ndarray) or s.dtype != np.int32 or s.shape != e.shape[:1]:
            raise TraceError(
                f"{source}: 'segments' must be int32 of shape {e.shape[:1]}, got {_desc(s)}"
            )
        if e.shape[2] < 1 or e.shape[2] > self.n_experts:
            raise TraceError(f"{source}: top_k {e.shape[2]} outside [1, n_experts]")
        if e.size and int(e.max()) >= self.n_experts:
            t, layer, j = np.argwhere(e >= self.n_experts)[0]
            raise TraceError(
                f"{source}: experts[{t}, {layer}, {j}] = {e[t, layer, j]} >= n_experts "
                f"{self.n_experts}"
            )
        if e.shape[2] > 1 and e.size:
            srt = np.sort(e, axis=2)
            dup = np.argwhere((srt[:, :, 1:] == srt[:, :, :-1]).any(axis=2))
            if len(dup):
                t, layer = dup[0]
                raise TraceError(f"{source}: experts[{t}, {layer}] repeats an expert")
        if not np.isfinite(w).all():
            t = int(np.argwhere(~np.isfinite(w))[0][0])
            raise TraceError(f"{source}: weights of token {t} are not finite")
        if len(s) > 1 and (np.diff(s) < 0).any():
            t = int(np.argmax(np.diff(s) < 0)) + 1
            raise TraceError(f"{source}: segments decrease at token {t}")
        if len(self.moe_layers) != e.shape[1]:
            raise TraceError(
                f"{source}: moe_layers has {len(self.moe_layers)} entries for {e.shape[1]} layers"
            )

    def meta(self) -> dict[str, Any]:
        """The JSON metadata written into the file."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "model_id": self.model_id,
            "text_sha256": self.text_sha256,
            "top_k": self.top_k,
            "n_experts": self.n_experts,
            "moe_layers": list(self.moe_layers),
            "weights_kind": self.weights_kind,
        }

    def save(self, path: str | Path) -> Path:
        """Write the trace as a compressed ``.npz`` (see the module docstring)."""
        path = Path(path)
        with open(path, "wb") as fh:  # a file object keeps numpy from appending ".npz"
            np.savez_compressed(
                fh,
                experts=self.experts,
                weights=self.weights,
                segments=self.segments,
                meta=np.array(json.dumps(self.meta(), sort_keys=True)),
            )
        return path

    @classmethod
    def load(cls, path: str | Path) -> RoutingTrace:
        """Read and validate a trace written by :meth:`save` (or by anyone else to the format)."""
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                members = {k: z[k] for k in z.files}
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise TraceError(f"{path}: not a readable npz trace ({exc})") from exc
        for name in ("experts", "weights", "segments", "meta"):
            if name not in members:
                raise TraceError(f"{path}: missing member '{name}'")
        try:
            meta = json.loads(str(members["meta"]))
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}: 'meta' is not JSON ({exc})") from exc
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise TraceError(
                f"{path}: format {meta.get('format')!r} version {meta.get('version')!r}, "
                f"expected {FORMAT!r} version {VERSION}"
            )
        for key in ("model_id", "text_sha256", "top_k", "n_experts", "moe_layers"):
            if key not in meta:
                raise TraceError(f"{path}: meta lacks '{key}'")
        trace = cls.__new__(cls)
        for name, value in (
            ("experts", members["experts"]),
            ("weights", members["weights"]),
            ("segments", members["segments"]),
            ("model_id", str(meta["model_id"])),
            ("text_sha256", str(meta["text_sha256"])),
            ("n_experts", int(meta["n_experts"])),
            ("moe_layers", tuple(int(x) for x in meta["moe_layers"])),
            ("weights_kind", str(meta.get("weights_kind", "unknown"))),
        ):
            object.__setattr__(trace, name, value)
        trace.validate(str(path))
        if trace.top_k != int(meta["top_k"]):
            raise TraceError(f"{path}: meta top_k {meta['top_k']} != experts' k {trace.top_k}")
        return trace

    def take(self, start: int, stop: int) -> RoutingTrace:
        """Tokens ``[start, stop)`` as a new trace (same metadata)."""
        return RoutingTrace(
            experts=self.experts[start:stop],
            weights=self.weights[start:stop],
            segments=self.segments[start:stop],
            model_id=self.model_id,
            text_sha256=self.text_sha256,
            n_experts=self.n_experts,
            moe_layers=self.moe_layers,
            weights_kind=self.weights_kind,
        )

    def split(self, fraction: float = 0.5) -> tuple[RoutingTrace, RoutingTrace]:
        """Split into (learn, measure) at the segment boundary nearest ``fraction`` of tokens.

        Splitting on a segment boundary keeps held-out evaluation honest: no
        sequence contributes to both parts.
        """
        if not 0.0 < fraction < 1.0:
            raise TraceError(f"split fraction {fraction} outside (0, 1)")
        bounds = np.flatnonzero(np.diff(self.segments)) + 1
        if len(bounds) == 0:
            raise TraceError("split: the trace holds a single segment; nothing to hold out")
        cut = int(bounds[np.argmin(np.abs(bounds - fraction * self.n_tokens))])
        return self.take(0, cut), self.take(cut, self.n_tokens)


def index_dtype(n_experts: int) -> np.dtype:
    """The dtype of a trace's router indices: uint8 up to 256 experts a layer, else uint16."""
    return np.dtype(np.uint8 if n_experts <= CLASS_VALUES else np.uint16)


def _desc(a: object) -> str:
    if isinstance(a, np.ndarray):
        return f"{a.dtype} {list(a.shape)}"
    return type(a).__name__


def trace_from_router_logits(
    router_logits: Sequence[np.ndarray],
    top_k: int,
    *,
    normalize_topk: bool = True,
    segments: np.ndarray | None = None,
    model_id: str = "",
    text_sha256: str = "",
    moe_layers: Sequence[int] | None = None,
) -> RoutingTrace:
    """Build a trace from per-layer router logits ``[T, E]`` (what HF models return).

    Selection is top-k of the softmax (equal to top-k of the logits), in
    descending order, as Mixtral/Qwen-MoE routers do; weights are the softmax
    probabilities of the selected experts, renormalised to sum to one when
    ``normalize_topk`` (Mixtral always; Qwen-MoE when ``norm_topk_prob``).

    Parameters
    ----------
    router_logits : sequence of np.ndarray
        One ``[T, E]`` float array per MoE layer, tokens in text order.
    top_k : int
        Experts per token.
    normalize_topk : bool
        Renormalise the selected probabilities.
    segments : np.ndarray, optional
        Sequence id per token; all zeros when omitted.
    model_id, text_sha256 : str
        Provenance written into the metadata.
    moe_layers : sequence of int, optional
        Model layer index of each entry of ``router_logits``.

    Returns
    -------
    RoutingTrace
    """
    if not router_logits:
        raise TraceError("router_logits: no layers")
    logits = np.stack([np.asarray(x, dtype=np.float32) for x in router_logits], axis=1)
    if logits.ndim != 3:
        raise TraceError(f"router_logits: expected [T, E] per layer, got {logits.shape[::2]}")
    n_experts = logits.shape[2]
    # argsort on the negated logits: stable, so ties resolve to the lower index like torch.topk
    idx = np.argsort(-logits, axis=2, kind="stable")[:, :, :top_k]
    shifted = logits - logits.max(axis=2, keepdims=True)
    probs = np.exp(shifted)
    probs /= probs.sum(axis=2, keepdims=True)
    w = np.take_along_axis(probs, idx, axis=2)
    if normalize_topk:
        w = w / w.sum(axis=2, keepdims=True)
    t = logits.shape[0]
    return RoutingTrace(
        experts=idx.astype(index_dtype(n_experts)),
        weights=w.astype(np.float32),
        segments=np.zeros(t, np.int32) if segments is None else np.asarray(segments, np.int32),
        model_id=model_id,
        text_sha256=text_sha256,
        n_experts=n_experts,
        moe_layers=tuple(moe_layers) if moe_layers is not None else tuple(range(logits.shape[1])),
        weights_kind="topk_renormalized" if normalize_topk else "softmax",
    )


def trace_hf_model(
    model: Any,
    token_windows: Iterable[Sequence[int]],
    *,
    model_id: str = "",
    text_sha256: str = "",
    batch_size: int = 8,
    moe_layers: Sequence[int] | None = None,
) -> RoutingTrace:
    """Run a transformers MoE causal LM over token windows and record its routing.

    Each window is one segment (the model sees it from an empty context). The
    model must accept ``output_router_logits=True`` and return ``router_logits``
    (one ``[B*S, E]`` tensor per MoE layer), as Mixtral, Qwen2/3-MoE and OLMoE do.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The model, in eval mode (switched to it here).
    token_windows : iterable of sequences of int
        Token ids; windows in one batch must have equal length (shorter
        windows are run alone).
    model_id, text_sha256 : str
        Provenance for the metadata.
    batch_size : int
        Windows per forward pass.
    moe_layers : sequence of int, optional
        Model layer index of each router output. Defaults to every layer when
        the model returns one router output per layer; models with dense
        layers (Qwen2-MoE ``mlp_only_layers``, DeepSeek's first dense layers)
        should say which, else the trace numbers its layers ``0..L-1``.

    Returns
    -------
    RoutingTrace
    """
    import torch

    cfg = model.config
    top_k = int(getattr(cfg, "num_experts_per_tok", 0) or getattr(cfg, "top_k", 0))
    if top_k < 1:
        raise TraceError("model config names no num_experts_per_tok")
    normalize = bool(getattr(cfg, "norm_topk_prob", True))
    windows = [list(w) for w in token_windows]
    per_layer: list[list[np.ndarray]] = []
    segs: list[np.ndarray] = []
    model.eval()
    i = 0
    seg_id = 0
    with torch.no_grad():
        while i < len(windows):
            n = len(windows[i])
            group = [windows[i]]
            while (
                len(group) < batch_size
                and i + len(group) < len(windows)
                and len(windows[i + len(group)]) == n
            ):
                group.append(windows[i + len(group)])
            i += len(group)
            x = torch.tensor(group, dtype=torch.long)
            out = model(input_ids=x, output_router_logits=True)
            rl = getattr(out, "router_logits", None)
            if not rl:
                raise TraceError(f"{type(model).__name__} returned no router_logits")
            if not per_layer:
                per_layer = [[] for _ in rl]
            for layer, logits in enumerate(rl):
                per_layer[layer].append(logits.float().reshape(len(group) * n, -1).numpy())
            segs.append(np.repeat(np.arange(seg_id, seg_id + len(group), dtype=np.int32), n))
            seg_id += len(group)
    if not per_layer:
        raise TraceError("no token windows to trace")
    if moe_layers is None and len(per_layer) == int(cfg.num_hidden_layers):
        moe_layers = list(range(len(per_layer)))
    if moe_layers is not None and len(moe_layers) != len(per_layer):
        raise TraceError(
            f"moe_layers names {len(moe_layers)} layers, the model returned {len(per_layer)}"
        )
    return trace_from_router_logits(
        [np.concatenate(chunks) for chunks in per_layer],
        top_k,
        normalize_topk=normalize,
        segments=np.concatenate(segs),
        model_id=model_id,
        text_sha256=text_sha256,
        moe_layers=moe_layers,
    )


def text_sha256(data: bytes) -> str:
    """Hex SHA-256 of the traced text, for :attr:`RoutingTrace.text_sha256`."""
    return hashlib.sha256(data).hexdigest()
