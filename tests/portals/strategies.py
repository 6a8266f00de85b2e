"""Hypothesis strategies shared by the portals tests."""

from __future__ import annotations

from hypothesis import strategies as st

from czyx.portals.caveats import (
    ALL_RIGHTS,
    MAX_LAYER,
    ClassRange,
    ClassSet,
    Expires,
    LayerRange,
    PortalId,
    Rights,
    Spaces,
    Tenant,
)

# A small pool, so that intersections and per-space scopes actually collide.
SPACE_POOL = [bytes([i + 1]) * 32 for i in range(3)]
TENANT_POOL = ["acme", "globex"]

space_or_none = st.sampled_from([None, *SPACE_POOL])
layer = st.one_of(st.integers(0, 9), st.integers(0, MAX_LAYER))


@st.composite
def class_range(draw):
    lo = draw(st.integers(0, 255))
    hi = draw(st.integers(lo, 255))
    return ClassRange(lo, hi, draw(space_or_none))


@st.composite
def layer_range(draw):
    lo = draw(layer)
    hi = draw(
        st.one_of(st.integers(lo, lo + 9), st.integers(lo, MAX_LAYER)).filter(
            lambda h: h <= MAX_LAYER
        )
    )
    return LayerRange(lo, hi, draw(space_or_none))


restricting_caveats = st.one_of(
    st.builds(Spaces, st.frozensets(st.sampled_from(SPACE_POOL), min_size=1)),
    st.builds(Rights, st.frozensets(st.sampled_from(sorted(ALL_RIGHTS)))),
    class_range(),
    st.builds(ClassSet, st.integers(1, (1 << 256) - 1), space_or_none),
    layer_range(),
    st.builds(Expires, st.integers(0, 4_000_000_000)),
    st.builds(Tenant, st.sampled_from(TENANT_POOL)),
)

any_caveat = st.one_of(
    restricting_caveats, st.builds(PortalId, st.binary(min_size=16, max_size=16))
)


@st.composite
def probe(draw):
    """One access request: (space, right, class, layer, tenant, now)."""
    return (
        draw(st.sampled_from(SPACE_POOL)),
        draw(st.sampled_from(sorted(ALL_RIGHTS))),
        draw(st.integers(0, 255)),
        draw(st.integers(0, 12)),
        draw(st.sampled_from([None, *TENANT_POOL])),
        draw(st.integers(0, 4_000_000_000)),
    )
