"""The web playground in a real headless Chromium (Debian's ``chromium``, driven by Playwright).

One server (the bundled model streamed from a half budget with look-ahead prefetch,
so tokens hit, miss and prefetch), one browser: sign in, see the versions, chat
with the keyboard and see the text stream, see the expert grid change during the
generation (each frame routing top-k experts per layer), replay a token; the store
view for the owner's portal and not for a tenant's; a revoked token is signed out
on its next request; the page fits a narrow window.

Skipped, with the reason, where Playwright or a chromium binary is missing
(``apt-get install chromium``; ``pip install playwright``; never ``playwright
install``). ``CZYX_WEB_SHOTS=DIR`` saves the screenshots of the main views there
(the README's are made so: ``CZYX_WEB_SHOTS=docs``).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install playwright)"
)
CHROMIUM = os.environ.get("CZYX_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).is_file():
    pytest.skip(
        f"no chromium binary at {CHROMIUM} (apt-get install chromium, or set CZYX_CHROMIUM)",
        allow_module_level=True,
    )

ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WAIT_MS = 30_000
SHOTS = os.environ.get("CZYX_WEB_SHOTS")

# Records, in the page, the assistant text's length while the message is still streaming
# and each distinct state of the expert grid (the classes of its cells) as it changes.
WATCH_JS = """() => {
  window.seen = {partial: [], grids: [], frames: []};
  const log = document.getElementById('log');
  new MutationObserver(() => {
    const busy = log.querySelector('.msg.assistant[aria-busy=true] .text');
    if (busy) window.seen.partial.push(busy.textContent.length);
  }).observe(log, {subtree: true, childList: true, characterData: true});
  const grid = document.getElementById('grid');
  new MutationObserver(() => {
    const sig = [...grid.querySelectorAll('.cell')].map(c => c.className).join(',');
    const last = window.seen.grids[window.seen.grids.length - 1];
    if (sig !== last) { window.seen.grids.push(sig); window.seen.frames.push(grid.dataset.frame); }
  }).observe(grid, {subtree: true, attributes: true, attributeFilter: ['class']});
}"""

STOP_AT_5_JS = """() => new MutationObserver((_, obs) => {
  if (document.querySelectorAll('#tokens button').length >= 5) {
    obs.disconnect();
    document.getElementById('stop').click();
  }
}).observe(document.getElementById('tokens'), {childList: true})"""


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    """(base url, tokens, app) of a server over a fresh store."""
    from czyx.inference.batch import BatchOptions
    from czyx.inference.options import EngineOptions
    from czyx.server import ServeOptions, create_app
    from czyx.server.threaded import serve_in_thread
    from czyx.store import Store
    from czyx.store.models.mount import mount
    from tests.server.conftest import make_store, second_version

    root = tmp_path_factory.mktemp("web")
    store_dir, cfg, tokens, _ = make_store(root)
    with Store.open(store_dir) as store:  # a second version sharing stdlib@1's experts
        mount(store, second_version(root / "v2"), "stdlib@2")
    opts = ServeOptions(
        engine={
            "options": EngineOptions(policy="lru", stream=True, prefetch=True),
            "cache_fraction": 0.5,
        },
        batch=BatchOptions(max_batch=4, max_queue=8, prefill_chunk=16, step_tokens=64),
        chat_templates=(("stdlib@1", str(cfg)),),
        event_timeout=60.0,
    )
    app = create_app(str(store_dir), ["stdlib@1", "tiny@1"], opts)
    with serve_in_thread(app) as url:
        yield url, tokens, app


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            yield b
        finally:
            b.close()


def _page(browser, url, width=1280, height=800):
    page = browser.new_page(viewport={"width": width, "height": height})
    page.set_default_timeout(WAIT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(url + "/")
    return page, errors


def _sign_in(page, token):
    page.get_by_label("Portal token").fill(token)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_selector("body[data-signed-in=true]")


def _shot(page, name, full_page=False):
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SHOTS) / f"playground-{name}.png"), full_page=full_page)


def _chat(page, text):
    """Send ``text`` with the keyboard (Ctrl+Enter) and wait for the generation's end."""
    page.get_by_label("Message").fill(text)
    page.get_by_label("Message").press("Control+Enter")
    page.wait_for_function(
        "() => !document.querySelector('.msg.assistant[aria-busy]') && "
        "document.getElementById('status').textContent.includes('finish')"
    )


def test_sign_in_chat_streams_and_the_expert_grid_follows_the_tokens(web, browser):
    url, tokens, app = web
    page, errors = _page(browser, url)
    _sign_in(page, tokens["alice"])
    # The versions this portal may run, and no store view for a tenant's portal.
    assert page.locator("#model option").all_inner_texts() == ["stdlib@1"]
    assert page.get_by_role("tab", name="Store").is_hidden()
    cfg = app.state.czyx.models["stdlib@1"].engine.cfg
    n_sparse = sum(cfg.sparse_layers)
    assert page.locator("#grid .cell").count() == n_sparse * cfg.n_experts
    # The prompt as the API's chat template renders it.
    page.get_by_label("Message").fill("hi")
    page.get_by_role("button", name="Show prompt").click()
    page.wait_for_selector("#rendered:not([hidden])")
    assert page.locator("#rendered").inner_text().startswith("<user>hi\n<assistant>")
    page.get_by_text("Sampling").click()
    page.get_by_label("Max tokens").fill("40")
    page.evaluate(WATCH_JS)
    _chat(page, "def main(argv):")
    seen = page.evaluate("window.seen")
    answer = page.locator(".msg.assistant .text").last.inner_text()
    n_frames = page.locator("#tokens button").count()
    status = page.locator("#status").inner_text()
    assert "finish: length" in status and "40 tokens" in status
    # The text streamed: seen part-written while the message was still generating.
    assert any(0 < n < len(answer) for n in seen["partial"]), seen["partial"]
    # The grid changed with the tokens, one frame per fed token (the last is never fed).
    assert n_frames == 39
    assert len(set(seen["grids"])) >= 3 and len(set(seen["frames"])) >= 3
    for sig in seen["grids"]:
        classes = sig.split(",")
        routed = sum(c.split()[-1] in ("hit", "pref", "miss") for c in classes)
        assert routed == n_sparse * cfg.top_k  # top-k experts per layer, each coloured
    assert any("miss" in sig for sig in seen["grids"])  # half the experts fit: some reads
    assert page.locator("#v-hit").inner_text().endswith("%")
    assert page.evaluate("() => document.scrollingElement.scrollWidth") <= 1280  # fits 1280x800
    _shot(page, "chat")
    # Replay by hand: the first token's frame comes back as the grid showed it live.
    page.locator("#tokens button").first.click()
    assert page.locator("#grid").get_attribute("data-frame") == "0"
    first = page.evaluate(
        "() => [...document.querySelectorAll('#grid .cell')].map(c => c.className).join(',')"
    )
    assert first == seen["grids"][seen["frames"].index("0")]
    page.get_by_role("button", name="Replay").click()
    last = str(n_frames - 1)
    page.wait_for_function(f"() => document.getElementById('grid').dataset.frame === '{last}'")
    assert not errors, errors
    page.close()


def test_store_view_for_the_owner_and_a_narrow_window(web, browser):
    from czyx.portals.authority import open_authority
    from czyx.portals.model import grant_model

    url, tokens, app = web
    store = app.state.czyx.store
    open_authority(store).revoke(grant_model(store, "tiny@1", tenant="frank").id_hex)
    page, errors = _page(browser, url)
    _sign_in(page, tokens["root"])
    options = page.locator("#model option").all_inner_texts()
    assert options == ["stdlib@1", "tiny@1 (no chat template)"]
    page.get_by_role("tab", name="Store").click()
    page.wait_for_selector("#t-portals tbody tr")
    assert page.locator("#view-play").is_hidden()  # one view at a time
    rows = [r.split("\t") for r in page.locator("#t-versions tbody tr").all_inner_texts()]
    assert [r[0] for r in rows] == ["stdlib@1", "stdlib@2", "tiny@1"]
    assert rows[1][5].startswith("stdlib@1: 6.0 MiB")  # stdlib@2's experts are stdlib@1's
    statuses = page.locator("#t-portals tbody tr td:nth-child(2)").all_inner_texts()
    assert {"active", "expired", "revoked"} <= set(statuses)
    assert page.locator("#t-audit tbody tr").count() > 0
    _shot(page, "store")
    # A narrow window: the playground stacks its panels and nothing overflows sideways.
    page.set_viewport_size({"width": 420, "height": 860})
    page.get_by_role("tab", name="Playground").click()
    assert page.locator("#view-store").is_hidden()
    _chat(page, "import os")
    width = page.evaluate("() => document.scrollingElement.scrollWidth")
    assert width <= 420, width
    _shot(page, "narrow", full_page=True)
    # A named session: the server keeps the conversation, the second turn resumes it.
    page.get_by_label("Session").fill("notes")
    _chat(page, "x = 1")
    assert "session notes v1" in page.locator("#status").inner_text()
    _chat(page, "y = 2")
    status = page.locator("#status").inner_text()
    assert "session notes v2" in status and "cached" in status
    # Stop: the stream ends at once and the server frees the sequence.
    page.get_by_label("Session").fill("")
    page.get_by_text("Sampling").click()
    page.get_by_label("Max tokens").fill("900")
    page.get_by_label("Message").fill("for i in range(")
    # (the tiny model outruns a click from here: the page presses Stop at the 5th token)
    page.evaluate(STOP_AT_5_JS)
    page.get_by_role("button", name="Send").click()
    page.wait_for_function("() => document.querySelector('#status').textContent.includes('stop')")
    assert "finish: stopped" in page.locator("#status").inner_text()
    assert page.locator("#tokens button").count() < 899
    sched = app.state.czyx.models["stdlib@1"].scheduler
    deadline = time.monotonic() + 10
    while sched.stats().active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sched.stats().active == 0
    assert not errors, errors
    page.close()


def test_a_revoked_token_is_signed_out_on_its_next_request(web, browser):
    from czyx.portals.authority import open_authority
    from czyx.portals.model import grant_model

    url, _, app = web
    store = app.state.czyx.store
    grant = grant_model(store, "stdlib@1", tenant="erin")
    page, errors = _page(browser, url)
    _sign_in(page, grant.token)
    assert page.evaluate("() => sessionStorage.getItem('czyx.token')") == grant.token
    page.reload()  # the tab's session storage keeps it signed in
    page.wait_for_selector("body[data-signed-in=true]")
    open_authority(store).revoke(grant.id_hex, reason="test")
    page.get_by_label("Message").fill("hello")
    page.get_by_role("button", name="Send").click()
    page.wait_for_selector("body[data-signed-in=false]")
    assert page.get_by_label("Portal token").is_visible()
    assert "revoked" in page.locator("#signin-error").inner_text()
    assert page.evaluate("() => sessionStorage.getItem('czyx.token')") is None
    # (the browser's own console logs the refused requests: the page itself raised nothing)
    assert not [e for e in errors if "Failed to load resource" not in e], errors
    page.close()
