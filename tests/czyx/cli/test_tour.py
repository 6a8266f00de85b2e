"""The README's command tour, each command in a fresh process, on the bundled model.

Separate processes matter: import order inside one interpreter once hid a
crash that every fresh ``czyx run --session`` hit.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from czyx.inference.assets import bundled_model_dir


def czyx(*args: str, store: str, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "czyx", *args, "--store", store],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if ok:
        assert proc.returncode == 0, f"czyx {' '.join(args)}: {proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tour") / "store")
    czyx("mount", str(bundled_model_dir()), "--as", "stdlib@v1", store=d)
    return d


def test_show_and_ls(store):
    assert "stdlib@v1" in czyx("ls", store=store).stdout
    out = czyx("show", "stdlib@v1", store=store).stdout
    assert "16" in out and "mixtral" in out.lower()


def test_a_missing_tag_lists_the_tags_the_store_has(store, tmp_path):
    err = czyx("run", "stdlib@v9", "--prompt", "x", store=store, ok=False)
    assert err.returncode == 1
    assert f"tag 'stdlib@v9' not found (tags in {store}: stdlib@v1" in err.stderr
    from czyx.store import Store

    empty = tmp_path / "empty"
    Store.open(empty).close()
    none = czyx("show", "a@1", store=str(empty), ok=False)
    assert none.returncode == 1
    assert f"tag 'a@1' not found (the store {empty} has no tags)" in none.stderr


def test_grant_run_audit_revoke(store):
    token = czyx(
        "grant",
        "stdlib@v1",
        "--tenant",
        "alice",
        "--rights",
        "infer",
        "--expires",
        "1h",
        store=store,
    ).stdout.strip()
    run = czyx(
        "run",
        "stdlib@v1",
        "--prompt",
        "def ",
        "--max-tokens",
        "8",
        "--portal",
        token,
        "--cache-fraction",
        "0.25",
        store=store,
    )
    assert "hit rate" in run.stderr
    listing = czyx("portals", store=store).stdout
    assert "alice" in listing
    audit = czyx("audit", store=store).stdout
    assert "alice" in audit and token not in audit
    pid = next(line.split()[0] for line in listing.splitlines() if "alice" in line)
    czyx("revoke", pid, store=store)
    refused = czyx("run", "stdlib@v1", "--prompt", "x", "--portal", token, store=store, ok=False)
    assert refused.returncode == 1 and "revoked" in refused.stderr.lower()
    assert "Traceback" not in refused.stderr


def test_session_save_and_resume(store):
    first = czyx(
        "run", "stdlib@v1", "--prompt", "def ", "--max-tokens", "6", "--session", "s1", store=store
    )
    assert "started" in first.stderr
    second = czyx(
        "run", "stdlib@v1", "--prompt", "x", "--max-tokens", "6", "--session", "s1", store=store
    )
    assert "resumed" in second.stderr
    assert "s1" in czyx("sessions", store=store).stdout


def test_profile_locality_and_class_order_mount(store, tmp_path):
    text = tmp_path / "t.py"
    text.write_text("import os\n\n\ndef main(argv):\n    return os.path.join(*argv)\n" * 20)
    trace = tmp_path / "trace.npz"
    czyx("profile", "stdlib@v1", "--text", str(text), "--out", str(trace), store=store)
    # `locality` reads only the trace (no store).
    proc = subprocess.run(
        [sys.executable, "-m", "czyx", "locality", str(trace), "--out", str(tmp_path / "loc")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    order = tmp_path / "loc" / "class_order.npy"
    czyx(
        "mount",
        str(bundled_model_dir()),
        "--as",
        "stdlib@perm",
        "--class-order",
        str(order),
        store=store,
    )
    run = czyx("run", "stdlib@perm", "--prompt", "def ", "--max-tokens", "4", store=store)
    assert "decode" in run.stderr


def test_calibrate_and_quantized_mount(store, tmp_path):
    text = tmp_path / "t.py"
    text.write_text("class A:\n    def f(self, x):\n        return x + 1\n" * 40)
    czyx("calibrate", "stdlib@v1", "--text", str(text), "--window", "64", store=store)
    czyx(
        "mount",
        str(bundled_model_dir()),
        "--as",
        "stdlib@q",
        "--quant",
        "selective",
        "--importance",
        "stdlib-importance@v1",
        store=store,
    )
    run = czyx("run", "stdlib@q", "--prompt", "def ", "--max-tokens", "4", store=store)
    assert "decode" in run.stderr


def test_store_fsck(store):
    proc = subprocess.run(
        [sys.executable, "-m", "czyx", "store", "fsck", store], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_run_xray_and_bench_io(store, tmp_path):
    import json

    import jsonschema

    from czyx.inference.xray import SCHEMA_PATH

    out = tmp_path / "xray.json"
    czyx(
        "run",
        "stdlib@v1",
        "--prompt",
        "def ",
        "--max-tokens",
        "6",
        "--cache-fraction",
        "0.25",
        "--xray",
        str(out),
        store=store,
    )
    report = json.loads(out.read_text())
    jsonschema.validate(report, json.loads(SCHEMA_PATH.read_text()))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "czyx",
            "bench",
            "io",
            "--dir",
            str(tmp_path),
            "--size-mib",
            "8",
            "--no-save",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "direct" in proc.stdout + proc.stderr


def test_trunk_window_run_generates_the_same_text(store):
    args = ("run", "stdlib@v1", "--prompt", "def ", "--max-tokens", "6", "--cache-fraction", "0.25")
    plain = czyx(*args, store=store)
    windowed = czyx(*args, "--trunk-window", "2", store=store)
    assert windowed.stdout == plain.stdout and plain.stdout
    assert "trunk window" in windowed.stderr.lower()


def test_class_scoped_portal_runs(store):
    """The README's scoped grant (classes 0-7) runs the model: routing stays inside it."""
    grant = ["grant", "stdlib@v1", "--tenant", "alice", "--classes", "0-7", "--rights", "infer"]
    token = czyx(*grant, store=store).stdout.strip()
    ask = ["run", "stdlib@v1", "--prompt", "def ", "--max-tokens", "8"]
    run = czyx(*ask, "--portal", token, store=store)
    assert "restricted by the portal" in run.stderr and "of 16 experts" in run.stderr
    assert "outside the portal" not in run.stderr
