"""The generic MoE decoder: the forward pass every supported architecture shares.

Scope: reading a config into a :class:`DecoderConfig`, loading the resident
trunk through the consumer by role (or, with ``trunk_window``, its small
tensors resident and its big matrices through a
:class:`~inference.trunkwindow.TrunkWindow`), and the pre-norm decoder loop
(attention with a KV cache, then a routed-expert MLP) with hooks an
architecture overrides: :meth:`MoEDecoder.post_qkv` (q/k norms, clipping),
:meth:`MoEDecoder.position_qk` and :meth:`MoEDecoder.attend` (NoPE layers, chunked
attention), :meth:`MoEDecoder.routed_extra` (a shared expert) and
:meth:`MoEDecoder.parse_config`.

Routed experts are reached only through the :class:`~inference.cache.ExpertCache`:
router -> top-k bytes -> slot. In a batch (prefill) the tokens are grouped
by expert, so each expert is fetched and multiplied once per layer, as one
matrix product over its tokens; when the layer touches more experts than the
cache may hold at once (``max_acquire``), they run in waves of that many
(residents first), so every expert is still read at most once per batch.
A single token (decode) runs in the C kernels of
:mod:`inference.kernels.fused`: one call for the attention block, one for the
routing, the cache's acquire, one call for all the layer's routed experts.
Each token's expert outputs land in a fixed ``[T, top_k, H]`` buffer and
are summed in top-k order, so the result does not depend on the order in
which experts were found resident or fetched: tiered and fully resident
runs are bit-identical.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np

from czyx.errors import CzyxError
from czyx.inference.cache import ExpertCache
from czyx.inference.errors import MissingTensorError, ScopeRoutingError, UnsupportedModelError
from czyx.inference.kernels import fused
from czyx.inference.kernels.linear import Weight, mm_t, take_rows
from czyx.inference.kernels.ops import prepare
from czyx.inference.models.base import (
    F32,
    KVCache,
    Observe,
    attention,
    group_by_expert,
    matmul_small,
    rms_norm,
    route_topk,
    sigmoid,
    swiglu,
    swiglu_columns,
    swiglu_fused,
)
from czyx.inference.models.rope import RopeConfig, Rotary, rope_config, with_freq_factors
from czyx.inference.profile import RouteRecorder
from czyx.inference.trunkwindow import TrunkWindow, TrunkWindowStats
from czyx.store.consumer import ModelConsumer, ModelInfo
from czyx.store.models.archs import ALL_LAYER_ROLES
from czyx.store.models.rope import FREQ_FACTORS


@dataclass(frozen=True)
class DecoderConfig:
    """The architecture facts the forward pass needs, normalised across configs."""

    arch: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    rms_eps: float
    rope: RopeConfig
    renormalize: bool
    sparse_layers: tuple[bool, ...]  # True where the layer routes to experts
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    clip_qkv: float | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def n_sparse_experts(self) -> int:
        """How many routed (layer, expert) pairs the model has."""
        return sum(self.sparse_layers) * self.n_experts


def _need(config: dict[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise UnsupportedModelError(f"config field {key!r} is missing")
    return config[key]


def eos_ids(config: dict[str, Any]) -> tuple[int, ...]:
    """The config's ``eos_token_id`` as a tuple (it may be absent, an int or a list)."""
    eos = config.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))


def common_config(
    info: ModelInfo, renormalize: bool, sliding_windows: list[int | None]
) -> DecoderConfig:
    """Fields every supported config spells the same way.

    The architecture facts (layer and expert counts, width, which layers are
    sparse) are the store's normalisation, :attr:`ModelInfo.facts`
    (``czyx.store.models.archs``), not derived here a second time.
    """
    c = info.config
    if c.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"config hidden_act={c['hidden_act']!r} (only silu)")
    try:
        facts = info.facts
    except CzyxError as exc:
        raise UnsupportedModelError(str(exc)) from exc
    hidden = facts.hidden_size
    n_heads = int(_need(c, "num_attention_heads"))
    head_dim = int(c.get("head_dim") or hidden // n_heads)
    n_layers, n_experts = facts.n_layers, facts.n_experts
    if n_experts != info.n_experts or n_layers != info.n_layers:
        raise UnsupportedModelError(
            f"config says {n_layers} layers x {n_experts} experts but the mount says "
            f"{info.n_layers} x {info.n_experts}"
        )
    routed = set(facts.sparse_layers) if n_experts > 0 else set()
    sparse = tuple(i in routed for i in range(n_layers))
    return DecoderConfig(
        arch=info.arch,
        vocab_size=int(_need(c, "vocab_size")),
        hidden_size=hidden,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(c.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        n_experts=n_experts,
        top_k=int(_need(c, "num_experts_per_tok")),
        rms_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope=rope_config(c, head_dim),
        renormalize=renormalize,
        sparse_layers=sparse,
        sliding_windows=tuple(sliding_windows),
        clip_qkv=c.get("clip_qkv"),
        eos_token_ids=eos_ids(c),
    )


class Layer:
    """The trunk tensors of one decoder layer, by role (None when absent), and its index."""

    # Every per-layer role the store knows (``czyx.store.models.archs``), in one
    # fixed order: the roles are listed once, in the store.
    __slots__ = ("index", *sorted(ALL_LAYER_ROLES))

    def __init__(self, index: int = -1) -> None:
        for name in self.__slots__:
            setattr(self, name, None)
        self.index = index

    def arrays(self) -> list[Weight]:
        """The tensors it holds (every role that is not None)."""
        return [w for name in ROLE_SLOTS if (w := getattr(self, name)) is not None]


ROLE_SLOTS = tuple(name for name in Layer.__slots__ if name != "index")

#: The steps of a layer's attention an architecture may override. A class that
#: overrides any of them attends through its own :meth:`MoEDecoder._attention` in
#: numpy: never the C attention call (rope, sliding window and softmax as the base
#: does them), and one sequence at a time in a batched step (``inference.batch``).
ATTENTION_STEPS = ("_attention", "position_qk", "attend")


class MoEDecoder:
    """A pre-norm MoE transformer decoder over a :class:`ModelConsumer`.

    Subclasses set :attr:`arch`, implement :meth:`parse_config`, and list in
    :attr:`required_roles` / :attr:`optional_roles` the per-layer trunk roles
    they use.

    With ``trunk_window=K`` the per-layer roles in :attr:`window_roles` (the
    big matrices: attention projections, dense and shared-expert MLPs) are
    not held: at most K layers of them are, in a
    :class:`~inference.trunkwindow.TrunkWindow` that reads layer ``i + 1``
    while layer ``i`` computes (give it a consumer opened with
    ``lazy_trunk=True``, or nothing is saved). :attr:`layers` then holds
    each layer's small tensors only (norms, routers, biases, gates): the
    streaming cache's look-ahead needs every layer's router and norm at any
    time, and they are ``E x H`` and ``H`` floats.
    """

    arch: ClassVar[str] = ""
    #: Llama 4 scales a routed expert's *input* by its router weight (and adds its
    #: output unweighted); every other architecture weights the output.
    weight_expert_input: ClassVar[bool] = False
    required_roles: ClassVar[tuple[str, ...]] = (
        "input_norm",
        "post_attn_norm",
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
    )
    optional_roles: ClassVar[tuple[str, ...]] = ("q_bias", "k_bias", "v_bias")
    sparse_roles: ClassVar[tuple[str, ...]] = ("router",)
    dense_roles: ClassVar[tuple[str, ...]] = ("mlp_gate_proj", "mlp_up_proj", "mlp_down_proj")
    window_roles: ClassVar[frozenset[str]] = frozenset(
        (
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "mlp_gate_proj",
            "mlp_up_proj",
            "mlp_down_proj",
            "shared_gate_proj",
            "shared_up_proj",
            "shared_down_proj",
        )
    )

    def __init__(
        self, consumer: ModelConsumer, experts: ExpertCache, trunk_window: int | None = None
    ) -> None:
        self.consumer = consumer
        self.cfg = self.parse_config(consumer.info)
        if self.cfg.rope.params is not None and self.cfg.rope.params.rope_type == FREQ_FACTORS:
            # a GGUF's rope_freqs (inference.models.rope): the trunk's factors feed the rope
            ff = self._trunk("rope_freqs", None, (self.cfg.rope.rotary_dim // 2,))
            self.cfg = replace(self.cfg, rope=with_freq_factors(self.cfg.rope, ff))
        self.experts = experts
        cfg = self.cfg
        self.embed = self._trunk("embed", None, (cfg.vocab_size, cfg.hidden_size))
        self.final_norm = self._trunk("final_norm", None, (cfg.hidden_size,))
        # A LayerNorm's bias (PhiMoE); None for the RMSNorm architectures.
        self.final_norm_bias = (
            self._trunk("final_norm_bias", None, (cfg.hidden_size,))
            if consumer.has_trunk("final_norm_bias")
            else None
        )
        if consumer.has_trunk("lm_head"):
            self.lm_head = self._trunk("lm_head", None, (cfg.vocab_size, cfg.hidden_size))
        else:  # tied embeddings
            self.lm_head = self.embed
        # None on the resident path: forward then pays one local test per layer.
        self.trunk_window: TrunkWindow[Layer] | None = None
        if trunk_window is None:
            self.layers = [self._load_layer(i) for i in range(cfg.n_layers)]
        else:
            self.layers = [self._load_layer(i, self.window_roles) for i in range(cfg.n_layers)]
            self.trunk_window = TrunkWindow(
                cfg.n_layers, trunk_window, self._window_layer, self._window_nbytes
            )
        self.rotary = Rotary(cfg.rope)
        # Rope types whose tables depend on the length reached (dynamic NTK, LongRoPE):
        # numpy attention updates them in Rotary.apply; the C attention call reads the
        # tables as they are, so the decode step updates them first.
        self._length_rope = self.rotary.params.rope_type in ("dynamic", "longrope")
        # Calibration hook: called as observer(input name, rows) with the input of
        # every matrix product (names of store.quant.names.input_key); None in
        # normal runs, so the forward pass pays one attribute test per product.
        self.observer: Callable[[str, np.ndarray], None] | None = None
        # Top-k selections per (layer, expert): the routing profile of everything run.
        self.route_counts = np.zeros((cfg.n_layers, cfg.n_experts), np.int64)
        # Its rows, for the decode step's count: a row view indexed by the top-k is a
        # fraction of the cost of the two-dimensional fancy index.
        self._count_rows = list(self.route_counts)
        # Optional per-token recorder (czyx profile): None on the ordinary path.
        self.recorder: RouteRecorder | None = None
        # Called as layer_hook(i, h) with the residual stream entering layer i, before
        # its attention (the streaming cache predicts layer i's experts from it while
        # the attention computes); None on the ordinary path.
        self.layer_hook: Callable[[int, np.ndarray], None] | None = None
        # Called as route_hook(i, x) with the input of layer i's routed experts, before
        # they are routed (the streaming cache's look-ahead predicts the next sparse
        # layer from it); None on the ordinary path.
        self.route_hook: Callable[[int, np.ndarray], None] | None = None
        # Called as hidden_hook(kv, start, h) with the residual stream after the last layer,
        # before the final norm, of every position a forward computed (``h [T, H]``: the
        # positions ``start ..`` of the KV cache ``kv``), on every path (numpy, C, batched):
        # the multi-token-prediction drafter's input (:mod:`czyx.inference.mtp`). None on
        # the ordinary path.
        self.hidden_hook: Callable[[KVCache, int, np.ndarray], None] | None = None
        # bool [n_layers, n_experts] of the experts a scoped portal permits, or None
        # (everything): routing then picks its top-k among the permitted only.
        self.route_mask: np.ndarray | None = routing_mask(consumer, cfg)
        # The decode step's C kernels (inference.kernels.fused), made on first use with
        # `threads` threads; None where the extension is not compiled (numpy path).
        self.threads = fused.default_threads()
        self._kernels: fused.DecodeKernels | None = None
        self._plain_routing = type(self).route is MoEDecoder.route
        # The C kernels normalise by RMSNorm: an architecture with another norm (PhiMoE's
        # LayerNorm) runs every step in numpy.
        self._czk = fused.have_czk() and type(self).norm is MoEDecoder.norm
        cls = type(self)
        # Whether a one-token step needs no numpy product (see decode_in_c).
        # How the C attention call reproduces post_qkv (None: it cannot).
        self._c_qkv = self.c_post_qkv()

        def in_c(m: str) -> bool:
            if m == "post_qkv":
                return self._c_qkv is not None
            return getattr(cls, m) is getattr(MoEDecoder, m)

        # The C MoE calls weight each expert's output: a model that weights its input
        # (weight_expert_input) must take the numpy routed path, however it routes.
        weighs_output = not cls.weight_expert_input
        self._all_c = (
            self._czk
            and weighs_output
            and all(map(in_c, self._C_DECODE_BASE))
            and all(cfg.sparse_layers)
        )
        self._fast_attn = all(map(in_c, self._C_ATTN_BASE))
        # Whether a decode layer may go straight from the attention call to the routed
        # call (_routed_one), skipping the _mlp -> _routed dispatch that, for this
        # class, would arrive there anyway (checked per step: no mask, no observer,
        # no instance override of _routed).
        self._direct_moe = (
            self._plain_routing
            and weighs_output
            and all(cfg.sparse_layers)
            and all(getattr(cls, m) is getattr(MoEDecoder, m) for m in self._DIRECT_BASE)
        )

    @classmethod
    def parse_config(cls, info: ModelInfo) -> DecoderConfig:
        """Normalise the checkpoint config of this architecture."""
        raise NotImplementedError

    # ------------------------------------------------------------------ loading

    def _trunk(self, role: str, layer: int | None, shape: tuple[int, ...] | None) -> Weight:
        where = f"role {role!r}" + ("" if layer is None else f" of layer {layer}")
        if not self.consumer.has_trunk(role, layer):
            raise MissingTensorError(f"the {self.arch} trunk has no {where}")
        packed = getattr(self.consumer, "trunk_quantized", None)
        q = packed(role, layer) if packed is not None else None
        if q is not None:  # a quantized tensor: products run on the packed bytes
            t = prepare(*q)
        else:
            t = np.ascontiguousarray(self.consumer.trunk(role, layer), dtype=F32)
        if shape is not None and t.shape != shape:
            raise MissingTensorError(f"{where} has shape {t.shape}, expected {shape}")
        return t

    def _roles(self, i: int) -> tuple[str, ...]:
        return self.required_roles + (
            self.sparse_roles if self.cfg.sparse_layers[i] else self.dense_roles
        )

    def _load_layer(self, i: int, skip: frozenset[str] = frozenset()) -> Layer:
        """Layer ``i``'s tensors but those in ``skip`` (checked present, not read)."""
        lw = Layer(i)
        for role in self._roles(i):
            if role not in skip:
                setattr(lw, role, self._trunk(role, i, None))
            elif not self.consumer.has_trunk(role, i):
                raise MissingTensorError(f"the {self.arch} trunk has no role {role!r} of layer {i}")
        for role in self.optional_roles:
            if role not in skip and self.consumer.has_trunk(role, i):
                setattr(lw, role, self._trunk(role, i, None))
        if self.cfg.sparse_layers[i]:
            want = (self.cfg.n_experts, self.cfg.hidden_size)
            if lw.router.shape != want:
                raise MissingTensorError(
                    f"router of layer {i} has shape {lw.router.shape}, expected {want}"
                )
        return lw

    def _window_layer(self, i: int) -> Layer:
        """Layer ``i`` whole: its resident small tensors plus its big matrices, read now."""
        base = self.layers[i]
        lw = Layer(i)
        for name in ROLE_SLOTS:
            setattr(lw, name, getattr(base, name))
        for role in self._roles(i) + self.optional_roles:
            if role in self.window_roles and self.consumer.has_trunk(role, i):
                setattr(lw, role, self._trunk(role, i, None))
        return lw

    def _window_nbytes(self, lw: Layer) -> int:
        """Bytes of a window layer's own matrices (its small tensors are shared)."""
        return sum(int(w.nbytes) for r in self.window_roles if (w := getattr(lw, r)) is not None)

    def trunk_nbytes(self) -> int:
        """Bytes of trunk tensors this decoder holds resident (each array once).

        With a trunk window: the global tensors, every layer's small tensors,
        plus the window's peak (the most its layers held at once).
        """
        arrays = {id(a): a for a in (self.embed, self.final_norm, self.lm_head)}
        for lw in self.layers:
            arrays.update((id(a), a) for a in lw.arrays())
        total = sum(int(a.nbytes) for a in arrays.values())
        if self.trunk_window is not None:
            total += self.trunk_window.stats().peak_bytes
        return total

    def window_stats(self) -> TrunkWindowStats | None:
        """The trunk window's counters, or None on the resident path."""
        return None if self.trunk_window is None else self.trunk_window.stats()

    def set_threads(self, threads: int) -> None:
        """Run the decode kernels on ``threads`` threads (results do not depend on it)."""
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = int(threads)
        if self._kernels is not None:
            self._kernels.close()
            self._kernels = None

    def close(self) -> None:
        """Stop the trunk window's loader and the kernels' threads; drop the window's layers."""
        if self.trunk_window is not None:
            self.trunk_window.close()
        if self._kernels is not None:
            self._kernels.close()
            self._kernels = None

    # ------------------------------------------------------------------ hooks

    def norm(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        """The decoder's normalisation of ``x [T, H]`` (RMSNorm; ``bias`` is None here).

        An architecture with another norm (PhiMoE's LayerNorm) overrides it; the
        C decode kernels then step aside (they implement RMSNorm), and every path
        that normalises (the batched step's too) calls this.
        """
        return rms_norm(x, weight, self.cfg.rms_eps)

    def post_qkv(
        self, lw: Layer, q: np.ndarray, k: np.ndarray, v: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Transform the projected ``[T, width]`` q/k/v before RoPE (q/k norms, clipping)."""
        return q, k, v

    def c_post_qkv(self) -> tuple[int, float | None] | None:
        """How the C attention call reproduces :meth:`post_qkv`, or None when it cannot.

        Returns ``(qk_norm, clip)`` for :meth:`DecodeKernels.attention
        <czyx.inference.kernels.fused.DecodeKernels.attention>`: the base's
        identity is ``(0, None)``. A subclass whose :meth:`post_qkv` the kernel
        implements overrides both together; one that overrides
        :meth:`post_qkv` alone gets None here, and numpy attention.
        """
        return (0, None) if type(self).post_qkv is MoEDecoder.post_qkv else None

    def finish_qkv(
        self, lw: Layer, q: np.ndarray, k: np.ndarray, v: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The projected ``[T, width]`` q/k/v plus their biases (if any), then :meth:`post_qkv`.

        Row-independent, so the single-sequence and the batched paths share it.
        """
        if lw.q_bias is not None:
            q = q + lw.q_bias
        if lw.k_bias is not None:
            k = k + lw.k_bias
        if lw.v_bias is not None:
            v = v + lw.v_bias
        return self.post_qkv(lw, q, k, v)

    def routed_extra(self, lw: Layer, x: np.ndarray, routed: np.ndarray) -> np.ndarray:
        """Combine the routed-expert output with anything else the MLP adds (shared expert)."""
        return routed

    def add_ungated_shared(self, lw: Layer, x: np.ndarray, routed: np.ndarray) -> np.ndarray:
        """``routed`` plus the layer's ungated shared-expert SwiGLU (none: ``routed``).

        The ``routed_extra`` of every architecture whose shared experts are added
        without a gate (DeepSeek/MLA, GLM-4.5, ERNIE 4.5), written once here.
        """
        if lw.shared_gate_proj is None:
            return routed
        observe = None
        if self.observer is not None:
            observe = self._observe(f"L{lw.index}.shared.down_in")
        return routed + swiglu(
            x, lw.shared_gate_proj, lw.shared_up_proj, lw.shared_down_proj, observe
        )

    def add_gated_shared(self, lw: Layer, x: np.ndarray, routed: np.ndarray) -> np.ndarray:
        """``routed`` plus the layer's shared expert scaled by its sigmoid gate
        (:func:`shared_expert`): the ``routed_extra`` of Qwen2-MoE and Qwen3-Next."""
        observe = None
        if self.observer is not None:  # calibrating: name the shared expert's down input
            observe = self._observe(f"L{lw.index}.shared.down_in")
        return routed + shared_expert(lw, x, observe)

    def route(
        self, lw: Layer, x: np.ndarray, mask: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k expert indices ``[T, k]`` and weights of tokens ``x``: softmax routing.

        ``mask`` (``bool [E]``, a scoped portal's permitted experts) restricts the
        choice to permitted experts. Architectures with another scoring (DeepSeek's
        sigmoid and group-limited selection, GPT-OSS's router bias) override this.
        """
        return route_topk(mm_t(x, lw.router), self.cfg.top_k, self.cfg.renormalize, mask)

    # ------------------------------------------------------------------ forward

    @property
    def kv_layers(self) -> int:
        """Layers that keep keys and values: all of them (a hybrid's attention layers only)."""
        return self.cfg.n_layers

    @property
    def recurrent_nbytes(self) -> int:
        """Bytes of one sequence's fixed-size recurrent state: none (a hybrid's, constant)."""
        return 0

    def new_kv(self, capacity: int = 64) -> KVCache:
        """An empty KV cache sized for this model."""
        return KVCache(self.cfg.n_layers, self.cfg.n_kv_heads, self.cfg.head_dim, capacity)

    def forward(self, tokens: np.ndarray, kv: KVCache, all_logits: bool = False) -> np.ndarray:
        """Run ``tokens`` (``[T]`` ids) after the ``kv.length`` cached positions.

        Returns the logits of the last token ``[V]``, or of every token
        ``[T, V]`` with ``all_logits``. The KV cache grows by T.
        """
        cfg = self.cfg
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        t = tokens.size
        if t == 1 and self.observer is None and self._czk:
            tok = int(tokens[0])
            if not 0 <= tok < cfg.vocab_size:
                raise ValueError(f"token id out of range 0..{cfg.vocab_size - 1}")
            kv.reserve(kv.length + 1)
            return self._forward_one(tok, kv, all_logits)
        if t == 0:
            raise ValueError("forward needs at least one token")
        if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
            raise ValueError(f"token id out of range 0..{cfg.vocab_size - 1}")
        start = kv.length
        kv.reserve(start + t)
        h = self.run_layers(take_rows(self.embed, tokens), kv, start, 0, cfg.n_layers)
        kv.length = start + t
        if self.hidden_hook is not None:
            self.hidden_hook(kv, start, h)
        if not all_logits:
            h = h[-1:]
        hn = self.norm(h, self.final_norm, self.final_norm_bias)
        if self.observer is not None:
            self.observer("lm_head_in", hn)
        with self.kernel_threads():
            out = self.finish_logits(mm_t(hn, self.lm_head))
        return out if all_logits else out[0]

    def kernel_threads(self) -> AbstractContextManager[None]:
        """A scope in which this thread's quantized products (a prompt's) run on the
        decode kernels' threads (:func:`~czyx.inference.kernels.fused.pool_scope`)."""
        return fused.pool_scope(self.kernels().pool if self._czk else None)

    def finish_logits(self, logits: np.ndarray) -> np.ndarray:
        """The last step of the head on the LM head's output (identity; an architecture
        with a logit scale overrides it). Every path that ends in logits calls it."""
        return logits

    def run_layers(self, h: np.ndarray, kv: KVCache, start: int, lo: int, hi: int) -> np.ndarray:
        """Layers ``lo..hi-1`` over the residual stream ``h [T, H]`` of the positions from
        ``start``: the several-token step of :meth:`forward`, also a pipeline stage's
        (:mod:`inference.distributed.stages`), so both run the very same code.

        Writes those layers' KV at ``start..start+T-1`` (the caller reserved it and
        advances ``kv.length``); returns the residual stream after layer ``hi - 1``.
        """
        positions = np.arange(start, start + h.shape[0])
        window = self.trunk_window
        with self.kernel_threads():
            for i in range(lo, hi):
                lw = window.layer(i) if window is not None else self.layers[i]  # window: waits
                if self.layer_hook is not None:
                    self.layer_hook(i, h)
                x = self.norm(h, lw.input_norm, lw.input_norm_bias)
                h = h + self._attention(i, lw, x, kv, start, positions)
                x = self.norm(h, lw.post_attn_norm, lw.post_attn_norm_bias)
                h = h + self._mlp(i, lw, x)
        return h

    # Steps the C decode path implements itself: a subclass overriding any of them
    # (MLA attention and its latent cache, shared experts) decodes in numpy; post_qkv
    # counts as implemented when c_post_qkv describes it (OLMoE's and Qwen3-MoE's q/k norms).
    _C_DECODE_BASE = ("post_qkv", "routed_extra", *ATTENTION_STEPS, "new_kv")
    # The subset the C attention call implements (others run numpy attention per layer).
    _C_ATTN_BASE = ("post_qkv", *ATTENTION_STEPS, "new_kv")
    # The steps a decode layer skips when it calls _routed_one directly.
    _DIRECT_BASE = ("_mlp", "_routed", "_routed_one", "mlp_out", "routed_extra")

    def decode_in_c(self) -> bool:
        """Whether a one-token step runs in the C kernels only (no numpy product, no BLAS).

        False when calibrating (observer set), without the compiled kernels, for
        architectures that override any step the C path implements itself
        (``_C_DECODE_BASE``: q/k transforms, attention, the KV cache, the routed
        output), and with dense MLP layers.
        """
        return self._all_c and self.observer is None

    def kernels(self) -> fused.DecodeKernels:
        """The decode step's kernels and buffers (made on first use)."""
        k = self._kernels
        if k is None:
            cfg = self.cfg
            k = self._kernels = fused.DecodeKernels(
                cfg.hidden_size, cfg.vocab_size, cfg.top_k, self.threads
            )
        return k

    def _forward_one(self, token: int, kv: KVCache, all_logits: bool) -> np.ndarray:
        """One token through the C decode kernels: a few calls per layer.

        The residual stream lives in the kernels' preallocated ``h``; each layer
        is one attention-block call (numpy instead where the architecture
        transforms q/k, :meth:`post_qkv`), then :meth:`_mlp`, whose routed
        part is one routing call, the cache's acquire and one MoE call.
        """
        cfg = self.cfg
        kern = self.kernels()
        start = kv.length
        kern.embed(self.embed, token)
        self.run_layers_one(kern, kv, start, 0, cfg.n_layers)
        kv.length = start + 1
        if self.hidden_hook is not None:
            self.hidden_hook(kv, start, kern.h[None])
        kern.head(self.final_norm, self.lm_head, cfg.rms_eps)
        out = self.finish_logits(kern.logits.copy())
        return out[None] if all_logits else out

    def run_layers_one(
        self, kern: fused.DecodeKernels, kv: KVCache, start: int, lo: int, hi: int
    ) -> None:
        """Layers ``lo..hi-1`` for one token at position ``start``, its residual stream in
        ``kern.h`` (in and out): the C decode step of :meth:`_forward_one`, also a
        pipeline stage's (:mod:`inference.distributed.stages`).

        Each layer is one attention-block call (numpy attention where the
        architecture transforms q/k), then :meth:`_mlp` on ``kern.x2``.
        """
        cfg = self.cfg
        h, h2, x2, y = kern.h, kern.h2, kern.x2, kern.y
        fast_attn = self._fast_attn
        window = self.trunk_window
        layer_hook, route_hook = self.layer_hook, self.route_hook
        direct = (
            self._direct_moe
            and self.route_mask is None
            and self.observer is None
            and "_routed" not in self.__dict__  # a pipeline stage's or test's own routing
        )
        positions = None
        if fast_attn and self._length_rope:
            self.rotary._update(start + 1)  # what Rotary.apply does for numpy attention
        for i in range(lo, hi):
            lw = window.layer(i) if window is not None else self.layers[i]
            if layer_hook is not None:
                layer_hook(i, h2)
            if fast_attn:
                kern.attention(
                    lw, kv.k[i], kv.v[i], start, cfg.sliding_windows[i], self.rotary,
                    cfg.rms_eps, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, *self._c_qkv,
                )  # fmt: skip
            else:
                if positions is None:
                    positions = np.arange(start, start + 1)
                x = self.norm(h2, lw.input_norm, lw.input_norm_bias)
                h += self._attention(i, lw, x, kv, start, positions)[0]
                np.copyto(kern.x, self.norm(h2, lw.post_attn_norm, lw.post_attn_norm_bias)[0])
            if direct:  # what _mlp -> _routed would do, without the dispatch
                if route_hook is not None:
                    route_hook(i, x2)
                self._routed_one(i, lw, kern)
                h += y
            else:
                h += self._mlp(i, lw, x2)[0]

    def _attention(
        self, i: int, lw: Layer, x: np.ndarray, kv: KVCache, start: int, positions: np.ndarray
    ) -> np.ndarray:
        cfg = self.cfg
        t = x.shape[0]
        if self.observer is not None:
            self.observer(f"L{i}.attn_in", x)
        if all(isinstance(m, np.ndarray) for m in (lw.q_proj, lw.k_proj, lw.v_proj)):
            # Column form, as the experts: a tall weight times the tokens as columns,
            # in small unpacked BLAS blocks; q/k/v are [T, width] transposed views.
            # (Not one concatenated [q; k; v] matrix: the consumer keeps its trunk,
            # so a fused copy would hold the attention weights twice.)
            xt = np.ascontiguousarray(x.T)
            q = matmul_small(lw.q_proj, xt).T
            k = matmul_small(lw.k_proj, xt).T
            v = matmul_small(lw.v_proj, xt).T
        else:
            q = mm_t(x, lw.q_proj)
            k = mm_t(x, lw.k_proj)
            v = mm_t(x, lw.v_proj)
        q, k, v = self.finish_qkv(lw, q, k, v)
        hd = cfg.head_dim
        q = q.reshape(t, cfg.n_heads, hd).transpose(1, 0, 2)
        k = k.reshape(t, cfg.n_kv_heads, hd).transpose(1, 0, 2)
        v = v.reshape(t, cfg.n_kv_heads, hd).transpose(1, 0, 2)
        q, k = self.position_qk(i, lw, q, k, positions)
        kv.write(i, start, k, v)
        end = start + t
        out = self.attend(i, lw, q, kv.k[i][:, :end], kv.v[i][:, :end], positions)
        if self.observer is not None:
            self.observer(f"L{i}.o_in", out)
        if isinstance(lw.o_proj, np.ndarray):
            out = matmul_small(lw.o_proj, np.ascontiguousarray(out.T)).T
        else:
            out = mm_t(out, lw.o_proj)
        # A layer's o_bias (an optional role), as the C attention call adds it too.
        return out if lw.o_bias is None else out + lw.o_bias

    def position_qk(
        self, i: int, lw: Layer, q: np.ndarray, k: np.ndarray, positions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Give layer ``i``'s queries ``[n_heads, T, hd]`` and keys their ``positions``: RoPE.

        An architecture that places queries and keys otherwise overrides it
        (NoPE layers, norms after the rotation, a query temperature); the C
        attention call rotates by itself, so such a model attends in numpy
        (:data:`ATTENTION_STEPS`).
        """
        return self.rotary.apply(q, positions), self.rotary.apply(k, positions)

    def attend(
        self, i: int, lw: Layer, q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray
    ) -> np.ndarray:
        """Layer ``i``'s attention of the placed queries ``q`` at positions ``pos`` over its
        cached keys and values ``k``, ``v`` (``[n_kv_heads, L, hd]``, positions ``0..L-1``).

        Causal, within the layer's sliding window; returns ``[T, n_heads * hd]``
        (:func:`~czyx.inference.models.base.attention`). An architecture with
        another mask (chunks) or score (sinks) overrides it, and attends in numpy
        (:data:`ATTENTION_STEPS`).
        """
        return attention(q, k, v, pos, self.cfg.sliding_windows[i])

    def _observe(self, name: str) -> Observe:
        """The calibration hook for the input called ``name``, or None when not calibrating."""
        obs = self.observer
        return None if obs is None else (lambda a: obs(name, a))

    def _mlp(self, i: int, lw: Layer, x: np.ndarray) -> np.ndarray:
        if self.observer is not None:
            self.observer(f"L{i}.moe_in", x)
        if not self.cfg.sparse_layers[i]:
            return self.mlp_out(
                swiglu(
                    x,
                    lw.mlp_gate_proj,
                    lw.mlp_up_proj,
                    lw.mlp_down_proj,
                    self._observe(f"L{i}.mlp.down_in"),
                )
            )
        return self.mlp_out(self.routed_extra(lw, x, self._routed(i, lw, x)))

    def mlp_out(self, y: np.ndarray) -> np.ndarray:
        """The MLP block's output before its residual add (identity; an architecture with
        a residual multiplier overrides it). The batched step calls it too."""
        return y

    def count_routes(self, i: int, idx: np.ndarray, w: np.ndarray) -> None:
        """Add layer ``i``'s routes ``idx [T, k]`` to the counts and the recorder (if any)."""
        self.route_counts[i] += np.bincount(idx.ravel(), minlength=self.cfg.n_experts)
        if self.recorder is not None:
            self.recorder.record(i, idx, w)

    def _routed(self, i: int, lw: Layer, x: np.ndarray) -> np.ndarray:
        if self.route_hook is not None:
            self.route_hook(i, x)
        cfg = self.cfg
        mask = None if self.route_mask is None else self.route_mask[i]
        kern = self._kernels
        # The C decode path routes by softmax top-k itself: only for the base scoring
        # and an unrestricted portal; overridden scorings and masks take the numpy path.
        plain = self._plain_routing and not self.weight_expert_input
        if kern is not None and x is kern.x2 and mask is None and plain:
            return self._routed_one(i, lw, kern)
        idx, w = self.route(lw, x, mask)
        self.count_routes(i, idx, w)
        t = x.shape[0]
        contrib = np.zeros((t, cfg.top_k, cfg.hidden_size), F32)
        cache = self.experts
        if t == 1:
            # Decode: the token's top-k experts are distinct; hold them all together.
            order = idx[0]
        else:
            # Prefill: one fetch and one batched matmul per distinct expert, residents first
            # (so a small budget evicts only after the hits are used). The (token, k) pairs
            # are sorted by expert once; each expert's pairs are then one slice.
            pairs, counts, ends, order = group_by_expert(idx, cfg.n_experts, cache.table[i])
            wflat = w.reshape(-1)
            cflat = contrib.reshape(t * cfg.top_k, cfg.hidden_size)
            # Tokens as columns, once: each expert gathers its columns from here.
            xt = np.ascontiguousarray(x.T)
        chunk = cache.max_acquire
        scale_in = self.weight_expert_input
        for c0 in range(0, len(order), chunk):
            group = order[c0 : c0 + chunk]
            slots = cache.acquire(i, group)
            try:
                for j, s in enumerate(slots.tolist()):
                    gate_up, down = cache.weights(s)
                    e = int(group[j])
                    if t == 1:
                        xe = x * w[0, j] if scale_in else x
                        if self.observer is not None:
                            self.observer(f"L{i}.E{e}.in", xe)
                        y = swiglu_fused(xe, gate_up, down, self._observe(f"L{i}.E{e}.down_in"))
                        contrib[0, j] = y[0] if scale_in else y[0] * w[0, j]
                        continue
                    sel = pairs[ends[e] - counts[e] : ends[e]]  # flat (token, k) indices
                    rows = sel // cfg.top_k
                    obs = self._observe(f"L{i}.E{e}.down_in")
                    if isinstance(gate_up, np.ndarray):
                        xe = np.take(xt, rows, axis=1)  # C order: [H, n]
                        if scale_in:
                            xe *= wflat[sel]
                        if self.observer is not None:
                            self.observer(f"L{i}.E{e}.in", xe.T)
                        y = swiglu_columns(xe, gate_up, down, obs).T
                    else:
                        xe = x[rows] * wflat[sel, None] if scale_in else x[rows]
                        if self.observer is not None:
                            self.observer(f"L{i}.E{e}.in", xe)
                        y = swiglu_fused(xe, gate_up, down, obs)
                    cflat[sel] = y if scale_in else y * wflat[sel, None]
            finally:
                cache.release()
        # Fixed top-k order: independent of which experts hit or missed.
        return contrib.sum(axis=1)

    def _routed_one(self, i: int, lw: Layer, kern: fused.DecodeKernels) -> np.ndarray:
        """The routed experts of one token (in ``kern.x``): one routing call, one MoE call.

        The same sum as the batch path: the top-k outputs weighted and added in
        top-k order, so tiered and resident runs stay bit-identical.
        """
        cfg = self.cfg
        kern.route(lw.router, cfg.top_k, cfg.renormalize)
        idx = kern.idx
        self._count_rows[i][idx] += 1  # a token's top-k experts are distinct
        if self.recorder is not None:
            self.recorder.record(i, idx[None].copy(), kern.w[None].copy())
        cache = self.experts
        slots, pending = cache.acquire_streamed(i, idx)
        try:
            if pending:  # reads in flight: compute the resident experts while they land
                kern.moe_streamed(cache, slots, kern.w, pending, cache.wait_ready)
            else:
                kern.moe(cache, slots, kern.w)
        finally:
            cache.release()
        return kern.y2


def routing_mask(consumer: ModelConsumer, cfg: DecoderConfig) -> np.ndarray | None:
    """The experts the consumer's portal permits, as the router's mask (None: all).

    Why here: a class or layer caveat must constrain *routing*, not only reads,
    or the router picks an expert the portal forbids and the run fails at its
    read. A sparse layer with fewer permitted experts than ``top_k`` cannot be
    run faithfully and is refused.

    Raises
    ------
    ScopeRoutingError
    """
    allowed = getattr(consumer, "allowed_experts", None)
    if allowed is None:
        return None
    allowed = np.asarray(allowed, bool)[:, : cfg.n_experts]
    if allowed.all():
        return None
    for i in range(cfg.n_layers):
        if cfg.sparse_layers[i] and int(allowed[i].sum()) < cfg.top_k:
            raise ScopeRoutingError(
                f"the portal permits {int(allowed[i].sum())} of {cfg.n_experts} experts at "
                f"layer {i}, but the model routes each token to {cfg.top_k}; grant more classes"
            )
    return np.ascontiguousarray(allowed)


def describe_restriction(mask: np.ndarray | None, cfg: DecoderConfig) -> str | None:
    """One line for the run's figures: how a portal restricted routing (None: it did not)."""
    if mask is None:
        return None
    sparse = [i for i in range(cfg.n_layers) if cfg.sparse_layers[i]]
    counts = sorted({int(mask[i].sum()) for i in sparse})
    span = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return (
        f"routing restricted by the portal: top-{cfg.top_k} over {span} of {cfg.n_experts} "
        f"experts in {len(sparse)} sparse layers (weights renormalised over them)"
    )


def shared_expert(lw: Layer, x: np.ndarray, observe: Observe = None) -> np.ndarray:
    """Qwen2-MoE's shared expert, scaled by its sigmoid gate (``observe``: its down input)."""
    y = swiglu(x, lw.shared_gate_proj, lw.shared_up_proj, lw.shared_down_proj, observe)
    return sigmoid(mm_t(x, lw.shared_expert_gate)) * y
