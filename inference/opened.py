"""A model version opened for inference: store, portal view and consumer in one handle.

The public way a script, the CLI and the server open a mounted version:
``OpenedModel(store_dir, "name@ver", token)`` opens the store, checks the portal
(``None``: the owner's root portal) and opens the consumer with O_DIRECT expert
reads; build an :class:`czyx.inference.engine.Engine` over ``.consumer``.
"""

from __future__ import annotations

import os


class OpenedModel:
    """A model version opened through a portal, with the store it came from.

    ``consumer`` is the store's ``ModelConsumer``; :meth:`close` releases it
    and the store.
    """

    def __init__(
        self,
        store_dir: str,
        ref: str,
        token: str | None,
        *,
        lazy_trunk: bool = False,
        tiers: str | None = None,
    ) -> None:
        from czyx.inference.errors import InferenceError
        from czyx.portals import open_consumer
        from czyx.store import Store

        if not os.path.isdir(store_dir):
            raise InferenceError(f"no store at {store_dir!r} (set --store or $CZYX_STORE)")
        self.store = Store.open(store_dir, create=False)
        try:
            # No token: the owner's root portal (local use); a tenant passes theirs.
            if tiers is not None:  # both versions, one consumer (czyx.inference.tiers)
                from czyx.inference.tiers import open_tiered

                self.consumer = open_tiered(
                    self.store, token or None, ref, tiers, direct=True, lazy_trunk=lazy_trunk
                )
            else:
                self.consumer = open_consumer(
                    self.store, token or None, ref, direct=True, lazy_trunk=lazy_trunk
                )
        except BaseException:
            self.store.close()
            raise

    def close(self) -> None:
        """Close the consumer, then the store."""
        try:
            self.consumer.close()
        finally:
            self.store.close()

    def __enter__(self) -> OpenedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
