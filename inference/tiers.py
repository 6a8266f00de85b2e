"""Per-expert precision tiers: hot experts at the high precision, the rest read low-bit.

Scope: the ``tiers`` option (``--tiers HIGH,LOW[:FRACTION]``, :class:`TierSpec`),
opening the two versions it names as one consumer
(:func:`open_tiered`, a :class:`~czyx.store.models.tiered.TieredModel`), and the
policy that decides which experts are high (:func:`high_mask`).

The policy, from measured usage: the routing profile's hot list (``czyx profile``,
``--hot``: ``(layer, expert)`` pairs, most chosen first) is taken in order until
the high-precision slots of the experts taken fill ``FRACTION`` of the slot budget
(default 0.5): those experts are read at the high precision, every other expert at
the low one. Slots are sized for the high precision, so the budget holds as many
experts as the pure high version's does; what the tiers save is the bytes of each
low-tier miss (a q2 expert is about half a q4 one), and the hot experts, which
are most of the hits, keep the high precision. Tiers change the outputs, so the
option is off by default, and a run without a profile is refused rather than
guessed (:class:`TierSpecError`).

The C kernels take a layer's experts at mixed precisions in one call (each packed
matrix carries its bits and group size; the input is quantized once and summed
per group size), so a step that mixes q4 and q2 experts computes each expert as
its own version would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from czyx.inference.errors import InferenceError
from czyx.store.models.tiered import TieredModel, TierError

if TYPE_CHECKING:
    from czyx.store.interfaces import StoreInterface

#: The share of the slot budget the high tier takes when the spec names none.
DEFAULT_HIGH_FRACTION = 0.5


class TierSpecError(InferenceError, ValueError):
    """A tiers option that cannot be run (malformed, or without what it needs)."""


@dataclass(frozen=True)
class TierSpec:
    """Two versions of one model and the share of the budget the high one takes.

    Attributes
    ----------
    high, low
        Version names (``q4``, ``q2``): ``NAME@high`` and ``NAME@low`` of the run's model.
    fraction
        Share of the slot budget the high-tier experts' slots may fill, in (0, 1].
    """

    high: str
    low: str
    fraction: float = DEFAULT_HIGH_FRACTION

    @classmethod
    def parse(cls, text: str) -> TierSpec:
        """``HIGH,LOW`` or ``HIGH,LOW:FRACTION`` (``q4,q2``, ``q4,q2:0.25``).

        Raises
        ------
        TierSpecError
            Not two version names, the same one twice, or a fraction outside (0, 1].
        """
        versions, _, frac = str(text).partition(":")
        names = [v.strip() for v in versions.split(",")]
        if len(names) != 2 or not all(names) or any("@" in n for n in names):
            raise TierSpecError(f"tiers {text!r}: not HIGH,LOW[:FRACTION] (e.g. q4,q2:0.5)")
        if names[0] == names[1]:
            raise TierSpecError(f"tiers {text!r}: the same version twice")
        try:
            fraction = float(frac) if frac else DEFAULT_HIGH_FRACTION
        except ValueError:
            raise TierSpecError(f"tiers {text!r}: fraction {frac!r} is not a number") from None
        if not 0.0 < fraction <= 1.0:
            raise TierSpecError(f"tiers {text!r}: fraction {fraction} is not in (0, 1]")
        return cls(names[0], names[1], fraction)

    def refs(self, ref: str) -> tuple[str, str]:
        """``(NAME@high, NAME@low)`` for the run's ``NAME@VERSION`` ``ref``, whose version
        must be the high one.

        Raises
        ------
        TierSpecError
            ``ref`` is not ``NAME@VERSION``, or its version is not the high tier.
        """
        name, at, version = str(ref).rpartition("@")
        if not at or not name:
            raise TierSpecError(f"tiers {self.high},{self.low}: {ref!r} is not NAME@VERSION")
        if version != self.high:
            raise TierSpecError(
                f"tiers {self.high},{self.low}: the run's version is {ref}; name {name}@{self.high}"
            )
        return f"{name}@{self.high}", f"{name}@{self.low}"


def open_tiered(
    store: StoreInterface,
    token: str | None,
    ref: str,
    spec: TierSpec | str,
    *,
    direct: bool = True,
    lazy_trunk: bool = False,
) -> TieredModel:
    """Open the two versions ``spec`` names, each through the portal ``token``, as one
    consumer; on any refusal both are closed again before the error propagates.

    Raises
    ------
    TierSpecError
        The spec is malformed or ``ref``'s version is not its high tier.
    TierError
        The versions are not one model at two precisions.
    TagNotFoundError, CzyxError
        A version does not exist, or the portal refuses it.
    """
    from czyx.portals import open_consumer

    spec = spec if isinstance(spec, TierSpec) else TierSpec.parse(spec)
    hi_ref, lo_ref = spec.refs(ref)
    high = open_consumer(store, token, hi_ref, direct=direct, lazy_trunk=lazy_trunk)
    try:
        # Only the low version's experts are read (the trunk is the high one's): its
        # trunk stays on disk, not a second copy in memory beside the high one's.
        low = open_consumer(store, token, lo_ref, direct=direct, trunk=False)
    except BaseException:
        high.close()
        raise
    try:
        return TieredModel(high, low, (hi_ref, lo_ref))
    except BaseException:
        high.close()
        low.close()
        raise


def high_mask(
    hot: Sequence[tuple[int, int]] | None,
    shape: tuple[int, int],
    budget_bytes: int,
    high_stride: int,
    fraction: float,
) -> np.ndarray:
    """``bool [n_layers, n_experts]``: the experts read at the high precision.

    The first entries of the hot list ``hot`` (most used first), as many as
    ``fraction * budget_bytes // high_stride`` slots hold.

    Raises
    ------
    TierSpecError
        No hot list (the policy is measured usage; nothing is guessed).
    """
    if not hot:
        raise TierSpecError(
            "tiers: no routing profile to choose the high-precision experts from "
            "(give a hot list: czyx profile, then --hot PROFILE)"
        )
    n_high = int(fraction * budget_bytes) // int(high_stride)
    mask = np.zeros(shape, bool)
    pairs = np.asarray(list(hot)[:n_high], np.int64).reshape(-1, 2)
    mask[pairs[:, 0], pairs[:, 1]] = True
    return mask


def check_tiered(consumer: object, spec: TierSpec) -> TieredModel:
    """``consumer`` as the :class:`TieredModel` of ``spec``'s versions.

    Raises
    ------
    TierSpecError
        ``consumer`` is one version, or a pair of other versions.
    """
    if not isinstance(consumer, TieredModel):
        raise TierSpecError(
            f"tiers {spec.high},{spec.low}: the engine was given one version "
            "(open both with czyx.inference.tiers.open_tiered)"
        )
    got = tuple(n.rpartition("@")[2] for n in consumer.names)
    if got != (spec.high, spec.low):
        raise TierSpecError(
            f"tiers {spec.high},{spec.low}: the consumer holds {','.join(consumer.names)}"
        )
    return consumer


__all__ = [
    "DEFAULT_HIGH_FRACTION",
    "TierError",
    "TierSpec",
    "TierSpecError",
    "check_tiered",
    "high_mask",
    "open_tiered",
]
