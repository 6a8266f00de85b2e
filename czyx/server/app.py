"""The OpenAI-compatible HTTP API over batched engines: :func:`create_app`.

Scope: Starlette routes (``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` streamed as server-sent events or not,
``GET /health``, ``GET /metrics``, and the web playground at ``/`` with its
endpoints under ``/v1/czyx``: :mod:`czyx.server.playground`) over one
:class:`~czyx.inference.batch.Scheduler` per served version, all versions opened
from one store with the owner's portal; each request is authorised by its own bearer portal
(:mod:`czyx.server.auth`) and audited. ``czyx serve`` is a thin layer over
:func:`create_app`; a script serves the same way with uvicorn.

Request semantics follow the OpenAI API: ``max_tokens`` (chat also
``max_completion_tokens``), ``temperature`` (default 1), ``top_p``, ``seed``,
``presence_penalty`` and ``frequency_penalty``, ``stop`` (up to 4 strings; the
text ends before the first match), ``n`` (1 only), ``stream`` with
``stream_options.include_usage``, ``usage`` and ``finish_reason`` ("stop":
end-of-sequence token or stop string; "length": ``max_tokens``); ``top_k`` as
vLLM and llama.cpp take it; czyx's ``speculate`` (``"off"`` or ``"lookup"``: speculative
decoding by prompt lookup, the server's ``--speculate`` when absent) and ``draft_tokens``.
Unsupported fields that would change the answer
(``echo``, ``logprobs``, ``best_of`` > 1, tools, ``response_format`` other than
text, other servers' penalties, grammars and guided decoding) are refused with
400, never ignored; a number that is not finite too. Errors use the OpenAI
error object.

Sessions: a request naming a session in the ``X-Czyx-Session`` header resumes
the caller's saved KV state and saves the new one as the session's next
version, as ``czyx run --session`` does. The OpenAI ``user`` field keeps its
meaning (the end user a client serves): it goes to the audit log only.

Watching: a streamed request with the header ``X-Czyx-Watch: routes`` (the web
playground's, :mod:`czyx.server.playground`) also receives, before each decode
token's chunk, an SSE event ``event: czyx.routes`` whose data is that token's
routing per layer (:func:`route_frame_json`). Only such a request makes the
scheduler record routes; requests without the header pay nothing per token.

Stepping: each version's scheduler is driven on the event loop itself (one
task per version calls :meth:`~czyx.inference.batch.Scheduler.step_once`
while there is work, yielding to the loop between steps), so a step's events
reach their requests on the loop's own thread: no thread hop, no GIL hand-off
per step. A step is one batch of decode tokens or prefill chunks, so the loop
serves accepts, writes and other requests between any two steps.
``ServeOptions.scheduler_thread`` keeps the scheduler on a thread of its own.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from json.encoder import encode_basestring_ascii as _ascii_json
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from czyx.errors import CzyxError
from czyx.inference.batch import (
    BatchOptions,
    QueueFull,
    RequestTooLarge,
    Scheduler,
    Token,
)
from czyx.inference.errors import SamplingError
from czyx.inference.options import SPECULATE_OFF, SpeculateOptions
from czyx.inference.routewatch import RouteFrame
from czyx.inference.sampling import SamplingParams
from czyx.inference.tokenizer import ByteTokenizer
from czyx.server.auth import AuthError, Caller, ServedVersion, TokenGate
from czyx.server.metrics import Metrics
from czyx.server.template import (
    CONFIG_FILE,
    JINJA_FILE,
    ChatTemplate,
    TemplateError,
    from_tokenizer_config,
    load_template,
)

MAX_STOPS = 4
#: Longest OpenAI ``user`` (an end user's id, kept in the audit log) accepted.
MAX_END_USER = 256
#: Request header naming the caller's session (resumed from the store, saved back).
SESSION_HEADER = "x-czyx-session"
#: Response header: the session version a non-streamed request saved.
SESSION_VERSION_HEADER = "X-Czyx-Session-Version"
#: Request header asking a streamed generation for its routing (value :data:`WATCH_ROUTES`).
WATCH_HEADER = "x-czyx-watch"
WATCH_ROUTES = "routes"


class ServerError(CzyxError):
    """The server could not start (a version that is not a model, a bad option)."""


def stored_template(consumer: object, ref: str) -> ChatTemplate | None:
    """The chat template mounted with ``ref``'s checkpoint, as transformers loads it: its
    ``chat_template.jinja`` where it had one, else its ``tokenizer_config.json``'s
    template, the special tokens from that config (for a GGUF source: the template
    its metadata carried).

    None when the checkpoint had none of them, or its config names no template
    (chat then answers 400). Read once, when the version is opened.

    Raises
    ------
    ServerError
        A stored file is not JSON or UTF-8, or the template does not compile (serve
        the version with ``--chat-template`` to replace it).
    """
    side_file = getattr(consumer, "side_file", None)
    raw = side_file(CONFIG_FILE) if callable(side_file) else None
    jinja = side_file(JINJA_FILE) if callable(side_file) else None
    if raw is None and jinja is None:
        # A GGUF source carries its template in its metadata instead.
        gguf_template = getattr(consumer, "gguf_chat_template", None)
        text = gguf_template() if callable(gguf_template) else None
        if text is None:
            return None
        try:
            return from_tokenizer_config({"chat_template": text})
        except TemplateError as exc:
            raise ServerError(
                f"{ref}: its GGUF chat template: {exc} (override it with --chat-template)"
            ) from None
    what = " and ".join(n for n, b in ((JINJA_FILE, jinja), (CONFIG_FILE, raw)) if b is not None)
    try:
        config = {} if raw is None else json.loads(raw)
        if not isinstance(config, dict):
            raise TemplateError(f"{CONFIG_FILE}: not a JSON object")
        return from_tokenizer_config(config, None if jinja is None else jinja.decode("utf-8"))
    except (ValueError, RecursionError, TemplateError) as exc:
        raise ServerError(
            f"{ref}: its mounted {what}: {exc} (override it with --chat-template)"
        ) from None


@dataclass(frozen=True)
class ServeOptions:
    """How :func:`create_app` builds its engines and schedulers.

    Attributes
    ----------
    engine
        Keyword arguments of :class:`~czyx.inference.engine.Engine` (cache
        budget, policy, pinned classes, ``stream`` options, trunk window);
        ``czyx serve`` builds them from the flags ``czyx run`` has. Without
        ``options``, the engines run with
        :data:`~czyx.inference.options.BATCHED_OPTIONS` (a batched engine's
        defaults, the same as ``czyx serve``'s).
    hot_profile
        A routing profile (``czyx profile``) whose hot list is prewarmed.
    batch
        The schedulers' :class:`~czyx.inference.batch.BatchOptions`.
    chat_template
        A ``tokenizer_config.json`` (or its checkpoint directory, or a
        ``.jinja`` file) giving every served version its chat template. Without
        it, a version's template is the ``chat_template`` of the
        ``tokenizer_config.json`` mounted with its checkpoint, when it has one.
    chat_templates
        Per version ``(ref, path)`` overrides of ``chat_template``.
    default_max_tokens
        ``max_tokens`` when a request names none (chat; completions use 16 as OpenAI).
    retry_after
        Seconds a 429 tells the client to wait.
    event_timeout
        Seconds a request waits for its next token before it fails (bounds every wait).
    audit
        Append one ``serve.request`` audit entry per request.
    scheduler
        Builds a version's request scheduler instead of the local continuous
        batcher: ``scheduler(ref, engine, batch, on_step)`` returning an object
        with :class:`~czyx.inference.batch.Scheduler`'s ``submit``, ``stats`` and
        ``close`` (``czyx serve --ray`` passes one that places the version over a
        Ray cluster: :class:`~czyx.inference.distributed.serving.RayScheduler`).
        The local engine then only answers for the config, tokenizer and sessions.
        Its events may come from any thread (they are handed to the loop).
    scheduler_thread
        The local batcher steps on a thread of its own and hands each step's
        events to the event loop, instead of being driven on the loop (the
        default; see the module's docstring).
    stream_interval
        Seconds a stream may hold a token before writing it (0: every burst of
        tokens is written as soon as the loop takes it). A token coming sooner
        than this after the last write waits for the interval's end, written
        together with the tokens that came meanwhile (each still its own SSE
        event): one socket write per interval instead of one per token, which
        the writing process pays for in kernel time, at the cost of up to this
        much added latency per token.
    """

    engine: Mapping[str, Any] = field(default_factory=dict)
    hot_profile: str | None = None
    batch: BatchOptions = field(default_factory=BatchOptions)
    chat_template: str | None = None
    chat_templates: tuple[tuple[str, str], ...] = ()
    default_max_tokens: int = 256
    retry_after: int = 1
    event_timeout: float = 120.0
    audit: bool = True
    scheduler: Callable[..., Any] | None = None
    scheduler_thread: bool = False
    stream_interval: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.stream_interval <= 1.0:
            raise ServerError(f"stream_interval {self.stream_interval} s is not in [0, 1]")


class ApiError(Exception):
    """An error answered in the OpenAI shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The OpenAI error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        """The error as a JSON response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


class ServedModel:
    """One served version: consumer, engine, scheduler, tokenizer, chat template."""

    def __init__(
        self,
        store,
        ref: str,
        options: ServeOptions,
        template: ChatTemplate | None,
        on_step,
    ) -> None:
        from czyx.inference.engine import Engine
        from czyx.inference.profile import RoutingProfile
        from czyx.inference.tokenizer import tokenizer_for
        from czyx.portals import model_spaces, open_consumer

        self.ref = ref
        sel = store.resolve_tag(ref)
        scoped, whole = model_spaces(store, sel)
        self.spaces = ServedVersion(
            ref,
            tuple(s.raw for s in scoped),
            tuple(s.raw for s in whole),
            _expert_classes(store, scoped),
        )
        from czyx.inference.options import BATCHED_OPTIONS

        kwargs = dict(options.engine)
        if not any(k in kwargs for k in ("options", "policy", "stream")):
            kwargs["options"] = BATCHED_OPTIONS
        windowed = kwargs.get("trunk_window") is not None
        tiers = getattr(kwargs.get("options"), "tiers", None)
        if tiers is not None:  # both versions as one consumer (czyx.inference.tiers)
            from czyx.inference.tiers import open_tiered

            self.consumer = open_tiered(store, None, ref, tiers, lazy_trunk=windowed)
        else:
            self.consumer = open_consumer(store, None, ref, direct=True, lazy_trunk=windowed)
        try:
            if options.hot_profile:
                info = self.consumer.info
                kwargs["hot"] = RoutingProfile.load(
                    options.hot_profile, info.n_layers, info.n_experts
                ).hot_list()
            if template is None:
                template = stored_template(self.consumer, ref)
            self.engine = Engine(self.consumer, **kwargs)
        except BaseException:
            self.consumer.close()
            raise
        self.tokenizer = tokenizer_for(self.consumer, self.engine.cfg.vocab_size)
        self.template = template
        self.eos_ids = tuple(self.tokenizer.eos_ids) + tuple(self.engine.cfg.eos_token_ids)
        self.chat_eos_ids = self.eos_ids
        if template is not None and template.eos_token is not None:
            ids = self.tokenizer.encode(template.eos_token)
            if len(ids) == 1:  # the turn-end token the template writes
                self.chat_eos_ids = tuple(dict.fromkeys((*self.eos_ids, ids[0])))
        self.created = int(time.time())
        step = lambda n, t, s: on_step(ref, n, t, s)  # noqa: E731
        #: Steps the scheduler on the event loop (None: it runs on its own thread).
        self.driver: _LoopDriver | None = None
        try:
            if options.scheduler is not None:
                self.scheduler = options.scheduler(ref, self.engine, options.batch, step)
            elif options.scheduler_thread:
                self.scheduler = Scheduler(self.engine.model, options.batch, on_step=step)
            else:
                self.driver = _LoopDriver(ref)
                self.scheduler = Scheduler(
                    self.engine.model,
                    options.batch,
                    on_step=step,
                    driven=True,
                    on_wake=self.driver.wake,
                )
                self.driver.scheduler = self.scheduler
        except BaseException:
            try:
                self.engine.close()
            finally:
                self.consumer.close()
            raise

    def close(self) -> None:
        """Stop the scheduler, then release the engine and consumer."""
        try:
            self.scheduler.close()
        finally:
            try:
                self.engine.close()
            finally:
                self.consumer.close()


def _expert_classes(store, scoped) -> np.ndarray | None:
    """The class value of every (layer, expert) from the first manifest in the version's
    chain that records a layout (an adapter's is its base's)."""
    from czyx.store.models.expert_layout import layout_from_manifest

    for sel in scoped:
        manifest = store.manifest(sel)
        if isinstance(manifest.get("layout"), dict):
            lay = layout_from_manifest(manifest)
            n_layers, n_experts = int(lay.n_layers), int(lay.n_classes)
            return lay.class_array(
                np.arange(n_layers)[:, None], np.arange(n_experts)[None, :]
            ).astype(np.int64)
    return None


class ServerState:
    """Everything an app holds: the store, served models, token gate, metrics."""

    def __init__(self, store_dir: str, refs: Sequence[str], options: ServeOptions) -> None:
        import os

        from czyx.store import Store
        from czyx.store.models.mount import ADAPTER_KIND, MODEL_KIND

        if not os.path.isdir(store_dir):
            raise ServerError(f"no store at {store_dir!r} (set --store or $CZYX_STORE)")
        self.options = options
        self.metrics = Metrics()
        self.store = Store.open(store_dir, create=False)
        self.models: dict[str, ServedModel] = {}
        try:
            if not refs:  # every model version the store holds
                refs = sorted(
                    tag
                    for tag, sel in self.store.tags().items()
                    if self.store.has_space(sel)
                    and self.store.manifest(sel).get("kind") in (MODEL_KIND, ADAPTER_KIND)
                )
                if not refs:
                    raise ServerError(f"store {store_dir!r} holds no model version to serve")
            default_tpl = load_template(options.chat_template) if options.chat_template else None
            per_ref = {r: load_template(p) for r, p in options.chat_templates}
            for ref in refs:
                if ref in self.models:
                    raise ServerError(f"version {ref!r} named twice")
                self.models[ref] = ServedModel(
                    self.store, ref, options, per_ref.get(ref, default_tpl), self._on_step
                )
            self.gate = TokenGate(self.store, {r: m.spaces for r, m in self.models.items()})
        except BaseException:
            self.close()
            raise
        self.metrics.add_live(
            lambda: [
                (r, m.scheduler.stats(), m.engine.stats()) for r, m in list(self.models.items())
            ]
        )

    def _on_step(self, ref: str, n_seqs: int, n_tokens: int, seconds: float) -> None:
        self.metrics.batch.labels(ref).observe(n_seqs)
        self.metrics.step_seconds.labels(ref).observe(seconds)

    def close(self) -> None:
        """Close every model, then the store (idempotent)."""
        models, self.models = self.models, {}
        for m in models.values():
            m.close()
        store, self.store = getattr(self, "store", None), None
        if store is not None:
            store.close()


# --------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class GenRequest:
    """A validated generation request."""

    model: str
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    end_user: str | None = None  # OpenAI's ``user``: who the caller serves (audited)
    speculate: SpeculateOptions | None = None  # None: the server's default
    draft_tokens: int | None = None  # the request's own draft_tokens (None: the server's)


def _number(body: dict, key: str, kind: type, default, lo=None, hi=None):
    v = body.get(key, default)
    if v is None:
        return default
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, kind) or isinstance(v, bool):
        raise _bad(f"{key} must be {'an integer' if kind is int else 'a number'}", key)
    if kind is float and not math.isfinite(v):  # (JSON as Python reads it has NaN, Infinity)
        raise _bad(f"{key} must be a finite number", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _bad(f"{key} = {v} is out of range [{lo}, {hi}]", key)
    return v


#: Request keys of the OpenAI API and of other servers (vLLM, llama.cpp) that would change
#: the output and are not implemented here, each with the values that change nothing.
_UNSUPPORTED_CONTROLS: dict[str, tuple[Any, ...]] = {
    "response_format": ({"type": "text"},),
    "tool_choice": ("none", "auto"),
    "repetition_penalty": (1, 1.0),
    "repeat_penalty": (1, 1.0),
    "min_p": (0, 0.0),
    "typical_p": (1, 1.0),
    "grammar": ("",),
    "json_schema": ({},),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
}


def _parse_common(body: dict, default_max: int, max_keys: tuple[str, ...]) -> GenRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model is required: the version's tag NAME@VER", "model")
    n = _number(body, "n", int, 1)
    if n != 1:
        raise _bad("only n=1 is supported", "n")
    if _number(body, "best_of", int, 1) != 1:
        raise _bad("only best_of=1 is supported", "best_of")
    for key in ("logprobs", "top_logprobs", "tools", "functions", "logit_bias", "suffix"):
        v = body.get(key)
        if v not in (None, False, {}, []):
            raise _bad(f"{key} is not supported by this server", key)
    if body.get("echo"):
        raise _bad("echo is not supported by this server", "echo")
    # Other servers' sampling and output controls this one does not implement: refused
    # when set to anything but their no-op, never silently ignored.
    for key, noop in _UNSUPPORTED_CONTROLS.items():
        v = body.get(key)
        if v is not None and v not in noop:
            raise _bad(f"{key} is not supported by this server", key)
    max_tokens = None
    for key in max_keys:
        if body.get(key) is not None:
            max_tokens = _number(body, key, int, None, 1)
            break
    if max_tokens is None:
        max_tokens = default_max
    temperature = _number(body, "temperature", float, 1.0, 0.0, 2.0)
    # (vLLM's and llama.cpp's extension; -1 and 0: no cut)
    top_k = max(_number(body, "top_k", int, 0, -1), 0)
    top_p = _number(body, "top_p", float, 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise _bad("top_p must be above 0", "top_p")
    seed = _number(body, "seed", int, None, 0)
    # OpenAI's range; the sampler lowers the logits of the tokens chosen so far.
    presence = _number(body, "presence_penalty", float, 0.0, -2.0, 2.0)
    frequency = _number(body, "frequency_penalty", float, 0.0, -2.0, 2.0)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise _bad("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS or any(not s for s in stops):
        raise _bad(f"stop: at most {MAX_STOPS} non-empty strings", "stop")
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_END_USER):
        raise _bad(f"user must be a string of at most {MAX_END_USER} characters", "user")
    speculate = None
    mode, n_draft = body.get("speculate"), body.get("draft_tokens")
    if mode is not None or n_draft is not None:
        # czyx's extension: "off" or "lookup" (prompt lookup), up to draft_tokens per step.
        if mode is not None and mode not in ("off", "lookup"):
            raise _bad("speculate must be 'off' or 'lookup'", "speculate")
        n_draft = _number(body, "draft_tokens", int, None, 1, 32)
        k = SPECULATE_OFF.draft_tokens if n_draft is None else n_draft
        speculate = SpeculateOptions(mode or "lookup", draft_tokens=k)
    stream = bool(body.get("stream", False))
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise _bad("stream_options must be an object", "stream_options")
    try:
        sampling = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            presence_penalty=presence,
            frequency_penalty=frequency,
        )
    except SamplingError as exc:
        raise _bad(str(exc)) from None
    return GenRequest(
        model=model,
        max_tokens=int(max_tokens),
        sampling=sampling,
        stop=stops,
        stream=stream,
        include_usage=bool(opts.get("include_usage", False)),
        end_user=user or None,
        speculate=speculate,
        draft_tokens=n_draft,
    )


def _completion_prompt(body: dict, served: ServedModel) -> list[int]:
    prompt = body.get("prompt")
    vocab = served.engine.cfg.vocab_size
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = served.tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        ids = list(prompt)
        if any(not 0 <= t < vocab for t in ids):
            raise _bad(f"prompt token ids must be in 0..{vocab - 1}", "prompt")
    else:
        raise _bad(
            "prompt must be a string, a list of token ids, or a list of one of those", "prompt"
        )
    if not ids:
        raise _bad("the prompt is empty", "prompt")
    return ids


def _chat_prompt(body: dict, served: ServedModel) -> list[int]:
    ids = served.tokenizer.encode(chat_text(body, served))
    if not ids:
        raise _bad("the rendered chat prompt is empty", "messages")
    return ids


def chat_text(body: dict, served: ServedModel) -> str:
    """The prompt text a chat request's ``messages`` render to with the version's chat
    template (what ``/v1/chat/completions`` encodes); :class:`ApiError` 400 as it answers."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages must be a non-empty list", "messages")
    plain = []
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad("each message needs a role", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise _bad("only text content parts are supported", "messages")
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        if content is not None and not isinstance(content, str):
            raise _bad("message content must be text", "messages")
        plain.append({"role": m["role"], "content": content or ""})
    if served.template is None:
        raise _bad(
            f"model {served.ref} has no chat template (its checkpoint was mounted with "
            "neither a chat_template.jinja nor a tokenizer_config.json chat_template; serve "
            "it with --chat-template FILE); use /v1/completions",
            "model",
        )
    try:
        return served.template.render(plain, add_generation_prompt=True)
    except TemplateError as exc:
        raise _bad(str(exc), "messages") from None


# --------------------------------------------------------------------------- generation


@dataclass
class _Outcome:
    text: str = ""
    finish: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    error_status: int = 500
    cached_tokens: int = 0  # positions restored from a session or reused from the prefix cache
    session_version: int | None = None  # the version this request saved
    end_user: str | None = None  # the request's OpenAI ``user``


@dataclass
class _Session:
    """A request's ``X-Czyx-Session``: the handle, the head it read, and what it restores."""

    name: str
    sessions: Any  # inference.sessions.SessionStore
    head: int
    model: bytes
    history: tuple[list[int], Any] | None  # (tokens, KVCache) of the head, or None (new)


_BYTES = [bytes((i,)) for i in range(256)]


class _TextStream:
    """Token ids -> text pieces, ending before the first stop string.

    Incremental detokenization over a short window (the last emitted token
    as context, then the new ones): each piece is the text the new tokens
    add to that context, so a tokenizer's leading-space and byte-fallback
    rules apply as in a full decode, at a cost per token that does not grow
    with the output. A piece ending in an incomplete UTF-8 sequence waits
    for its next token. Text that could be the start of a stop string is
    held back until it cannot be (or the generation ends).

    A byte tokenizer's ids are UTF-8 bytes with no context rules: they go
    through an incremental UTF-8 decoder instead (the same text as a full
    decode, ``errors="replace"``, without two decodes per token).
    """

    def __init__(self, tokenizer, stops: tuple[str, ...], eos: frozenset[int]) -> None:
        self.tok = tokenizer
        self._utf8 = (
            codecs.getincrementaldecoder("utf-8")("replace")
            if type(tokenizer) is ByteTokenizer
            else None
        )
        self.ids: list[int] = []
        self.prefix = 0  # start of the context window
        self.read = 0  # tokens already turned into text
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.eos = eos
        self.text = ""
        self.sent = 0
        self.stopped = False

    def _decode_new(self, final: bool) -> str:
        before = self.tok.decode(self.ids[self.prefix : self.read])
        after = self.tok.decode(self.ids[self.prefix :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def push(self, tok: int) -> str:
        if tok in self.eos:
            return ""
        if self._utf8 is not None:
            if 0 <= tok < 256:  # (ids above are specials: never text)
                self.text += self._utf8.decode(_BYTES[tok])
        else:
            self.ids.append(tok)
            self.text += self._decode_new(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        if not self.stopped:
            if self._utf8 is not None:
                self.text += self._utf8.decode(b"", final=True)
            else:
                self.text += self._decode_new(final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        if self.stops:
            lo = max(self.sent - self.hold, 0)
            hits = [i for s in self.stops if (i := self.text.find(s, lo)) >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                final = True
        end = len(self.text) if final else max(len(self.text) - self.hold, self.sent)
        piece = self.text[self.sent : end]
        self.sent = end
        return piece


class _ClientGone(Exception):
    """The client disconnected (raised by :meth:`_Channel.take` once it is known)."""


class _Channel:
    """One request's events, handed from the scheduler's thread to the event loop.

    The consumer takes every event that arrived since its last wait at once
    (:meth:`take`), so a loop that falls behind handles several tokens in one
    wake-up (and one write). A wait costs one future: its timeout is a
    deadline the channel's single timer checks when it fires (re-armed then,
    only while a wait is pending), not a timer armed and cancelled per token.
    :meth:`fail` ends the current or next wait with an error at once (the
    request's one disconnect watcher uses it), so no per-token watch is needed.
    """

    __slots__ = ("_deadline", "_error", "_items", "_loop", "_timer", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: list[Any] = []
        self._waiter: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0
        self._error: BaseException | None = None

    def _deliver(self, evs: list[Any]) -> None:  # on the loop
        self._items.extend(evs)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def put(self, ev: Any) -> None:
        """One event, on the loop (a driven scheduler's ``on_event``)."""
        self._items.append(ev)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def fail(self, exc: BaseException) -> None:
        """End the pending wait (or the next one) with ``exc`` (on the loop)."""
        self._error = exc
        w = self._waiter
        if w is not None and not w.done():
            w.set_exception(exc)

    def _check(self) -> None:  # on the loop: the timer fired
        self._timer = None
        w = self._waiter
        if w is None or w.done():
            return  # no wait pending: the next wait re-arms
        if self._loop.time() >= self._deadline:
            w.set_exception(TimeoutError())
        else:
            self._timer = self._loop.call_at(self._deadline, self._check)

    async def take(self, timeout: float) -> list[Any]:
        """Every event not yet taken (at least one); TimeoutError after ``timeout`` s,
        the :meth:`fail` error once there is one."""
        if self._error is not None:
            raise self._error
        if not self._items:
            w = self._waiter = self._loop.create_future()
            self._deadline = self._loop.time() + timeout
            timer = self._timer
            if timer is None or timer.when() > self._deadline:  # (a shorter timeout)
                if timer is not None:
                    timer.cancel()
                self._timer = self._loop.call_at(self._deadline, self._check)
            try:
                await w
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items

    def ready(self) -> bool:
        """Whether :meth:`take` would return at once (events or an error wait)."""
        return bool(self._items) or self._error is not None

    def close(self) -> None:
        """Drop the timer (the request is over)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _Dispatcher:
    """Hands scheduler events from a scheduler's own thread (``scheduler_thread``, or a
    ``ServeOptions.scheduler``) to the event loop: one loop wake-up per burst, not per event.

    The scheduler's thread emits one event per sequence per step; waking the
    loop for each would hand the GIL back and forth that many times a step.
    Events queue here and a single drain callback delivers all that arrived
    before it ran, grouped by request.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pending: list[tuple[_Channel, Any]] = []
        self._scheduled = False
        self._lock = threading.Lock()

    def post(self, ch: _Channel, ev: Any) -> None:
        with self._lock:
            self._pending.append((ch, ev))
            if self._scheduled:
                return
            self._scheduled = True
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items, self._pending = self._pending, []
            self._scheduled = False
        by: dict[_Channel, list[Any]] = {}
        for ch, ev in items:
            by.setdefault(ch, []).append(ev)
        for ch, evs in by.items():
            ch._deliver(evs)


_DISPATCHERS: dict[int, _Dispatcher] = {}


def _dispatcher(loop: asyncio.AbstractEventLoop) -> _Dispatcher:
    d = _DISPATCHERS.get(id(loop))
    if d is None or d.loop is not loop:
        d = _DISPATCHERS[id(loop)] = _Dispatcher(loop)
    return d


_log = logging.getLogger("czyx.server")


class _LoopDriver:
    """Steps one driven :class:`~czyx.inference.batch.Scheduler` on the event loop.

    One task per served version: it calls ``step_once`` while there is work,
    yielding to the loop after every step (``asyncio.sleep(0)``: the loop then
    runs its I/O and every callback that step made ready, so the requests write
    their tokens, new requests are read and disconnects are seen before the next
    step), and waits on a loop-local event when idle; the scheduler's
    ``on_wake`` (a submit, a cancel, a close) sets it. The task starts with the
    first request on a loop (so an app serves on whichever loop runs it) and
    :meth:`stop` ends it at the app's shutdown.
    """

    def __init__(self, ref: str) -> None:
        self.ref = ref
        self.scheduler: Scheduler | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tid = 0
        self._event: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def wake(self) -> None:
        """The scheduler may have work (its ``on_wake``; from any thread)."""
        ev = self._event
        if ev is None:
            return  # not started: the task looks for work when it starts
        if threading.get_ident() == self._tid:
            ev.set()
            return
        loop = self._loop
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to wake
            loop.call_soon_threadsafe(ev.set)

    def ensure(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the stepping task on ``loop`` (the running one) unless it runs there."""
        task = self._task
        if task is not None and not task.done() and self._loop is loop:
            return
        self._loop = loop
        self._tid = threading.get_ident()
        self._event = asyncio.Event()
        self._task = loop.create_task(self._drive(), name=f"czyx-steps-{self.ref}")

    async def _drive(self) -> None:
        sched, ev = self.scheduler, self._event
        step, sleep = sched.step_once, asyncio.sleep
        while not sched.closed:
            ev.clear()  # before looking for work: a wake from here on is not lost
            try:
                while step():
                    await sleep(0)
            except Exception:  # a bug, not a request's error (the step fails those closed)
                _log.exception("%s: a scheduler step failed", self.ref)
                await sleep(0.05)
                continue
            if not sched.closed:
                await ev.wait()

    async def stop(self, timeout: float = 30.0) -> None:
        """Close the scheduler (every pending request ends) and end the task (on the loop)."""
        self.scheduler.close()  # on the loop, between steps: the driven close ends them now
        task, self._task = self._task, None
        if task is None or task.done():
            return
        try:
            await asyncio.wait_for(task, timeout)  # (cancelled if it does not end in time)
        except TimeoutError:
            _log.error("%s: the stepping task did not stop within %s s", self.ref, timeout)


class _Job:
    """One generation request on the event loop: submitted to its scheduler, its events
    taken in bursts from a :class:`_Channel`, turned into text pieces.

    The serving path per token is this object's :meth:`burst`, no chain of async
    generators: one wake-up per burst of events (a driven scheduler's step on the loop,
    or the dispatcher's from a scheduler's thread), one future per wait, the latency
    histograms fed in bulk.
    """

    def __init__(
        self,
        state: ServerState,
        served: ServedModel,
        ids: list[int],
        req: GenRequest,
        eos: tuple[int, ...],
        t0: float,
        session: _Session | None,
        allowed: np.ndarray | None,
        watch: bool = False,
    ) -> None:
        self.state = state
        self.served = served
        self.ids = ids
        self.req = req
        self.eos = eos
        self.session = session
        self.allowed = allowed
        self.out = _Outcome(prompt_tokens=len(ids), end_user=req.end_user)
        self.stream = _TextStream(served.tokenizer, req.stop, frozenset(eos))
        self.timeout = state.options.event_timeout
        self.loop = asyncio.get_running_loop()
        self.ch = _Channel(self.loop)
        self.handle = None
        self.final = None
        self.done = False
        self._last = t0
        self._texts: list[str] = []
        #: Watching: the route frames taken with the last burst (oldest first).
        self.watch = watch
        self.frames: list[RouteFrame] = []
        self._ttft = state.metrics.ttft.labels(served.ref)
        self._itl = state.metrics.itl.labels(served.ref)

    def submit(self) -> None:
        """Queue the request.

        Raises :class:`ApiError` 429 when the queue is full, 400 when the context
        exceeds the KV budget or the scheduler refuses the request.
        """
        driver = self.served.driver
        if driver is not None:  # stepped on this loop: events come on this thread
            driver.ensure(self.loop)
            on_event = self.ch.put
        else:
            post = _dispatcher(self.loop).post
            ch = self.ch

            def on_event(ev) -> None:  # on the scheduler's thread
                post(ch, ev)

        session = self.session
        # (only a watching request names watch: a scheduler of another kind never sees it)
        extra = {"watch": True} if self.watch else {}
        spec = self.req.speculate
        if spec is not None:
            if isinstance(self.served.scheduler, Scheduler):
                if self.req.draft_tokens is None:  # the server's --draft-tokens
                    own = self.served.scheduler.options.speculate
                    spec = replace(spec, draft_tokens=own.draft_tokens)
                extra["speculate"] = spec
            elif spec.enabled:  # (a version placed over Ray steps without drafts)
                raise _bad(f"speculate: {self.served.ref} is not served locally", "speculate")
        try:
            self.handle = self.served.scheduler.submit(
                self.ids,
                self.req.max_tokens,
                self.req.sampling,
                self.eos,
                on_event,
                history=None if session is None else session.history,
                keep_state=session is not None,
                allowed=self.allowed,
                **extra,
            )
        except QueueFull as exc:
            raise ApiError(
                429,
                f"server busy: {exc}",
                "rate_limit_error",
                "rate_limit_exceeded",
                headers={"Retry-After": str(self.state.options.retry_after)},
            ) from None
        except RequestTooLarge as exc:
            raise _bad(str(exc), "max_tokens") from None
        except ValueError as exc:
            raise _bad(str(exc)) from None

    async def burst(self) -> list[str]:
        """The text pieces of every event that arrived since the last call (waits for at
        least one event): one piece per token that released text, in order, and once the
        generation ended (:attr:`done`) the text the stream held back.

        Raises :class:`ApiError` 504 when no event comes within the event timeout, and
        :class:`_ClientGone` once the client disconnected.
        """
        try:
            evs = await self.ch.take(self.timeout)
        except TimeoutError:
            raise ApiError(504, f"no token in {self.timeout} s", "server_error") from None
        out, stream = self.out, self.stream
        pieces: list[str] = []
        gaps: list[float] = []
        last = self._last
        for ev in evs:
            if type(ev) is Token:
                # The scheduler's clock: when the token was chosen, not handed over.
                if out.completion_tokens == 0:
                    self._ttft.observe(ev.time - last)
                else:
                    gaps.append(ev.time - last)
                last = ev.time
                out.completion_tokens += 1
                piece = stream.push(ev.token)
                if piece:
                    pieces.append(piece)
                if stream.stopped:
                    out.finish = "stop"
                    self._end()
                    break
            elif type(ev) is RouteFrame:  # (only a watching request's scheduler sends these)
                self.frames.append(ev)
            else:
                if ev.reason == "error":
                    out.error = ev.error
                out.finish = "stop" if ev.reason in ("stop", "cancelled") else "length"
                out.cached_tokens = ev.restored + ev.reused
                self.final = ev.final
                self._end()
                break
        self._last = last
        if gaps:
            self._itl.observe_many(gaps)
        if self.done:
            rest = stream.finish()
            if rest:
                pieces.append(rest)
        self._texts.extend(pieces)
        return pieces

    def _end(self) -> None:
        self.done = True
        self.close()  # a stop string: the sequence may still run

    async def finish(self) -> _Outcome:
        """The outcome, once :attr:`done`: the text, and with a session, the finished
        state saved as its next version."""
        out = self.out
        out.text = "".join(self._texts)
        session, final = self.session, self.final
        if session is not None and final is not None and out.error is None:
            self.final = None
            try:
                out.session_version = await run_in_threadpool(_save_session, session, final)
            except CzyxError as exc:
                out.error = f"session {session.name!r} not saved: {exc}"
                out.error_status = 409 if "Conflict" in type(exc).__name__ else 500
        return out

    def client_gone(self) -> None:
        """The client disconnected: free the sequence now and end the pending wait."""
        if self.handle is not None:
            self.handle.cancel()
        self.ch.fail(_ClientGone())

    def close(self) -> None:
        """Cancel the sequence (a no-op once it finished) and drop the channel's timer."""
        self.ch.close()
        if self.handle is not None:
            self.handle.cancel()


async def _watch_disconnect(receive, job: _Job) -> None:
    """The request's one disconnect watcher: tells ``job`` when the client goes away."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            job.client_gone()
            return


def _usage(out: _Outcome) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
    }
    if out.cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": out.cached_tokens}
    return usage


def _watch_requested(request: Request) -> bool:
    """Whether a request asks for its routing (``X-Czyx-Watch: routes``); 400 for another
    value (never silently ignored)."""
    value = request.headers.get(WATCH_HEADER)
    if value is None:
        return False
    if value.strip().lower() != WATCH_ROUTES:
        raise _bad(f"X-Czyx-Watch: {value!r}: the only value is {WATCH_ROUTES!r}", WATCH_HEADER)
    return True


def route_frame_json(frame: RouteFrame, tokenizer) -> dict[str, Any]:
    """A :class:`~czyx.inference.routewatch.RouteFrame` as the ``czyx.routes`` event's data.

    ``index`` (the generated token fed, 0 first), ``token`` and its ``text``; per
    routed layer (``layers``) the ``experts`` chosen in the router's order, their
    ``weights`` and ``state`` (0 hit, 1 prefetched, 2 miss, as the cache stood when
    the layer routed), and ``resident``: the experts the cache held then, as a hex
    bitmask (bit ``e`` of byte ``e // 8``, least significant first); ``step``: the
    step's sequences, tokens, bytes read, hits, misses and seconds (shared by the batch).
    """
    return {
        "index": frame.index,
        "token": frame.token,
        "text": tokenizer.decode([frame.token]),
        "layers": frame.layers.tolist(),
        "experts": frame.experts.tolist(),
        "weights": np.round(frame.weights.astype(np.float64), 4).tolist(),
        "state": frame.state.tolist(),
        "resident": [np.packbits(r, bitorder="little").tobytes().hex() for r in frame.resident],
        "step": {
            "sequences": frame.step_sequences,
            "tokens": frame.step_tokens,
            "bytes_read": frame.bytes_read,
            "hits": frame.hits,
            "misses": frame.misses,
            "seconds": round(frame.seconds, 6),
        },
    }


def _session_name(request: Request) -> str | None:
    """The session a request names in its ``X-Czyx-Session`` header, or None.

    Only the header names one: OpenAI's ``user`` field identifies the end user a
    client serves (any string, several conversations each), so taking it as a
    session would resume one user's unrelated requests into each other's context.
    """
    return request.headers.get(SESSION_HEADER) or None


def _open_session(store, tenant: str, name: str, served: ServedModel) -> _Session:
    """The caller's session ``name`` (its head restored as a KV cache), or a new one.

    The server acts for the caller's tenant through the store owner's portal
    (a tenant's grant names the model's spaces, not the session spaces its
    saves create); tenant isolation is the session store's own check.

    Raises :class:`ApiError`: 400 for a bad name or a state of another model
    version, 403 for another tenant's session.
    """
    from czyx.inference.sessions import errors as serr
    from czyx.inference.sessions.live import restore_cache
    from czyx.inference.sessions.store import SessionStore, check_name
    from czyx.portals.errors import PortalDenied

    try:
        check_name(name)
        from czyx.portals import root_token

        sessions = SessionStore(store, root_token(store), tenant=tenant)
        model = bytes(served.consumer.info.selector)
        versions = sessions.versions(name)
        if not versions:
            return _Session(name, sessions, 0, model, None)
        head = versions[-1][0]
        parsed = sessions.read(name, head, model=model)
        rows = parsed.rows
        kv = restore_cache(served.engine.model, parsed, rows, rows)  # KV and recurrent state
        return _Session(name, sessions, head, model, ([int(t) for t in parsed.tokens[:rows]], kv))
    except (serr.WrongTenantError, PortalDenied) as exc:
        raise ApiError(
            403, f"session {name!r}: {exc}", "permission_error", "session_denied", "X-Czyx-Session"
        ) from None
    except (serr.SessionError, ValueError) as exc:
        raise _bad(f"session {name!r}: {exc}", "X-Czyx-Session") from None


def _save_session(session: _Session, final) -> int:
    """Save a finished sequence as the session's next version; returns the version."""
    from dataclasses import asdict

    from czyx.inference.sessions.format import SessionState
    from czyx.inference.sessions.live import recurrent_of

    kv = final.kv
    n = kv.length
    state = SessionState(
        model=session.model,
        tenant=session.sessions.tenant,
        tokens=np.asarray(final.tokens, np.int32),
        k=tuple(a[:, :n] for a in kv.k),
        v=tuple(a[:, :n] for a in kv.v),
        logits=np.asarray(final.logits, np.float32),
        sampling=asdict(final.sampler.params),
        rng_state=final.sampler.rng.bit_generator.state,
        capacity=kv.capacity,
        recurrent=recurrent_of(kv),  # a hybrid model's linear-attention state
    )
    info = session.sessions.save(session.name, state, expect_version=session.head)
    return int(info.version)


class _Api:
    """The route handlers, bound to one :class:`ServerState`."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    # -- helpers -------------------------------------------------------------

    def _caller(self, request: Request) -> Caller:
        try:
            return self.state.gate.authenticate(request.headers.get("authorization"))
        except AuthError as exc:
            typ = "authentication_error" if exc.status == 401 else "permission_error"
            raise ApiError(exc.status, str(exc), typ, exc.code) from None

    def _served(self, caller: Caller, model: str) -> tuple[ServedModel, np.ndarray | None]:
        """The served version and the experts the caller may route to (None: all)."""
        served = self.state.models.get(model)
        if served is None:
            raise ApiError(
                404,
                f"model {model!r} is not served here",
                "invalid_request_error",
                "model_not_found",
                "model",
            )
        try:
            self.state.gate.authorize(caller, model)
            mask = self.state.gate.routing_mask(caller, model)
        except AuthError as exc:
            raise ApiError(exc.status, str(exc), "permission_error", exc.code, "model") from None
        if mask is not None:
            cfg = served.engine.cfg
            counts = mask[: cfg.n_layers, : cfg.n_experts].sum(axis=1)
            for i, sparse in enumerate(cfg.sparse_layers):
                if sparse and counts[i] < cfg.top_k:
                    raise ApiError(
                        403,
                        f"portal leaves layer {i} of {model} with {int(counts[i])} expert(s), "
                        f"fewer than the top-{cfg.top_k} routing needs",
                        "permission_error",
                        "permission_denied",
                        "model",
                    )
            mask = np.ascontiguousarray(mask[: cfg.n_layers, : cfg.n_experts])
        return served, mask

    async def _audit(
        self,
        caller: Caller | None,
        endpoint: str,
        model: str | None,
        status: int,
        out: _Outcome | None,
    ) -> None:
        tenant = caller.tenant if caller else "unknown"
        self.state.metrics.requests.labels(tenant, model or "", endpoint, str(status)).inc()
        if out is not None and model:
            self.state.metrics.prompt_tokens.labels(tenant, model).inc(out.prompt_tokens)
            self.state.metrics.completion_tokens.labels(tenant, model).inc(out.completion_tokens)
        if not self.state.options.audit or caller is None:
            return  # refusals before a caller is known were audited by the gate
        fields = {
            "portal": caller.portal_id,
            "tenant": caller.tenant,
            "version": model,
            "endpoint": endpoint,
            "status": status,
        }
        if out is not None:
            fields.update(
                prompt_tokens=out.prompt_tokens,
                completion_tokens=out.completion_tokens,
                finish_reason=out.finish,
                end_user=out.end_user,
            )
        fields = {k: v for k, v in fields.items() if v is not None}
        store = self.state.store
        if store is not None:
            await run_in_threadpool(store.audit, "serve.request", **fields)

    # -- routes --------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "models": list(self.state.models)})

    async def metrics(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        data = await run_in_threadpool(generate_latest, self.state.metrics.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    def _model_object(self, ref: str) -> dict[str, Any]:
        created = self.state.models[ref].created
        return {"id": ref, "object": "model", "created": created, "owned_by": "czyx"}

    async def models(self, request: Request) -> Response:
        caller = None
        try:
            caller = self._caller(request)
            data = [self._model_object(ref) for ref in self.state.gate.visible(caller)]
            await self._audit(caller, "models", None, 200, None)
            return JSONResponse({"object": "list", "data": data})
        except ApiError as exc:
            await self._audit(caller, "models", None, exc.status, None)
            return exc.response()

    async def model(self, request: Request) -> Response:
        """One model (OpenAI's retrieve): a version the caller's portal cannot see answers
        404 as one not served, so a portal learns nothing of versions outside it."""
        caller, ref = None, request.path_params["model"]
        try:
            caller = self._caller(request)
            if ref not in self.state.gate.visible(caller):
                raise ApiError(
                    404,
                    f"model {ref!r} is not served here",
                    "invalid_request_error",
                    "model_not_found",
                    "model",
                )
            await self._audit(caller, "models", ref, 200, None)
            return JSONResponse(self._model_object(ref))
        except ApiError as exc:
            await self._audit(caller, "models", None, exc.status, None)
            return exc.response()

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        endpoint = "chat.completions" if chat else "completions"
        caller: Caller | None = None
        model: str | None = None
        try:
            caller = self._caller(request)
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise _bad("the request body is not JSON") from None
            if not isinstance(body, dict):
                raise _bad("the request body must be a JSON object")
            default_max = self.state.options.default_max_tokens if chat else 16
            keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
            req = _parse_common(body, default_max, keys)
            model = req.model
            served, allowed = self._served(caller, req.model)
            ids = _chat_prompt(body, served) if chat else _completion_prompt(body, served)
            watch = _watch_requested(request)
            if watch and not req.stream:
                raise _bad("X-Czyx-Watch needs a streamed request (stream: true)", "stream")
            if watch and not isinstance(served.scheduler, Scheduler):
                raise _bad(
                    f"{served.ref}: its scheduler does not report routing (X-Czyx-Watch)",
                    WATCH_HEADER,
                )
            session = None
            name = _session_name(request)
            if name:
                session = await run_in_threadpool(
                    _open_session, self.state.store, caller.tenant, name, served
                )
        except ApiError as exc:
            await self._audit(caller, endpoint, model, exc.status, None)
            return exc.response()
        eos = served.chat_eos_ids if chat else served.eos_ids
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        job = _Job(self.state, served, ids, req, eos, time.perf_counter(), session, allowed, watch)
        try:
            job.submit()  # a full queue (429) or a refused request (400) answers at once
        except ApiError as exc:
            await self._audit(caller, endpoint, model, exc.status, None)
            return exc.response()
        if req.stream:
            return _SSEResponse(self, job, rid, chat, caller, endpoint)
        out = job.out
        watcher = asyncio.ensure_future(_watch_disconnect(request.receive, job))
        try:
            while not job.done:
                await job.burst()
            await job.finish()
        except (ApiError, _ClientGone) as exc:
            err = exc if isinstance(exc, ApiError) else _gone()
            await self._audit(caller, endpoint, model, err.status, out)
            return err.response()
        finally:
            watcher.cancel()
            job.close()
        if out.error is not None:
            err = ApiError(out.error_status, f"generation failed: {out.error}", "server_error")
            await self._audit(caller, endpoint, model, out.error_status, out)
            return err.response()
        await self._audit(caller, endpoint, model, 200, out)
        created = int(time.time())
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": None,
                "finish_reason": out.finish,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish}
            obj = "text_completion"
        headers = {}
        if out.session_version is not None:
            headers[SESSION_VERSION_HEADER] = str(out.session_version)
        return JSONResponse(
            {
                "id": rid,
                "object": obj,
                "created": created,
                "model": req.model,
                "choices": [choice],
                "usage": _usage(out),
            },
            headers=headers,
        )


def _gone() -> ApiError:
    return ApiError(499, "client disconnected", "invalid_request_error")


class _Chunks:
    """The SSE events of one stream, encoded.

    A text chunk is the same JSON every time but for its text: the rest is encoded
    once (``json.dumps`` of the template, split at a placeholder) and each text is
    escaped by the json module's own C string encoder, so a chunk is byte-identical
    to ``json.dumps`` of the whole object at a fraction of its cost.
    """

    def __init__(self, rid: str, model: str, chat: bool) -> None:
        self.rid = rid
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        mark = "\x00czyx-text\x00"
        head, tail = self.chunk(mark, None).decode().split(json.dumps(mark))
        self._head = head.encode()
        self._tail = tail.encode()

    def chunk(self, text: str | None, finish: str | None, role: bool = False) -> bytes:
        """One ``data:`` event of the stream (``text`` None: no content)."""
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return self.event(
            {
                "id": self.rid,
                "object": self.obj,
                "created": self.created,
                "model": self.model,
                "choices": [choice],
            }
        )

    @staticmethod
    def event(payload: dict[str, Any]) -> bytes:
        return f"data: {json.dumps(payload)}\n\n".encode()

    def texts(self, pieces: list[str]) -> bytes:
        """One event per piece, concatenated (equal to ``chunk(piece, None)`` each)."""
        head, tail = self._head, self._tail
        return b"".join([head + _ascii_json(p).encode() + tail for p in pieces])

    def usage(self, out: _Outcome) -> bytes:
        return self.event(
            {
                "id": self.rid,
                "object": self.obj,
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": _usage(out),
            }
        )


_BODY = "http.response.body"


class _SSEResponse(Response):
    """A streamed generation as server-sent events: one ``data:`` event per text piece,
    OpenAI's chunk objects, ending with ``data: [DONE]``.

    Every burst of events the loop takes at once is written in one send (each token
    still its own event: none waits for another), or with a ``stream_interval``, every
    token that came within the interval after the last write (the first at once). One
    task per request watches for the client's disconnect; it frees the sequence at once
    and ends the stream.
    """

    media_type = "text/event-stream"

    def __init__(
        self, api: _Api, job: _Job, rid: str, chat: bool, caller: Caller, endpoint: str
    ) -> None:
        self.api = api
        self.job = job
        self.chat = chat
        self.caller = caller
        self.endpoint = endpoint
        self.chunks = _Chunks(rid, job.req.model, chat)
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        job, chunks, out = self.job, self.chunks, self.job.out
        watcher = asyncio.ensure_future(_watch_disconnect(receive, job))
        status = 200
        held: list[str] = []  # pieces a stream interval holds back
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            if self.chat:
                role = chunks.chunk("", None, role=True)
                await send({"type": "http.response.body", "body": role, "more_body": True})
            texts, burst = chunks.texts, job.burst
            interval = self.api.state.options.stream_interval
            if job.watch:  # each burst's route frames, then its text (no stream interval)
                frames, tok = job.frames, job.served.tokenizer
                while not job.done:
                    pieces = await burst()
                    body = b"".join(
                        b"event: czyx.routes\ndata: "
                        + json.dumps(route_frame_json(f, tok)).encode()
                        + b"\n\n"
                        for f in frames
                    )
                    frames.clear()
                    if pieces:
                        body += texts(pieces)
                    if body:
                        await send({"type": _BODY, "body": body, "more_body": True})
            elif not interval:
                while not job.done:
                    pieces = await burst()
                    if pieces:
                        msg = {"type": _BODY, "body": texts(pieces), "more_body": True}
                        await send(msg)
            else:  # a token sooner than the interval after the last write waits for its end
                clock, written, sleep = job.loop.time, -interval, asyncio.sleep
                while not job.done:
                    if not held:
                        held += await burst()
                        continue
                    due = written + interval - clock()
                    if due > 0:
                        # Sleep through the interval's end (no wake-up per token), then take
                        # every token that came meanwhile.
                        await sleep(due)
                        if job.ch.ready():
                            held += await burst()
                            if job.done:
                                break
                    msg = {"type": _BODY, "body": texts(held), "more_body": True}
                    held, written = [], clock()
                    await send(msg)
            await job.finish()
            # (the pieces still held go with the stream's last message)
            tail, held = texts(held), []
            if out.error is not None:
                status = out.error_status
                err = ApiError(status, f"generation failed: {out.error}", "server_error")
                end = tail + chunks.event(err.body()) + b"data: [DONE]\n\n"
            else:
                last = chunks.chunk(None if self.chat else "", out.finish)
                if out.session_version is not None:  # the version this stream saved
                    obj_last = json.loads(last[6:])
                    obj_last["czyx_session_version"] = out.session_version
                    last = chunks.event(obj_last)
                end = tail + last
                if job.req.include_usage:
                    end += chunks.usage(out)
                end += b"data: [DONE]\n\n"
            await send({"type": "http.response.body", "body": end, "more_body": False})
        except ApiError as exc:
            status = exc.status
            body = chunks.texts(held) + chunks.event(exc.body())
            await send({"type": "http.response.body", "body": body, "more_body": False})
        except _ClientGone:
            pass
        finally:
            watcher.cancel()
            job.close()  # on disconnect too: frees the sequence
            if out.finish is None and status == 200:
                status = 499  # the client went away before the end
            model = job.req.model
            await asyncio.shield(self.api._audit(self.caller, self.endpoint, model, status, out))


# --------------------------------------------------------------------------- factory


def create_app(
    store_dir: str,
    refs: Sequence[str] = (),
    options: ServeOptions | None = None,
    *,
    extra_routes: Sequence[BaseRoute] = (),
) -> Starlette:
    """An ASGI app serving model versions of a store through the OpenAI API.

    Parameters
    ----------
    store_dir
        The store directory.
    refs
        Version tags ``NAME@VER`` to serve; empty: every model version in the store.
    options
        :class:`ServeOptions`.
    extra_routes
        More Starlette routes mounted beside the API (replication, for one).

    Returns
    -------
    Starlette
        Engines and schedulers are built now (a bad version or option fails
        here, not at the first request) and closed at the app's shutdown
        (lifespan) or by ``app.state.czyx.close()``. Serve it on 127.0.0.1
        with uvicorn.
    """

    state = ServerState(store_dir, list(refs), options or ServeOptions())
    api = _Api(state)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            try:
                for m in list(state.models.values()):
                    if m.driver is not None:
                        await m.driver.stop()
            finally:
                await run_in_threadpool(state.close)

    from czyx.server.playground import Playground

    routes: list[BaseRoute] = [
        *Playground(api).routes(),  # the web page at / and its endpoints under /v1/czyx
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        *extra_routes,
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        return ApiError(404, f"no route {request.url.path}", code="not_found").response()

    async def internal(request: Request, exc: Exception) -> Response:
        # Still the OpenAI shape; the exception's type and text, never a traceback.
        msg = f"internal error: {type(exc).__name__}: {exc}"
        return ApiError(500, msg, "server_error").response()

    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={404: not_found, Exception: internal},
    )
    app.state.czyx = state
    return app
