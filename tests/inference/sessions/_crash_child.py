"""Child process of the crash tests: saves session versions, and dies where told.

``python -m tests.inference.sessions._crash_child STORE MODE``

MODE ``loop``: save versions 1, 2, ... of session ``s`` forever, printing each
version once its save returned (the parent SIGKILLs us at a random instant).
MODE ``before-publish`` / ``before-tag``: save one version over the existing
head, SIGKILLing ourselves after the extent is written and fsynced but before
the space is published, or after publication and edges but before the tag.
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np

from czyx.store import Store
from czyx.store.core.blockfile import BlockWriter
from tests.inference.sessions.helpers import random_state, sessions_for


def state_for(version: int):
    """The deterministic state every test saves as ``version``."""
    return random_state(np.random.default_rng(version), length=40 + 23 * version)


def _die(*_a, **_k):
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    path, mode = sys.argv[1], sys.argv[2]
    st = Store.open(path)
    ss = sessions_for(st, "alice")
    if mode == "loop":
        v = len(ss.versions("s"))
        while True:
            v += 1
            ss.save("s", state_for(v))
            print(v, flush=True)
    head = len(ss.versions("s"))
    if mode == "before-publish":
        orig = BlockWriter.sync

        def sync_then_die(self):
            orig(self)
            _die()

        BlockWriter.sync = sync_then_die
    elif mode == "before-tag":
        type(st).set_tag = _die
    ss.save("s", state_for(head + 1))
    raise SystemExit("not killed")


if __name__ == "__main__":
    main()
