"""Shared fixtures of the server tests: a store holding the bundled model (with a chat
template) and a second version (without one), and a server on 127.0.0.1."""

from __future__ import annotations

import json

import pytest

from czyx import portals
from czyx.inference.assets import bundled_model_dir
from czyx.portals.authority import open_authority
from czyx.portals.model import grant_model
from czyx.store import Store
from czyx.store.models.mount import mount

TEMPLATE = (
    "{% for m in messages %}{{ '<' + m['role'] + '>' }}{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def other_checkpoint(path):
    """A second version without torch: the bundled weights, one norm scaled (new content)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    src = bundled_model_dir()
    path.mkdir()
    shutil.copy(src / "config.json", path / "config.json")
    tensors = load_file(src / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 2
    save_file(tensors, path / "model.safetensors")
    return path


def second_version(path):
    """The bundled checkpoint with its final norm tripled: mounted as ``stdlib@2`` (content
    no other space has) it shares every expert extent of ``stdlib@1``."""
    import shutil

    from safetensors.numpy import load_file, save_file

    src = bundled_model_dir()
    path.mkdir()
    shutil.copy(src / "config.json", path / "config.json")
    tensors = load_file(src / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 3
    save_file(tensors, path / "model.safetensors")
    return path


def make_store(root):
    """A store with ``stdlib@1`` (bundled) and ``tiny@1``; returns (dir, config path, tokens)."""
    store_dir = root / "store"
    tiny = other_checkpoint(root / "tiny")
    cfg = root / "tokenizer_config.json"
    cfg.write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "\n\n"}))
    with Store.open(store_dir) as store:
        mount(store, bundled_model_dir(), "stdlib@1")
        mount(store, tiny, "tiny@1")
        tokens = {
            "root": portals.root_token(store),
            "alice": grant_model(store, "stdlib@1", tenant="alice").token,
            "bob": grant_model(store, "tiny@1", tenant="bob").token,
            "reader": grant_model(store, "stdlib@1", tenant="carol", rights="read").token,
            "expired": grant_model(store, "stdlib@1", tenant="dave", expires_at=1).token,
        }
        ids = {"alice": open_authority(store).verify(tokens["alice"]).portal_id.hex()}
    return store_dir, cfg, tokens, ids


def stream_completion(client, n: int, prompt: str = "x", model: str = "stdlib@1"):
    """A streamed greedy completion of ``n`` tokens with usage through the ``openai``
    client: its chunks, and the text of each chunk that carries text."""
    chunks = list(
        client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=n,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    return chunks, [ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].text]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A running server over the store: (base url, tokens, portal ids, app, store dir)."""
    from czyx.inference.batch import BatchOptions
    from czyx.server import ServeOptions, create_app
    from czyx.server.threaded import serve_in_thread

    root = tmp_path_factory.mktemp("serve")
    store_dir, cfg, tokens, ids = make_store(root)
    opts = ServeOptions(
        engine={"stream": None},
        batch=BatchOptions(
            max_batch=8, max_queue=32, prefill_chunk=16, step_tokens=64, prefix_cache_bytes=2**24
        ),
        chat_templates=(("stdlib@1", str(cfg)),),
        event_timeout=60.0,
    )
    app = create_app(str(store_dir), ["stdlib@1", "tiny@1"], opts)
    with serve_in_thread(app) as url:
        yield url, tokens, ids, app, store_dir
