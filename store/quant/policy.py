"""Quantization policies: which tensor role is stored in which format.

Scope: naming the role classes of a MoE checkpoint, the named policies, the
``--quant POLICY`` syntax, and the per-tensor decision (format or float, and
why). Packing itself is :mod:`store.quant.formats`.

Role classes (the consumer's role names, ``store.consumer.TRUNK_ROLES``, map
onto these; routed experts are the extents of the expert space)::

    expert         routed experts' gate/up/down (most of a MoE's bytes)
    attention      q/k/v/o projections
    shared_expert  shared experts' gate/up/down
    dense_mlp      the MLP of dense layers in mixed dense/sparse models
    embed          the token embedding (a row gather, not a matvec)
    lm_head        the output head
    router         routers and the shared-expert sigmoid gate
    norm           RMSNorm / LayerNorm weights
    bias           q/k/v biases

Named policies:

``none``       everything float (the reference).
``q2-all``     every matrix 2-bit: experts, attention, shared experts, dense MLP,
               embed, lm_head and routers. The "quantize everything" baseline.
``q4-all``     every matrix 4-bit, likewise.
``selective``  the method of the source document: routed experts q2 (most of
               the bytes, but each token meets only top-k of them, between
               high-precision layers, so their errors do not compound); the
               load-bearing trunk (attention, shared experts, dense MLP) q4;
               embed and lm_head q8 (every token's input and every logit pass
               through them, and an embedding row's error is never averaged
               out by a sum over many inputs); routers and norms float.

Vectors (norms, biases) are never quantized under any policy: they are a
negligible share of the bytes and multiply every token. Routers stay float
under ``selective`` because their output is a discrete choice: a small error
in a router logit swaps whole experts, and an ``[E, H]`` router is a fraction
of a percent of the bytes.

``--quant`` syntax: ``NAME[,CLASS=FMT...]``, e.g. ``selective,embed=q4`` or
``none,expert=q3``; ``FMT`` is a format name (``q4``, ``q2g128``...) or
``f32`` to keep the class float.

A format's group size must divide the tensor's column count; when it does
not, the decision falls back to the same bit width with groups of 32, and
when even that does not divide, the tensor stays float (the decision says so).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from czyx.store.quant.errors import FormatError, PolicyError
from czyx.store.quant.formats import GROUP_QUANTUM, QuantFormat, get_format

ROLE_CLASSES = (
    "expert",
    "attention",
    "shared_expert",
    "dense_mlp",
    "embed",
    "lm_head",
    "router",
    "norm",
    "bias",
)

_ROLE_TO_CLASS = {
    "expert": "expert",
    "gate_proj": "expert",
    "up_proj": "expert",
    "down_proj": "expert",
    "embed": "embed",
    "lm_head": "lm_head",
    "final_norm": "norm",
    "input_norm": "norm",
    "post_attn_norm": "norm",
    "q_norm": "norm",
    "k_norm": "norm",
    "q_proj": "attention",
    "k_proj": "attention",
    "v_proj": "attention",
    "o_proj": "attention",
    "q_bias": "bias",
    "k_bias": "bias",
    "v_bias": "bias",
    "router": "router",
    "shared_expert_gate": "router",
    "shared_gate_proj": "shared_expert",
    "shared_up_proj": "shared_expert",
    "shared_down_proj": "shared_expert",
    "mlp_gate_proj": "dense_mlp",
    "mlp_up_proj": "dense_mlp",
    "mlp_down_proj": "dense_mlp",
    # Roles of the newer architectures (store.models.archs.EXTRA_ROLES).
    "q_a_proj": "attention",
    "q_b_proj": "attention",
    "kv_a_proj": "attention",
    "kv_b_proj": "attention",
    "q_a_norm": "norm",
    "kv_a_norm": "norm",
    "router_bias": "bias",
    "o_bias": "bias",
    "sinks": "bias",
    "expert_gate_up_bias": "bias",
    "expert_down_bias": "bias",
    # Hybrid layers: their projections are matrices like attention's; the recurrence's
    # per-channel parameters (conv taps, decays, skips) stay float with the vectors.
    "lin_qkvz": "attention",
    "lin_ba": "attention",
    "mamba_in_proj": "attention",
    "mamba_x_proj": "attention",
    "mamba_dt_proj": "attention",
    "lin_norm": "norm",
    "mamba_dt_norm": "norm",
    "mamba_b_norm": "norm",
    "mamba_c_norm": "norm",
    "lin_conv": "bias",
    "lin_dt_bias": "bias",
    "lin_a_log": "bias",
    "mamba_conv": "bias",
    "mamba_conv_bias": "bias",
    "mamba_dt_bias": "bias",
    "mamba_a_log": "bias",
    "mamba_d": "bias",
    "lin_neg_a": "bias",  # (a GGUF source's A = -exp(A_log))
    "mamba_neg_a": "bias",
}

_FLOAT_NAMES = ("f32", "float", "none")


def role_class(role: str) -> str:
    """The role class of a consumer role name (``"q_proj"`` -> ``"attention"``).

    Raises
    ------
    PolicyError
        For a role this module does not know.
    """
    if role in ROLE_CLASSES:
        return role
    try:
        return _ROLE_TO_CLASS[role]
    except KeyError:
        raise PolicyError(f"unknown tensor role {role!r}") from None


@dataclass(frozen=True)
class Decision:
    """How one tensor is stored: ``fmt`` (``None`` = float) and the reason."""

    role: str
    fmt: QuantFormat | None
    reason: str

    @property
    def format_name(self) -> str:
        """The format name to record (``"f32"`` for float)."""
        return self.fmt.name if self.fmt is not None else "f32"


@dataclass(frozen=True)
class Policy:
    """A named map from role class to format name (``None`` keeps the class float).

    ``formats`` is a tuple of ``(role_class, format name or None)`` covering
    every class in :data:`ROLE_CLASSES` (a tuple keeps the value hashable).
    """

    name: str
    formats: tuple[tuple[str, str | None], ...]

    def format_for(self, role: str) -> str | None:
        """The format name the policy assigns to ``role`` (``None`` = float)."""
        cls = role_class(role)
        for c, f in self.formats:
            if c == cls:
                return f
        return None

    @property
    def quantizes(self) -> bool:
        """Whether any class is quantized."""
        return any(f is not None for _, f in self.formats)

    def decide(self, role: str, shape: tuple[int, ...]) -> Decision:
        """The storage decision for a tensor of ``role`` and ``shape``.

        1-D tensors stay float; a format whose group does not divide the columns
        falls back to groups of 32, else float (see the module docstring).
        """
        name = self.format_for(role)
        if name is None:
            return Decision(role, None, f"policy {self.name} keeps {role_class(role)} float")
        if len(shape) != 2:
            return Decision(role, None, f"{len(shape)}-D tensors stay float")
        fmt = get_format(name)
        cols = int(shape[1])
        if cols % fmt.group_size == 0:
            return Decision(role, fmt, f"policy {self.name}: {role_class(role)} -> {fmt.name}")
        if cols % GROUP_QUANTUM == 0:
            small = get_format(f"q{fmt.bits}g{GROUP_QUANTUM}")
            return Decision(
                role, small, f"{cols} columns not a multiple of {fmt.group_size}: {small.name}"
            )
        return Decision(role, None, f"{cols} columns not a multiple of {GROUP_QUANTUM}: kept float")


def _policy(name: str, **classes: str | None) -> Policy:
    return Policy(name, tuple((c, classes.get(c)) for c in ROLE_CLASSES))


_ALL_MATRICES = ("expert", "attention", "shared_expert", "dense_mlp", "embed", "lm_head", "router")

POLICIES: dict[str, Policy] = {
    "none": _policy("none"),
    "q2-all": _policy("q2-all", **dict.fromkeys(_ALL_MATRICES, "q2")),
    "q4-all": _policy("q4-all", **dict.fromkeys(_ALL_MATRICES, "q4")),
    "selective": _policy(
        "selective",
        expert="q2",
        attention="q4",
        shared_expert="q4",
        dense_mlp="q4",
        embed="q8",
        lm_head="q8",
    ),
}


def parse_policy(text: str) -> Policy:
    """Parse ``NAME[,CLASS=FMT...]`` (see the module docstring) into a :class:`Policy`.

    Raises
    ------
    PolicyError
        On an unknown policy, role class or format.
    """
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise PolicyError("empty quantization policy")
    base = POLICIES.get(parts[0])
    if base is None:
        raise PolicyError(
            f"unknown quantization policy {parts[0]!r} (one of {', '.join(POLICIES)})"
        )
    if len(parts) == 1:
        return base
    table = dict(base.formats)
    for item in parts[1:]:
        cls, sep, fmt = item.partition("=")
        cls, fmt = cls.strip(), fmt.strip()
        if not sep or cls not in ROLE_CLASSES:
            raise PolicyError(
                f"bad policy override {item!r}: expected CLASS=FMT with CLASS one of "
                f"{', '.join(ROLE_CLASSES)}"
            )
        if fmt in _FLOAT_NAMES:
            table[cls] = None
            continue
        try:
            table[cls] = get_format(fmt).name
        except FormatError as exc:
            raise PolicyError(f"bad policy override {item!r}: {exc}") from None
    return Policy(",".join(parts), tuple((c, table[c]) for c in ROLE_CLASSES))


def add_quant_argument(parser: argparse.ArgumentParser, default: str = "none") -> None:
    """Add ``--quant POLICY`` to a subcommand's parser (parsed into a :class:`Policy`)."""

    def _type(text: str) -> Policy:
        try:
            return parse_policy(text)
        except PolicyError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parser.add_argument(
        "--quant",
        metavar="POLICY",
        type=_type,
        default=POLICIES[default] if default in POLICIES else parse_policy(default),
        help=(
            f"quantization policy: {', '.join(POLICIES)}, optionally with overrides "
            "CLASS=FMT (e.g. selective,embed=q4); default %(default)s"
        ),
    )
