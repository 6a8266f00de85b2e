"""``czyx demo``: the whole path in one command, on the bundled trained model.

1. mount the bundled checkpoint as a model version (a no-op when the same
   content is already there: same content, same space);
2. grant a tenant a narrowed portal (infer only, one hour) and show that
   accesses outside it are refused: a raw ``read``, and an expert outside an
   offline attenuation;
3. generate a continuation of a Python prompt through the tenant's portal with
   the expert cache at a quarter of the expert bytes, streaming the text
   (eviction: :data:`DEMO_POLICY`, the engine's default, the expected next use,
   which reads fewer bytes than decaying frequency and LRU in ``bench/BELADY.md``);
4. report tokens/s, hit rate, bytes read per token and exposed I/O wait, with
   the same run at a full cache for comparison;
5. suggest the next commands.

Everything runs on the embedded default: an LMDB store directory, nothing to
start.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from czyx.inference.errors import DemoCheckError
from czyx.inference.options import DEFAULT_OPTIONS
from czyx.store.interfaces import StoreInterface

DEFAULT_TAG = "czyx-moe-stdlib@v1"
DEFAULT_TENANT = "demo-tenant"
DEFAULT_PROMPT = "import os\nimport sys\n\n\ndef "
#: Eviction policy of both runs: the engine default (``EngineOptions.policy``).
DEMO_POLICY = DEFAULT_OPTIONS.policy


@dataclass(frozen=True)
class DemoRun:
    """One generation's figures (see :class:`inference.generate.GenerationStats`)."""

    label: str
    cache_fraction: float
    policy: str
    n_slots: int
    text: str
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    hit_rate: float
    bytes_per_token: float
    io_wait_seconds: float
    prefetch_reads: int = 0
    prefetch_recall: float | None = None


@dataclass(frozen=True)
class DemoResult:
    """What the demo did, for tests and for callers that want the figures."""

    tag: str
    mounted: bool
    refusals: tuple[str, ...]
    runs: tuple[DemoRun, ...]


def run_demo(
    store_dir: str | os.PathLike[str],
    *,
    model_dir: str | os.PathLike[str] | None = None,
    tag: str = DEFAULT_TAG,
    prompt: str = DEFAULT_PROMPT,
    max_tokens: int = 120,
    cache_fraction: float = 0.25,
    seed: int = 7,
    policy: str = DEMO_POLICY,
    out: TextIO | None = None,
    progress: bool = True,
) -> DemoResult:
    """Run the demo against the store at ``store_dir`` (created if missing).

    Parameters
    ----------
    store_dir
        Store directory; created on first use.
    model_dir
        Checkpoint to mount (default: the bundled ``czyx-moe-stdlib``).
    tag
        ``NAME@VERSION`` to mount it as.
    prompt, max_tokens, seed
        The generation (temperature 0.6, top-p 0.9, seeded: reproducible).
    cache_fraction
        The tiered run's expert budget as a fraction of all expert bytes.
    policy
        Eviction policy of both runs (a name in :data:`inference.cache.POLICIES`).
    out
        Where the narration goes (default stdout).

    Raises
    ------
    DemoCheckError
        A refusal the demo shows was allowed, or the tiered and fully
        resident runs generated different text.
    """
    from czyx import portals
    from czyx.inference.assets import bundled_model_dir
    from czyx.portals.caveats import ClassRange
    from czyx.portals.errors import PortalDenied
    from czyx.portals.model import grant_model
    from czyx.store import Store
    from czyx.store.models.model import open_version
    from czyx.store.models.mount import mount

    out = out or sys.stdout
    if not 0.0 < cache_fraction <= 1.0:
        raise ValueError(f"cache_fraction {cache_fraction} outside (0, 1]")
    model_dir = Path(model_dir) if model_dir is not None else bundled_model_dir()

    def say(text: str = "") -> None:
        out.write(text + "\n")
        out.flush()

    with Store.open(store_dir) as store:
        say(f"czyx demo: store {Path(store_dir).resolve()}")
        say("")
        say(f"1. mount {model_dir.name} as {tag}")
        res = mount(store, model_dir, tag, progress=progress and sys.stderr.isatty())
        say(f"   {res.summary()}")

        say("")
        say(f"2. grant {DEFAULT_TENANT!r} a narrowed portal (right: infer; expires in 1 h)")
        g = grant_model(
            store,
            tag,
            tenant=DEFAULT_TENANT,
            rights="infer",
            expires_at=int(time.time()) + 3600,
            note="czyx demo",
        )
        say(f"   portal {g.id_hex[:16]}, token {g.token[:24]}... ({len(g.token)} chars)")
        refusals: list[str] = []
        try:
            portals.open_model(store, g.token, tag, right="read", tenant=DEFAULT_TENANT)
            raise DemoCheckError("a read through an infer-only portal was allowed")
        except PortalDenied as exc:
            refusals.append(f"{type(exc).__name__}: {exc}")
            say(f"   raw read of the weights        -> refused ({type(exc).__name__}: {exc})")
        narrow = portals.attenuate(g.token, [ClassRange(0, 7)])
        view = portals.open_model(store, narrow, tag, tenant=DEFAULT_TENANT)
        with open_version(store, tag, view=view) as consumer:
            slot = np.empty(consumer.info.expert_slot_nbytes, np.uint8)
            consumer.read_expert(0, 3, slot)  # inside the attenuation: fine
            byte = min(12, consumer.info.n_experts - 1)
            try:
                consumer.read_expert(0, byte, slot)
                raise DemoCheckError("an expert outside the attenuated portal was read")
            except PortalDenied as exc:
                refusals.append(f"{type(exc).__name__}: {exc}")
                say(
                    f"   attenuated to classes 0-7, expert (layer 0, byte {byte}) "
                    f"-> refused ({type(exc).__name__})"
                )

        say("")
        say(
            f"3. generate through the tenant's portal, expert cache at "
            f"{cache_fraction:.0%} of the expert bytes"
        )
        say(f"   eviction: {_policy_words(policy)}")
        say(
            "   prefetch: while slots are free, each layer's experts predicted from the "
            "residual stream entering it and by look-ahead, read by C threads; then reads on "
            "demand, a layer's resident experts computed while its missing ones land"
        )
        say("   " + "-" * 60)
        out.write(prompt)
        tiered = _generate(
            store, tag, g.token, prompt, max_tokens, cache_fraction, seed, policy, stream=out
        )
        say("")
        say("   " + "-" * 60)
        full = _generate(store, tag, g.token, prompt, max_tokens, 1.0, seed, policy, stream=None)
        if full.text != tiered.text:
            # Tiered and resident runs are bit-identical by design; say so loudly if not.
            raise DemoCheckError("tiered and fully resident runs generated different text")

        say("")
        say("4. report (same prompt, same seed; the text is identical at both budgets)")
        say(f"   {'':24}{'tiered':>14}{'full cache':>14}")
        rows = (
            ("expert cache", f"{tiered.n_slots} slots", f"{full.n_slots} slots"),
            (
                "prefill tokens/s",
                f"{tiered.prefill_tokens_per_s:.1f}",
                f"{full.prefill_tokens_per_s:.1f}",
            ),
            (
                "decode tokens/s",
                f"{tiered.decode_tokens_per_s:.1f}",
                f"{full.decode_tokens_per_s:.1f}",
            ),
            ("cache hit rate", f"{tiered.hit_rate:.3f}", f"{full.hit_rate:.3f}"),
            ("bytes read / token", _size(tiered.bytes_per_token), _size(full.bytes_per_token)),
            ("prefetch reads (recall)", _prefetch(tiered), _prefetch(full)),
            (
                "exposed I/O wait",
                f"{tiered.io_wait_seconds * 1e3:.1f} ms",
                f"{full.io_wait_seconds * 1e3:.1f} ms",
            ),
        )
        for name, a, b in rows:
            say(f"   {name:24}{a:>14}{b:>14}")

        say("")
        say("5. next:")
        s = f" --store {store_dir}"
        say(f"   czyx run {tag} --prompt 'class ' --cache-fraction 0.125{s}")
        say(f"   czyx grant {tag} --tenant alice --classes 0-7 --expires 24h{s}")
        say(f"   czyx show {tag}{s}")
        say(f"   czyx audit{s}")
    return DemoResult(tag, res.created, tuple(refusals), (tiered, full))


def _generate(
    store: StoreInterface,
    tag: str,
    token: str,
    prompt: str,
    max_tokens: int,
    fraction: float,
    seed: int,
    policy: str,
    stream: TextIO | None,
) -> DemoRun:
    from czyx import portals
    from czyx.inference.engine import Engine
    from czyx.inference.generate import generate
    from czyx.inference.sampling import SamplingParams
    from czyx.inference.tokenizer import tokenizer_for
    from czyx.store.models.model import open_version

    view = portals.open_model(store, token, tag, tenant=DEFAULT_TENANT)
    with open_version(store, tag, view=view, direct=True) as consumer:
        # As czyx run: the one set of engine defaults, with the demo's policy.
        options = DEFAULT_OPTIONS.with_(policy=policy)
        engine = Engine(consumer, cache_fraction=fraction, options=options)
        try:
            tok = tokenizer_for(consumer, engine.cfg.vocab_size)
            on_text = None
            if stream is not None:

                def on_text(piece: str) -> None:
                    stream.write(piece)
                    stream.flush()

            gen = generate(
                engine,
                tok,
                prompt,
                max_tokens,
                SamplingParams(temperature=0.6, top_k=0, top_p=0.9, seed=seed),
                on_text=on_text,
            )
            st = gen.stats
            cache = engine.cache
            total = getattr(cache, "predicted_total", 0)
            return DemoRun(
                label=f"{fraction:.0%}",
                cache_fraction=fraction,
                policy=policy,
                n_slots=engine.cache.n_slots,
                text=gen.text,
                prefill_tokens_per_s=st.prefill_tokens_per_s,
                decode_tokens_per_s=st.decode_tokens_per_s,
                hit_rate=st.hit_rate,
                bytes_per_token=st.bytes_per_token,
                io_wait_seconds=st.io_wait_seconds,
                prefetch_reads=int(getattr(cache, "prefetches", 0)),
                prefetch_recall=cache.predicted_correct / total if total else None,
            )
        finally:
            engine.close()


def _prefetch(run: DemoRun) -> str:
    recall = "-" if run.prefetch_recall is None else f"{run.prefetch_recall:.0%}"
    return f"{run.prefetch_reads} ({recall})"


def _policy_words(policy: str) -> str:
    """The narration's name for an eviction policy."""
    words = {
        "decay": "decaying frequency (scores halve every 32 tokens; beats LRU at 25 %)",
        "lru": "least recently used",
        "lfu": "least frequently used",
        "slru": "segmented LRU",
        "cyclic": "decaying frequency weighed by how soon the layer cycle returns",
        "nextuse": "the farthest expected next use (decay's rate plus the layer cycle)",
    }
    return words.get(policy, policy)


def _size(n: float) -> str:
    if n >= 1e6:
        return f"{n / 1e6:.2f} MB"
    return f"{n / 1e3:.1f} kB"
