"""DeepSeek-V3 / GLM-4.5 multi-token prediction (MTP) as a draft head: ``--speculate mtp``.

Scope: :class:`MTPConsumer` (the kept MTP layer of a mounted version seen as a
one-layer model of the same architecture), :class:`MTPHead` (the module's forward)
and :class:`MTPDrafter` (the :class:`~czyx.inference.speculative.Drafter` that
chains it).

The module (DeepSeek-V3 report, section 2.2; the layout of the published
checkpoints, ``model.layers.<num_hidden_layers>.*``, GLM-4.5's the same) at depth 1,
for position ``i``: ``x = eh_proj(concat(enorm(emb(t[i+1])), hnorm(h[i])))`` where
``h[i]`` is the main model's residual stream after its last layer, before its final
norm; then one decoder block (attention over the module's own cache of positions,
then the routed MoE or dense MLP the layer's tensors say); then
``shared_head.norm`` and the head give the logits of ``t[i+2]``. The concat order
(the token's embedding first, the hidden state second) and the tensor names are
those vLLM's ``deepseek_mtp.py`` (``DeepSeekMultiTokenPredictorLayer``) and
SGLang's ``deepseek_nextn.py`` (``DeepseekModelNextN``) load and run. The
embedding and head are the layer's own ``embed_tokens`` and ``shared_head.head``
(as vLLM loads them), the main model's where the checkpoint left them out
(SGLang always takes the main model's: published checkpoints store copies). The
module's position ``i`` is rotated as position ``i`` (the target's positions, as
both pass them). vLLM zeroes the embedding at position 0; SGLang does not, and
neither does this (it changes only the first prompt position's cache entry).

The block is the architecture's own decoder class run over :class:`MTPConsumer`
(:meth:`~czyx.inference.models.decoder.MoEDecoder.run_layers`): the same
attention, routing and expert code as the main model, no second copy. Its routed
experts are kept by mount as verbatim trunk records (role ``"mtp"``), not in the
expert space: the consumer converts one to float32 when the block's own expert
cache reads it (an ordinary :class:`~czyx.inference.cache.ExpertCache` under the
draft budget), so only the experts drafting routes to are held.

Drafting ``k`` tokens chains the head as DeepSeek's and SGLang's multi-step drafts
do: draft ``j + 1`` takes the module's own output hidden state (before
``shared_head.norm``) at draft ``j`` in place of the main model's, and draft ``j``'s
token. Those chained positions are dropped from the module's cache at the next
call, which first brings it up to the accepted text with the main model's hidden
states (:attr:`MoEDecoder.hidden_hook` hands them over from every forward), so
rejected drafts never leave a trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from czyx.inference.kernels.linear import mm_t, take_rows
from czyx.inference.models.base import F32, KVCache
from czyx.inference.options import EngineOptions
from czyx.inference.speculative import SpeculationError, common_prefix
from czyx.store.consumer import ExpertExtent, ModelInfo, gate_up_down_views
from czyx.store.models.archs import arch_for_config

if TYPE_CHECKING:
    from czyx.inference.engine import Engine

#: The module's own tensors (beside its decoder block), by name after the layer prefix.
OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "embed_tokens.weight")
HEAD = ("shared_head.norm.weight", "shared_head.head.weight")


def no_mtp(info: ModelInfo) -> SpeculationError:
    """The one-line refusal of ``--speculate mtp`` for a model without an MTP layer."""
    n = int(info.config.get("num_nextn_predict_layers") or 0)
    return SpeculationError(
        f"speculate mtp: the {info.arch} model has no multi-token-prediction layer "
        f"(num_nextn_predict_layers is {n}, or its tensors were not kept)"
    )


class MTPConsumer:
    """The first kept MTP layer of ``source`` as a one-layer model (a ``ModelConsumer``).

    Parameters
    ----------
    source
        The target model's consumer; it must keep MTP tensors (``mtp_names()`` and
        ``mtp_tensor(name)``, as :class:`~czyx.store.models.model.StoreModel` does).

    The block's tensors take their roles from the store's architecture table (the
    layer's names with its index as 0); ``final_norm`` is ``shared_head.norm``,
    ``lm_head`` is ``shared_head.head`` (else the target's head), ``embed`` the layer's
    ``embed_tokens`` (else the target's). Routed experts are read from the kept
    tensors, converted to float32 ``gate | up | down`` extents, when the cache reads them.

    Raises
    ------
    SpeculationError
        The model has no MTP layer, or its block's layout is not one the
        architecture's decoder runs as its layer 0.
    """

    def __init__(self, source: Any) -> None:
        info = source.info
        names = source.mtp_names() if hasattr(source, "mtp_names") else []
        layer = info.n_layers  # the first MTP layer (depth 1)
        prefix = f"model.layers.{layer}."
        mine = [n for n in names if n.startswith(prefix)]
        if not int(info.config.get("num_nextn_predict_layers") or 0) or not mine:
            raise no_mtp(info)
        self._source = source
        spec = arch_for_config(info.config)
        self._trunk: dict[tuple[str, int | None], np.ndarray] = {}
        self.own: dict[str, np.ndarray] = {}
        self._parts: dict[tuple[int, str], str] = {}  # (expert, gate/up/down) -> name
        fused: dict[str, np.ndarray] = {}
        for name in mine:
            rest = name[len(prefix) :]
            if rest in OWN or rest in HEAD:
                self.own[rest] = source.mtp_tensor(name)
                continue
            kind = spec.classify(f"model.layers.0.{rest}")
            if kind is None:
                raise SpeculationError(f"speculate mtp: {name} is not a tensor the decoder runs")
            if kind.kind == "trunk":
                self._trunk[(kind.role, 0)] = source.mtp_tensor(name)
            elif kind.kind == "expert":
                self._parts[(int(kind.expert), str(kind.part))] = name
            else:  # stacked experts: held as they are, sliced per read
                fused[str(kind.part)] = source.mtp_tensor(name)
        missing = [n for n in (*OWN[:3], HEAD[0]) if n not in self.own]
        if missing:
            raise SpeculationError(f"speculate mtp: the MTP layer has no {prefix}{missing[0]}")
        self._fused = fused
        self._trunk[("final_norm", None)] = self.own[HEAD[0]]
        embed = self.own.get("embed_tokens.weight")
        self._trunk[("embed", None)] = source.trunk("embed") if embed is None else embed
        head = self.own.get(HEAD[1])
        if head is None:  # the target's head (its embeddings where they are tied)
            head = source.trunk("lm_head" if source.has_trunk("lm_head") else "embed")
        self._trunk[("lm_head", None)] = head
        sparse = ("router", 0) in self._trunk
        config = dict(info.config, num_hidden_layers=1, num_nextn_predict_layers=0)
        config.pop("mlp_layer_types", None)
        config["first_k_dense_replace"] = 0 if sparse else 1
        config["moe_layer_freq"] = 1
        if spec.sparse_layers(config) != ((0,) if sparse else ()):
            raise SpeculationError(
                f"speculate mtp: a {info.arch} MTP layer cannot be run as a one-layer model"
            )
        facts = info.facts
        self._inter, self._hidden = facts.expert_intermediate, facts.hidden_size
        nbytes = 3 * self._inter * self._hidden * 4
        self.info = ModelInfo(
            arch=info.arch,
            config=config,
            n_layers=1,
            n_experts=info.n_experts,
            expert_nbytes=nbytes,
            expert_slot_nbytes=-(-nbytes // 4096) * 4096,
            expert_format="f32",
            selector=info.selector,
        )

    def has_trunk(self, role: str, layer: int | None = None) -> bool:
        """Whether the block has ``role`` (at ``layer``)."""
        return (role, layer) in self._trunk

    def trunk(self, role: str, layer: int | None = None) -> np.ndarray:
        """The float32 tensor of ``role`` at ``layer``."""
        return self._trunk[(role, layer)]

    def expert_extent(self, layer: int, router_byte: int) -> ExpertExtent:
        """No file behind an MTP expert: it is read through :meth:`read_expert`."""
        return ExpertExtent(block=-1, offset=0, length=self.info.expert_nbytes, checksum=0)

    def _part(self, e: int, part: str) -> np.ndarray:
        name = self._parts.get((e, part))
        if name is not None:
            return self._source.mtp_tensor(name)
        if part == "down" and "down" in self._fused:
            return self._fused["down"][e]
        gate_up = self._fused.get("gate_up")
        if gate_up is None:
            raise SpeculationError(f"speculate mtp: the MTP layer has no {part} of expert {e}")
        return gate_up[e, : self._inter] if part == "gate" else gate_up[e, self._inter :]

    def read_expert(self, layer: int, router_byte: int, slot: np.ndarray) -> None:
        """Expert ``router_byte``'s ``gate | up | down`` as float32 into ``slot``."""
        if layer != 0 or not 0 <= router_byte < self.info.n_experts:
            raise SpeculationError(f"speculate mtp: no expert {router_byte} at layer {layer}")
        out = slot[: self.info.expert_nbytes].view(F32)
        size = self._inter * self._hidden
        for j, part in enumerate(("gate", "up", "down")):
            out[j * size : (j + 1) * size] = self._part(router_byte, part).reshape(-1)

    def expert_views(self, slot: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(gate, up, down)`` views of a slot."""
        return gate_up_down_views(slot, self.info.expert_nbytes, self._inter, self._hidden, F32)

    def close(self) -> None:
        """Nothing to release (the source is the target's)."""


class MTPHead:
    """The MTP module's forward over its own engine (block, expert cache and KV cache).

    Parameters
    ----------
    target
        The main model's engine (its consumer keeps the MTP layer).
    cache_bytes
        The block's expert slot budget (None: the engine's default for it).

    Raises
    ------
    SpeculationError
        No MTP layer (:class:`MTPConsumer`), or a portal that restricts the target's
        routing (its class caveats do not scope the MTP layer's experts).
    """

    def __init__(self, target: Engine, cache_bytes: int | None = None) -> None:
        from czyx.inference.engine import BlasLimit, Engine

        if target.model.route_mask is not None:
            # The MTP experts are trunk records, outside the expert space a portal's class
            # caveats scope: a restricted portal does not reach them.
            raise SpeculationError("speculate mtp: not under a portal that restricts routing")
        consumer = MTPConsumer(target.consumer)
        options: EngineOptions = target.options.with_(stream=False)
        self.engine = Engine(consumer, cache_bytes=cache_bytes, options=options, threads=1)
        self.enorm = consumer.own["enorm.weight"]
        self.hnorm = consumer.own["hnorm.weight"]
        self.eh_proj = consumer.own["eh_proj.weight"]
        self._blas = BlasLimit(1)

    @property
    def kv(self) -> KVCache:
        """The module's own cache (its positions are the target's)."""
        return self.engine.kv

    def block(self, tokens: Sequence[int], hidden: np.ndarray, start: int) -> np.ndarray:
        """Positions ``start ..``: ``tokens [T]`` (each position's next token) and the hidden
        states ``[T, H]`` they follow, through the module; its output hidden states
        (before ``shared_head.norm``), the cache grown by ``T``."""
        model, kv = self.engine.model, self.engine.kv
        emb = take_rows(model.embed, np.asarray(tokens, np.int64))
        x = np.concatenate(
            [model.norm(emb, self.enorm, None), model.norm(hidden, self.hnorm, None)], 1
        )
        t = x.shape[0]
        kv.reserve(start + t)
        self.engine.cache.advance(t)
        with self._blas:
            h = model.run_layers(mm_t(x, self.eh_proj), kv, start, 0, 1)
        kv.length = start + t
        return h

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """``[T, V]`` logits of the module's output hidden states ``[T, H]``."""
        model = self.engine.model
        hn = model.norm(hidden, model.final_norm, model.final_norm_bias)
        with self._blas:
            return model.finish_logits(mm_t(hn, model.lm_head))

    def close(self) -> None:
        """Close the module's engine."""
        self.engine.close()


class MTPDrafter:
    """Drafts by the target's own MTP layer (module docstring): ``name = "mtp"``.

    Sets the target model's :attr:`~czyx.inference.models.decoder.MoEDecoder.hidden_hook`
    (cleared by :meth:`close`) and keeps every position's hidden state it hands over
    (``H`` float32 a position, beside the target's cache of that position).
    """

    name = "mtp"

    def __init__(self, target: Engine, head: MTPHead) -> None:
        model = target.model
        if model.hidden_hook is not None:
            raise SpeculationError("speculate mtp: the engine already hands its hidden states on")
        self.target = target
        self.head = head
        self._hidden = np.zeros((64, target.cfg.hidden_size), F32)
        self._seen: list[int] = []  # the tokens the module's cache entries follow
        model.hidden_hook = self._keep

    @classmethod
    def open(cls, target: Engine, cache_bytes: int | None = None) -> MTPDrafter:
        """The drafter of ``target``'s MTP layer (``SpeculationError`` without one)."""
        head = MTPHead(target, cache_bytes)
        try:
            return cls(target, head)
        except BaseException:
            head.close()
            raise

    def _keep(self, kv: KVCache, start: int, h: np.ndarray) -> None:
        if kv is not self.target.kv:
            return
        end = start + h.shape[0]
        if end > self._hidden.shape[0]:
            grown = np.zeros((max(end, 2 * self._hidden.shape[0]), self._hidden.shape[1]), F32)
            grown[:start] = self._hidden[:start]
            self._hidden = grown
        self._hidden[start:end] = h

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """``k`` greedy tokens of the chained head after ``history`` (k = 0: only bring the
        module's cache up to the history); the target must have processed every
        position but the last (the pending token)."""
        n = len(history)
        if n < 2:
            return []
        if self.target.position != n - 1:
            raise SpeculationError(
                f"speculate mtp: the target is at position {self.target.position}, the "
                f"history needs {n - 1}"
            )
        # Entry j follows tokens 0..j+1: valid while those are unchanged; at least the
        # last entry is recomputed (its output hidden state starts the chain).
        valid = min(max(common_prefix(self._seen, history, n) - 1, 0), n - 2)
        self.head.kv.truncate(min(valid, self.head.kv.length))
        h = self.head.block(history[valid + 1 : n], self._hidden[valid : n - 1], valid)[-1:]
        self._seen = list(history)
        out: list[int] = []
        while len(out) < k:
            out.append(int(np.argmax(self.head.logits(h)[0])))
            if len(out) < k:  # the next entry: this draft after the module's own state
                h = self.head.block(out[-1:], h, n - 2 + len(out))
        return out

    def close(self) -> None:
        """Stop taking the target's hidden states; close the module's engine."""
        if self.target.model.hidden_hook == self._keep:
            self.target.model.hidden_hook = None
        self.head.close()
