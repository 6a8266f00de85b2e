"""SpaceView through the real store: for all attenuation sequences, the reads a
child portal permits are a subset of its parent's; the O(1) check agrees
with the permission algebra."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from czyx.key import Key
from czyx.portals import attenuate
from czyx.portals.caveats import ClassRange, ClassSet, Expires, LayerRange, Rights, Spaces, Tenant
from czyx.portals.errors import OutOfScope, PortalDenied, PortalError
from tests.portals.conftest import EXTENT, N_CLASSES_A, N_LAYERS_A, payload

GRID = [(c, z) for c in range(N_CLASSES_A) for z in range(N_LAYERS_A)]


def _narrowing(a: bytes, b: bytes):
    sp = st.sampled_from([None, a, b])
    return st.one_of(
        st.builds(
            lambda lo, n, s: ClassRange(lo, min(255, lo + n), s),
            st.integers(0, 9),
            st.integers(0, 9),
            sp,
        ),
        st.builds(ClassSet, st.integers(1, 0x3FF), sp),
        st.builds(
            lambda lo, n, s: LayerRange(lo, lo + n, s), st.integers(0, 4), st.integers(0, 4), sp
        ),
        st.builds(Rights, st.frozensets(st.sampled_from(["read", "infer", "grant"]))),
        st.builds(Spaces, st.frozensets(st.sampled_from([a, b]), min_size=1)),
        st.builds(Tenant, st.sampled_from(["acme", "globex"])),
        st.builds(Expires, st.integers(1_799_999_990, 1_800_000_010)),
    )


def _readable(auth, token, space) -> set[tuple[int, int]]:
    """Every (class, layer) of space A that actually reads through ``token``."""
    try:
        view = auth.open_space(token, space)
    except PortalDenied:
        return set()
    out = set()
    buf = np.zeros(EXTENT + 4096, dtype=np.uint8)
    for c, z in GRID:
        try:
            view.read_extent(Key(c, z), buf)
        except OutOfScope:
            assert not view.allows(c, z)
            continue
        assert view.allows(c, z) and bytes(buf[:EXTENT]) == payload(c, z)
        out.add((c, z))
    view.close()
    return out


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_attenuation_chain_reads_are_subsets(world, data):
    auth, a, b, _ = world
    token = auth.root_token()
    parent_reads = _readable(auth, token, a)
    assert parent_reads == set(GRID)
    for _ in range(data.draw(st.integers(1, 3))):
        cavs = data.draw(st.lists(_narrowing(a.raw, b.raw), min_size=1, max_size=3))
        token = attenuate(token, cavs, strict=False)
        reads = _readable(auth, token, a)
        assert reads <= parent_reads
        parent_reads = reads


def test_check_is_fail_closed_on_odd_input(world):
    auth, a, _, _ = world
    view = auth.open_space(auth.root_token(), a)
    for cls in (256, 10**9):
        assert not view.allows(cls, 0)
        with pytest.raises(OutOfScope):
            view.check(cls, 0)
    with pytest.raises(OutOfScope):
        view.check(-1, 0)
    with pytest.raises(OutOfScope):
        view.check_many(np.array([0, 300]), 0)
    assert view.allowed_classes.flags.writeable is False
    view.close()
    with pytest.raises(PortalError, match="closed"):
        view.check(0, 0)


def test_view_has_no_write_path(world):
    auth, a, _, _ = world
    view = auth.open_space(auth.root_token(), a)
    assert not any(n.startswith(("put", "write", "delete", "begin")) for n in dir(view))
    assert "classes=256" in repr(view)


def test_unknown_key_curve_fails_closed():
    from czyx.portals.view import curve_of

    assert curve_of({}).name == curve_of({"key_curve": "morton"}).name
    assert curve_of({"curve": "hilbert", "layout": {"outer": "hilbert"}}).name == "morton"
    with pytest.raises(PortalError, match="key curve"):
        curve_of({"key_curve": {"name": "hilbert"}})


def test_check_many_broadcasts(world):
    auth, a, _, _ = world
    g = auth.grant([ClassRange(0, 3), LayerRange(0, 1), Spaces(frozenset({a.raw}))], tenant="t")
    view = auth.open_space(g.token)
    view.check_many(np.array([[0, 1], [2, 3]]), np.array([0, 1]))
    view.check_many(3, np.arange(2))
    for classes, layers in (([0, 4], 0), (1, [0, 2]), ([[0], [-1]], [0, 1])):
        with pytest.raises(OutOfScope):
            view.check_many(np.array(classes), np.array(layers))
