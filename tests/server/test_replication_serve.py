"""The replication routes mounted in ``czyx serve``'s app (``--replicate``), which holds
the store open itself: the routes share its handle (one LMDB environment per process)."""

from __future__ import annotations

from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from czyx.cli.commands.pull import pull  # noqa: E402
from czyx.portals.model import grant_model  # noqa: E402
from czyx.store import Store  # noqa: E402
from czyx.store.models.mount import mount  # noqa: E402
from czyx.testing.loopback import serve_in_thread  # noqa: E402

ASSET = Path(__file__).resolve().parents[2] / "inference" / "assets" / "czyx-moe-stdlib"


def test_pull_from_the_serve_app(tmp_path):
    from czyx.server import create_app
    from czyx.server.replication import routes

    src = str(tmp_path / "src")
    with Store.open(src) as s:
        mount(s, ASSET, "m@1")
        token = grant_model(s, "m@1", tenant="puller", rights="read").token
        sel = s.resolve_tag("m@1")
    app = create_app(src, ["m@1"], extra_routes=routes(src))
    try:
        with serve_in_thread(app) as url:
            res = pull(url, "m@1", token, str(tmp_path / "dest"))
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        app.state.czyx.close()
    assert res.spaces_published == 2 and res.bytes_fetched == res.bytes_total
    with Store.open(tmp_path / "dest", create=False) as d:
        assert d.resolve_tag("m@1") == sel
        for space in d.spaces():
            d.verify_space(space)
