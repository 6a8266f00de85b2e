"""Resume a saved session vs re-prefill its history, for histories of 256, 1k and 4k tokens.

For each history length L, in the same run and on the same engine:

- baseline, **re-prefill**: reset the engine and prefill the L tokens (in
  chunks of ``--chunk`` tokens, as a server would, so attention scores stay
  bounded);
- **resume (cold)**: drop the session's block file from the page cache, then
  open the session's space through a portal (verified, audited: one durable
  LMDB commit), read the SES extent (one read), verify its checksum and copy
  the KV into a fresh cache (:meth:`SessionStore.read` + :meth:`LiveSession.resume`);
- **resume (warm)**: the same with the file in the page cache;
- and, alone, the portal open both resumes include (its audit is a durable
  LMDB commit, an fsync whose cost varies a lot on a shared disk).

Each figure is the median of ``--repeats`` runs, printed with its ratio
against re-prefill. The resumed logits are checked equal to the saved ones
and close to the re-prefilled ones (the check is not timed).

The model: the shipped model is not in the repository yet, so a small random
Qwen3-MoE is built with transformers (hidden 256, 4 layers, 8 heads / 4 KV
heads of 32, 8 experts, top-2, vocabulary 1024; ``--tiny``: the test suite's
tiny config), written as a checkpoint, mounted into the store (``bench@1``)
and opened through a portal, as ``czyx run`` does. Run from the repository
root::

    OPENBLAS_NUM_THREADS=1 python bench/bench_sessions.py
    OPENBLAS_NUM_THREADS=1 python bench/bench_sessions.py --lengths 256,1024,4096 --repeats 7
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: BLAS threads are recorded

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from bench.bench_store import evict
from czyx.inference.engine import Engine
from czyx.inference.sampling import SamplingParams
from czyx.inference.sessions.live import LiveSession
from czyx.inference.sessions.store import SessionStore
from czyx.portals.authority import open_authority
from czyx.store import Store


def mount_model(st: Store, root: Path, tiny: bool):
    """Build a random Qwen3-MoE checkpoint with transformers, mount it, open it via a portal.

    Returns the store's ``ModelConsumer`` for ``bench@1`` (O_DIRECT expert reads,
    as ``czyx run``).
    """
    from czyx.portals import open_model
    from czyx.store.models.model import open_version as open_consumer
    from czyx.store.models.mount import mount
    from czyx.testing.tiny_models import make_tiny_checkpoint

    shape = {} if tiny else SMALL
    ckpt = make_tiny_checkpoint(
        "qwen3_moe", root / "ckpt", seed=0, max_position_embeddings=8192, **shape
    )
    mount(st, ckpt, "bench@1")
    view = open_model(st, open_authority(st).root_token(), "bench@1")
    return open_consumer(st, "bench@1", view=view, direct=True)


SMALL = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    intermediate_size=512,
    moe_intermediate_size=256,
    vocab_size=1024,
)


def prefill(engine: Engine, tokens: list[int], chunk: int) -> np.ndarray:
    engine.reset()
    logits = None
    for i in range(0, len(tokens), chunk):
        logits = engine.prefill(tokens[i : i + chunk])
    return logits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="256,1024,4096", help="history lengths (tokens)")
    ap.add_argument("--repeats", type=int, default=5, help="runs per figure (median)")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    ap.add_argument("--tiny", action="store_true", help="the test suite's tiny config")
    ap.add_argument("--store", default=None, help="store directory (default: a temp dir)")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]

    tmp = tempfile.TemporaryDirectory(prefix="bench-sessions-", dir=args.store)
    st = Store.open(Path(tmp.name) / "store")
    consumer = mount_model(st, Path(tmp.name), args.tiny)
    selector = bytes(consumer.info.selector)
    engine = Engine(consumer)
    cfg = engine.cfg
    # The production path: every resume opens the session's space through a portal
    # (verified and audited with a durable LMDB commit), included in the resume times.
    ss = SessionStore(st, open_authority(st).grant([], tenant="bench").token)
    print(
        f"model: {cfg.n_layers} layers, {cfg.n_kv_heads} KV heads x {cfg.head_dim}, "
        f"vocab {cfg.vocab_size}; OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}; "
        f"prefill chunk {args.chunk}; repeats {args.repeats} (medians)"
    )
    print(
        f"{'tokens':>7} {'KV MiB':>8} {'re-prefill ms':>14} {'resume cold ms':>15} "
        f"{'x faster':>9} {'resume warm ms':>15} {'x faster':>9} {'of it: portal':>13}"
    )
    rng = np.random.default_rng(0)
    for n in lengths:
        hist = rng.integers(0, cfg.vocab_size, n).tolist()
        live = LiveSession.start(engine, SamplingParams(), "bench")
        for i in range(0, n, args.chunk):
            live.feed(hist[i : i + args.chunk])
        name = f"h{n}"
        info = ss.save(name, live.state())
        saved_logits = live.logits.copy()
        block = st.block_path(info.space)

        t_prefill, t_cold, t_warm, t_open = [], [], [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            ref = prefill(engine, hist, args.chunk)
            t_prefill.append(time.perf_counter() - t0)

            evict(block)  # bench_store's page-cache eviction
            t0 = time.perf_counter()
            resumed = LiveSession.resume(engine, ss.read(name, model=selector), "bench")
            t_cold.append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            resumed = LiveSession.resume(engine, ss.read(name, model=selector), "bench")
            t_warm.append(time.perf_counter() - t0)

            # The portal open alone (verify + its durable audit commit), part of both.
            t0 = time.perf_counter()
            open_authority(st).open_space(ss.portal, info.space, tenant="bench").close()
            t_open.append(time.perf_counter() - t0)
            # Checks, not timed: exact logits, and agreement with the recomputation.
            if not np.array_equal(resumed.logits, saved_logits):
                raise SystemExit("resumed logits differ from the saved ones")
            np.testing.assert_allclose(resumed.logits, ref, rtol=1e-3, atol=1e-3)
        p, c, w, o = (statistics.median(x) for x in (t_prefill, t_cold, t_warm, t_open))
        kv_mib = n * cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 4 / 2**20
        print(
            f"{n:>7} {kv_mib:>8.1f} {p * 1e3:>14.1f} {c * 1e3:>15.2f} {p / c:>9.1f} "
            f"{w * 1e3:>15.2f} {p / w:>9.1f} {o * 1e3:>13.2f}"
        )
    engine.close()
    consumer.close()
    st.close()
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
