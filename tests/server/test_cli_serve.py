"""``czyx serve``: its flags build the same engine options ``czyx run`` parses, and it binds
loopback only."""

from __future__ import annotations

import argparse

import pytest

from czyx.cli import build_parser, main
from czyx.inference.options import BATCHED_OPTIONS, DEFAULT_OPTIONS


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_flags_build_serve_options():
    from czyx.cli.commands.serve import serve_options

    args = _args(
        "a@1",
        "--cache-fraction",
        "0.5",
        "--policy",
        "lru",
        "--kv-mb",
        "2",
        "--max-batch",
        "4",
        "--max-queue",
        "3",
        "--prefill-chunk",
        "8",
        "--no-prefetch",
        "--readers",
        "1",
        "--io",
        "pread",
    )
    opts = serve_options(args)
    assert args.refs == ["a@1"]
    engine_opts = opts.engine["options"]
    assert opts.engine["cache_fraction"] == 0.5 and engine_opts.policy == "lru"
    assert engine_opts.prefetch is False and engine_opts.io == "pread" and engine_opts.readers == 1
    assert opts.batch.kv_bytes == 2 * 2**20 and opts.batch.max_batch == 4
    assert opts.batch.max_queue == 3 and opts.batch.prefill_chunk == 8
    # Serving defaults: a batched engine's, defined once (BATCHED_OPTIONS).
    served = serve_options(_args()).engine["options"]
    assert (served.prefetch, served.policy) == (BATCHED_OPTIONS.prefetch, BATCHED_OPTIONS.policy)
    assert serve_options(_args("--prefetch")).engine["options"].prefetch is True
    assert serve_options(_args()).stream_interval == 0.0  # each burst written at once
    assert serve_options(_args("--stream-interval-ms", "2")).stream_interval == 0.002
    # The run command parses the very same flags, with the single-sequence defaults.
    run = build_parser().parse_args(["run", "a@1", "--prompt", "x", "--cache-fraction", "0.5"])
    assert run.cache_fraction == 0.5 and run.policy == DEFAULT_OPTIONS.policy
    assert run.no_prefetch is (not DEFAULT_OPTIONS.prefetch)
    run = build_parser().parse_args(["run", "a@1", "--prompt", "x", "--no-prefetch"])
    assert run.no_prefetch is True


def test_bad_flags_fail_closed(capsys):
    assert main(["serve", "--host", "0.0.0.0", "--store", "/nonexistent"]) == 1
    assert "loopback" in capsys.readouterr().err
    assert main(["serve", "--kv-mb", "0", "--store", "/nonexistent"]) == 1
    assert main(["serve", "--max-batch", "0", "--store", "/nonexistent"]) == 1
    assert main(["serve", "--stream-interval-ms", "-1", "--store", "/nonexistent"]) == 1
    assert "stream_interval" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _args("--policy", "nope")


def test_serve_says_when_a_version_streams_for_lack_of_memory(tmp_path, monkeypatch, capsys):
    import uvicorn

    from czyx.inference import engine as engine_mod

    from .conftest import make_store

    store_dir, _, _, _ = make_store(tmp_path)
    ran = []

    def run(server, sockets=None):  # instead of serving: note the call, close the app's state
        ran.append(sockets[0].getsockname())
        server.config.app.state.czyx.close()

    monkeypatch.setattr(uvicorn.Server, "run", run)
    # no budget flag, and room for fewer than all of the bundled model's experts
    monkeypatch.setattr(engine_mod, "available_bytes", lambda: 4 * 2**20)
    assert main(["serve", "stdlib@1", "--store", str(store_dir), "--port", "0"]) == 0
    err = capsys.readouterr().err
    host, port = ran[0]
    assert host == "127.0.0.1" and port > 0 and f"on http://127.0.0.1:{port}/v1" in err
    assert f"web playground at http://127.0.0.1:{port}/\n" in err
    assert "czyx serve: stdlib@1: expert slots:" in err and "--cache-mb" in err
    # how a client gets its bearer token, for the store being served
    assert f"czyx grant stdlib@1 --tenant NAME --rights infer --store {store_dir}" in err
    spaced = tmp_path / "a store"
    store_dir.rename(spaced)  # a path the printed command must quote
    assert main(["serve", "stdlib@1", "--store", str(spaced), "--port", "0"]) == 0
    assert f"--store '{spaced}'" in capsys.readouterr().err
    monkeypatch.setattr(engine_mod, "available_bytes", lambda: 2**40)
    assert main(["serve", "stdlib@1", "--store", str(spaced), "--port", "0"]) == 0
    assert "expert slots:" not in capsys.readouterr().err


def test_the_port_is_bound_before_the_models_load(tmp_path, capsys):
    """A port in use or out of range is a one-line error before anything loads; port 0
    is a free one, and the printed URL names it."""
    import socket

    from czyx.cli.commands.serve import _listen

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        store = str(tmp_path / "nothing-here")  # never opened: the bind fails first
        assert main(["serve", "x@1", "--port", str(port), "--store", store]) == 1
        err = capsys.readouterr().err
        assert f"cannot listen on 127.0.0.1:{port}" in err and len(err.strip().splitlines()) == 1
        assert main(["serve", "x@1", "--port", "70000", "--store", store]) == 1
        assert "not a TCP port" in capsys.readouterr().err
    finally:
        taken.close()
    with _listen("127.0.0.1", 0) as sock:
        assert sock.getsockname()[1] > 0
