"""``czyx calibrate NAME@VERSION --text FILE``: record a model's calibration importance map.

Runs the mounted (float) model over the text in windows, recording for every
matrix input (every layer's attention and MoE input, every routed expert on
the tokens routed to it, the head) the mean squared activation of each
column, and publishes the map as a content-addressed space whose records sit
at the weights' coordinates (``store/quant/importance.py``), tagged
``NAME-importance@VERSION`` unless ``--as`` says otherwise. ``czyx mount
--quant POLICY --importance TAG`` then quantizes with it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from czyx.cli.commands._storearg import add_store_arg, store_dir


def register(subparsers: Any) -> None:
    """Add the ``calibrate`` subcommand."""
    p = subparsers.add_parser(
        "calibrate", help="record the importance map of NAME@VERSION over real text"
    )
    p.add_argument("ref", metavar="NAME@VERSION", help="the mounted (float) model version")
    p.add_argument("--text", required=True, metavar="FILE", help="calibration text (UTF-8)")
    p.add_argument("--window", type=int, default=256, help="tokens per window (default 256)")
    p.add_argument(
        "--max-tokens", type=int, default=65536, help="tokens of the text to use (default 65536)"
    )
    p.add_argument("--as", dest="tag", default=None, metavar="TAG", help="tag of the map")
    add_store_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Calibrate, publish, print the one-line summary."""
    import numpy as np

    from czyx.expert_key import class_shift
    from czyx.inference.calibration import Provenance, collect
    from czyx.inference.engine import Engine
    from czyx.inference.tokenizer import tokenizer_for
    from czyx.portals import open_consumer
    from czyx.store import Store
    from czyx.store.models.archs import ROLE_INDEX
    from czyx.store.models.expert_layout import layout_from_manifest
    from czyx.store.models.model import ModelSpace
    from czyx.store.models.mount import parse_tag, resolve
    from czyx.store.quant.importance import publish_importance

    if args.window < 2 or args.max_tokens < args.window:
        raise ValueError(
            f"--window {args.window} / --max-tokens {args.max_tokens}: need 2 <= window <= max"
        )
    with open(args.text, encoding="utf-8") as fh:
        text = fh.read()
    with Store.open(store_dir(args)) as store:
        sel = resolve(store, args.ref)
        space = ModelSpace(store, sel)
        layout = layout_from_manifest(space.root)
        with open_consumer(store, None, sel) as model:
            engine = Engine(model)
            tok = tokenizer_for(model, engine.cfg.vocab_size)
            ids = np.asarray(tok.encode(text), np.int64)[: args.max_tokens]
            n = ids.size // args.window * args.window
            if n == 0:
                raise ValueError(f"{args.text}: fewer than {args.window} tokens")
            windows = ids[:n].reshape(-1, args.window)
            from czyx.cli.commands._progress import progress

            col = collect(engine, progress(list(windows), "calibrate", len(windows)))
            engine.close()
        prov = Provenance.for_text(text, n, source=str(args.text))
        if args.tag is None:
            name, version = (
                parse_tag(args.ref) if "@" in str(args.ref) else ("model", sel.hex()[:16])
            )
            args.tag = f"{name}-importance@{version}"
        imp_sel = publish_importance(
            store,
            sel,
            col.to_dict(prov),
            layout.class_of,
            ROLE_INDEX,
            tag=args.tag,
            class_shift=class_shift(layout.n_classes),
        )
    print(
        f"calibrated: {args.ref} over {n} tokens ({len(windows)} windows of {args.window}), "
        f"{len(col.names())} matrix inputs -> {args.tag} ({imp_sel.hex()[:16]})",
        file=sys.stdout,
    )
    return 0
