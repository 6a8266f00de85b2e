"""Chat templates: a checkpoint's chat template rendered as transformers renders it.

Scope: loading the template with its special tokens, from where transformers
looks: the checkpoint's ``chat_template.jinja`` (transformers 5 saves a template
there and leaves it out of ``tokenizer_config.json``; loading, it prefers that
file), else the ``chat_template`` of its ``tokenizer_config.json`` (a string or
a list of named templates), the special tokens from that config either way; and
rendering a list of messages in the same sandboxed jinja2 environment
transformers builds for ``apply_chat_template`` (trim_blocks, lstrip_blocks,
loop controls, its ``tojson``, ``raise_exception``, ``strftime_now``), so a
served model sees the prompt text its own tokenizer would produce. A model
without a template refuses chat (the caller answers 400).

A mounted checkpoint keeps both files (the server reads them from the store);
``--chat-template`` gives one by path instead.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from czyx.errors import CzyxError


class TemplateError(CzyxError):
    """A chat template is missing, unreadable, or failed to render."""


SPECIAL_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


#: The files transformers reads a tokenizer's chat template and special tokens from.
JINJA_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"


def _token_text(v: Any) -> str | None:
    if isinstance(v, dict):  # AddedToken serialised as {"content": ...}
        v = v.get("content")
    return v if isinstance(v, str) else None


@dataclass(frozen=True)
class ChatTemplate:
    """A jinja chat template and the special tokens transformers passes it."""

    source: str
    special: tuple[tuple[str, str], ...] = field(default=())

    @property
    def eos_token(self) -> str | None:
        """The end-of-sequence token's text (a chat turn's end), if the config names one."""
        return dict(self.special).get("eos_token")

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (each a dict with ``role`` and ``content``).

        Raises
        ------
        TemplateError
            The template raised (``raise_exception``) or is invalid jinja.
        """
        import jinja2

        try:
            tpl = _compile(self.source)
            return tpl.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **dict(self.special),
            )
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template: {exc}") from exc


_COMPILED: dict[str, Any] = {}


def _compile(source: str):
    """The template compiled in transformers' sandboxed environment (cached by source)."""
    tpl = _COMPILED.get(source)
    if tpl is not None:
        return tpl
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # As transformers: no HTML escaping, options exposed.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        tpl = env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"chat template does not compile: {exc}") from exc
    if len(_COMPILED) < 64:
        _COMPILED[source] = tpl
    return tpl


def from_tokenizer_config(
    config: dict[str, Any], template: str | None = None
) -> ChatTemplate | None:
    """The template of a parsed ``tokenizer_config.json`` (None: it has none).

    ``template`` is the text of the checkpoint's ``chat_template.jinja`` where it has
    one: as in transformers, it replaces the config's own template, and the config
    gives the special tokens. A list of named templates gives the one named ``default``.
    """
    tpl = template if template is not None else config.get("chat_template")
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    if tpl is None:
        return None
    if not isinstance(tpl, str):
        raise TemplateError("tokenizer_config.json: chat_template is neither text nor a list")
    special = []
    for key in SPECIAL_KEYS:
        text = _token_text(config.get(key))
        if text is not None:
            special.append((key, text))
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        special.append(("additional_special_tokens", [_token_text(t) for t in extra]))  # type: ignore[arg-type]
    _compile(tpl)  # fail at load, not at the first request
    return ChatTemplate(tpl, tuple(special))


def load_template(path: str | os.PathLike) -> ChatTemplate:
    """A template from a checkpoint directory, its ``tokenizer_config.json`` or a
    ``.jinja`` file.

    As transformers loads a directory: its ``chat_template.jinja`` where it has one,
    else the config's template; the special tokens from the ``tokenizer_config.json``
    in the same directory. A config without a template takes the
    ``chat_template.jinja`` beside it.

    Raises
    ------
    TemplateError
        No such file, bad JSON or UTF-8, or no chat template.
    """
    p = os.fspath(path)
    if os.path.isdir(p):
        jinja = os.path.join(p, JINJA_FILE)
        p = jinja if os.path.isfile(jinja) else os.path.join(p, CONFIG_FILE)
    if not os.path.isfile(p):
        raise TemplateError(f"chat template {p!r}: no such file")
    here = os.path.dirname(p)
    if p.endswith(".json"):
        cfg = _read_config(p)
        beside = os.path.join(here, JINJA_FILE)
        text = _read_text(beside) if "chat_template" not in cfg and os.path.isfile(beside) else None
        tpl = from_tokenizer_config(cfg, text)
        if tpl is None:
            raise TemplateError(f"{p}: has no chat_template (and no {JINJA_FILE} beside it)")
        return tpl
    config = os.path.join(here, CONFIG_FILE)
    cfg = _read_config(config) if os.path.isfile(config) else {}
    tpl = from_tokenizer_config(cfg, _read_text(p))
    assert tpl is not None  # (a template was given)
    return tpl


def _read_text(p: str) -> str:
    try:
        with open(p, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as exc:
        raise TemplateError(f"{p}: not UTF-8 ({exc.reason})") from None


def _read_config(p: str) -> dict[str, Any]:
    try:
        cfg = json.loads(_read_text(p))
    except json.JSONDecodeError as exc:
        raise TemplateError(f"{p}: not JSON ({exc})") from exc
    if not isinstance(cfg, dict):
        raise TemplateError(f"{p}: not a JSON object")
    return cfg
