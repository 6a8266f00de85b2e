"""Child process of the cross-process test: resume a saved session and continue it.

``python -m tests.inference.sessions._resume_child MODEL.pkl STORE PORTAL NAME STEPS OUT.npz``
loads the model as a pickled :class:`~tests.inference.sessions.helpers.NumpyConsumer`
(no torch here), resumes, and writes the sampled tokens and every step's logits.
"""

from __future__ import annotations

import pickle
import sys

import numpy as np

from czyx.inference.engine import Engine
from czyx.inference.sessions.live import LiveSession
from czyx.inference.sessions.store import SessionStore
from czyx.store import Store
from tests.inference.sessions.helpers import MODEL_A


def main() -> None:
    model, path, portal, name, steps, out = sys.argv[1:7]
    with open(model, "rb") as f:
        engine = Engine(pickle.load(f))
    with Store.open(path) as st:
        parsed = SessionStore(st, portal).read(name, model=MODEL_A)
    live = LiveSession.resume(engine, parsed, "alice")
    toks, logits = [], []
    for _ in range(int(steps)):
        toks.append(live.step())
        logits.append(live.logits.copy())
    np.savez(out, tokens=np.array(toks), logits=np.stack(logits))


if __name__ == "__main__":
    main()
