"""Portal costs: verify-and-open per portal (us) and the per-read check (ns).

Baselines measured in the same run:

- pymacaroons: deserialize + ``Verifier.verify`` of a macaroon with the same
  number of first-party caveats as the portal (exact-match predicates);
- for the per-read check: a bare Python call with the same arguments (the
  floor any check pays) and re-evaluating the portal's ``Permission`` on
  every read (what the check would cost without the open-time precompute).

Figures are medians of ``--repeat`` runs. Pure Python and hashlib, no BLAS:
``OPENBLAS_NUM_THREADS`` is recorded only for completeness.

    python bench/bench_portals.py            # modest defaults (< 1 min)
    python bench/bench_portals.py --full     # more repeats, more caveat counts
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).absolute().parents[1]))

import numpy as np
from pymacaroons import Macaroon, Verifier

from czyx.key import Key
from czyx.portals.authority import PortalAuthority
from czyx.portals.caveats import (
    ClassRange,
    Expires,
    LayerRange,
    Rights,
    Spaces,
)
from czyx.portals.chain import verify_signature
from czyx.portals.token import Token
from czyx.space import Selector
from czyx.store import Store


def _median_per_call(fn, number: int, repeat: int) -> float:
    """Median seconds per call of ``fn`` over ``repeat`` batches of ``number`` calls."""
    return statistics.median(t / number for t in timeit.repeat(fn, number=number, repeat=repeat))


def _portal_caveats(space: bytes, n: int) -> list:
    """``n`` restriction caveats (besides the id and tenant the grant adds)."""
    pool = [
        Spaces(frozenset({space})),
        Rights(frozenset({"read", "infer"})),
        ClassRange(0, 63),
        LayerRange(0, 3),
        Expires(int(time.time()) + 86400),
    ]
    out = []
    i = 0
    while len(out) < n:
        c = pool[i % len(pool)]
        if isinstance(c, ClassRange):  # later rounds keep narrowing
            c = ClassRange(0, max(1, 63 >> (i // len(pool))))
        out.append(c)
        i += 1
    return out


def _macaroon(n: int) -> tuple[str, Verifier, str]:
    key = "k" * 32
    m = Macaroon(location="czyx", identifier="portal-0123456789abcdef", key=key)
    v = Verifier()
    for i in range(n):
        pred = f"caveat{i} = value{i}"
        m.add_first_party_caveat(pred)
        v.satisfy_exact(pred)
    return m.serialize(), v, key


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="more repeats and caveat counts")
    ap.add_argument("--repeat", type=int, default=None)
    args = ap.parse_args()
    repeat = args.repeat or (15 if args.full else 7)
    counts = (2, 4, 8, 16, 32) if args.full else (2, 4, 8)

    print(
        f"python {sys.version.split()[0]}, OPENBLAS_NUM_THREADS="
        f"{os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}, repeats={repeat} (medians)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        st = Store.open(Path(tmp) / "store")
        sel = Selector.from_name("bench-space")
        with st.begin_space(sel, {"kind": "bench"}) as w:
            ext = w.write_extent(np.zeros(4096, dtype=np.uint8))
            w.put(Key(1, 1).pack(), ext.record())
        auth = PortalAuthority(st)

        print("\nverify-and-open per portal (us)")
        print(
            f"{'caveats':>8} {'chain':>9} {'macaroon':>9} {'ratio':>7} {'open':>9} "
            f"{'ratio':>7} {'open+audit':>11} {'ratio':>7}"
        )
        for n in counts:
            g = auth.grant(_portal_caveats(sel.raw, n - 2), tenant="acme")  # +id +tenant
            tok_text = g.token
            n_cav = len(Token.from_text(tok_text).caveats)
            ser, verifier, mkey = _macaroon(n_cav)
            keys = auth._keys  # bench only: the chain check without the store

            def chain(tok_text=tok_text, keys=keys):
                verify_signature(keys, Token.from_text(tok_text))

            def macaroon(ser=ser, verifier=verifier, mkey=mkey):
                verifier.verify(Macaroon.deserialize(ser), mkey)

            def open_view(tok_text=tok_text):
                auth.open_space(tok_text, sel)

            t_chain = _median_per_call(chain, 2000, repeat)
            t_mac = _median_per_call(macaroon, 500, repeat)
            t_open = _median_per_call(open_view, 50, repeat)
            # Breakdown only: the same open with the audit append stubbed out.
            st.audit = lambda *a, **k: None
            try:
                t_open_na = _median_per_call(open_view, 500, repeat)
            finally:
                del st.audit
            print(
                f"{n_cav:>8} {t_chain * 1e6:>9.1f} {t_mac * 1e6:>9.1f} "
                f"{t_chain / t_mac:>7.2f} {t_open_na * 1e6:>9.1f} {t_open_na / t_mac:>7.2f} "
                f"{t_open * 1e6:>11.1f} {t_open / t_mac:>7.2f}"
            )
        print("  chain = parse + HMAC chain + constant-time compare (no store);")
        print("  open = chain + lineage descriptor reads + manifest + view build, with the")
        print("  audit append stubbed out (breakdown only); open+audit = the real")
        print("  open_space, including the durable 'portal.open' LMDB commit;")
        print("  ratio = against pymacaroons deserialize+verify, same caveat count.")

        view = auth.open_space(auth.grant(_portal_caveats(sel.raw, 4), tenant="acme").token, sel)
        perm = view.permission
        number = 500_000
        reps = max(repeat, 9)

        def bare(cls, layer):
            return True

        env = {
            "bare": bare,
            "allows": view.allows,  # bound once, as a consumer would
            "check": view.check,
            "ac": view.allowed_classes,
            "naive": perm.allows,
            "sraw": sel.raw,
        }

        def per_call(stmt: str, n: int = number) -> float:
            runs = timeit.repeat(stmt, globals=env, number=n, repeat=reps)
            return statistics.median(t / n for t in runs)

        t_bare = per_call("bare(5, 2)")
        print(
            f"\nper-read check (ns per call; baseline: a bare Python call with the same "
            f"arguments, {t_bare * 1e9:.1f} ns)"
        )
        rows = [
            ("bare Python call (baseline)", t_bare),
            ("SpaceView.allows (set + range)", per_call("allows(5, 2)")),
            ("SpaceView.check (raises if out)", per_call("check(5, 2)")),
            ("allowed_classes[c] (numpy bool)", per_call("ac[5]")),
            (
                "Permission.allows per read (naive)",
                per_call("naive(sraw, 'read', 5, 2, tenant='acme', now=0.0)", number // 10),
            ),
        ]
        for name, t in rows:
            print(f"  {name:36} {t * 1e9:8.1f}   x{t / t_bare:6.2f}")
        st.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
