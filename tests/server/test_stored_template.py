"""The chat template mounted with a checkpoint (issue 16), from its ``tokenizer_config.json``
or, as transformers 5 saves it, its ``chat_template.jinja``: the server renders it without
``--chat-template``, which still overrides it."""

from __future__ import annotations

import json
import shutil

import openai
import pytest

from czyx import portals
from czyx.inference.assets import bundled_model_dir
from czyx.store import Store
from czyx.store.models.mount import mount

STORED = (
    "{% for m in messages %}{{ '[' + m['role'] + ']' }}{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
OVERRIDE = "{{ messages[-1]['content'] }}"
JINJA = "{{ bos_token }}" + STORED  # a chat_template.jinja, its special token from the config


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("stored-template")
    ckpt = root / "ckpt"
    shutil.copytree(bundled_model_dir(), ckpt)
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"chat_template": STORED}))
    with Store.open(root / "store") as st:
        mount(st, ckpt, "chat@1")
        mount(st, bundled_model_dir(), "plain@1")
        # As transformers 5 saves a tokenizer: the template in its own file, the config
        # without one (a template there too would lose to the file, as in transformers).
        (ckpt / "chat_template.jinja").write_text(JINJA)
        cfg = {"chat_template": OVERRIDE, "bos_token": {"content": "<s>"}}
        (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
        mount(st, ckpt, "jinja@1")
        token = portals.root_token(st)
    return root / "store", token


def _chat(store, model="chat@1", **opts):
    from czyx.server import ServeOptions, create_app
    from czyx.server.threaded import serve_in_thread

    store_dir, token = store
    app = create_app(str(store_dir), [model, "plain@1"], ServeOptions(engine={}, **opts))
    with serve_in_thread(app) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key=token, max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": "import os"}]
        r = c.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0)
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            c.chat.completions.create(model="plain@1", messages=msgs, max_tokens=4)
    return r


def test_the_mounted_template_is_rendered(store_dir):
    r = _chat(store_dir)
    assert r.choices[0].message.role == "assistant"
    # byte tokenizer: one prompt token per byte of the rendered template
    assert r.usage.prompt_tokens == len(b"[user]import os\n[assistant]")


def test_chat_template_option_overrides_the_mounted_one(store_dir, tmp_path):
    path = tmp_path / "override.jinja"
    path.write_text(OVERRIDE)
    r = _chat(store_dir, chat_templates=(("chat@1", str(path)),))
    assert r.usage.prompt_tokens == len(b"import os")


def test_a_mounted_chat_template_jinja_is_rendered_with_the_configs_tokens(store_dir):
    r = _chat(store_dir, "jinja@1")
    assert r.usage.prompt_tokens == len(b"<s>[user]import os\n[assistant]")
