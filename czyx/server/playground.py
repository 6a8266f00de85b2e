"""The web playground of ``czyx serve``: a single-page app at ``/`` and the endpoints it uses.

Scope: the page (``czyx/server/web``: one HTML file, one script, one style
sheet, shipped in the package: nothing from a CDN, no build step) and its JSON
endpoints. They are part of the public API and portal-checked as the OpenAI
routes are (``Authorization: Bearer <portal token>``; refusals answer 401 or
403 in the OpenAI error shape and are audited; a revoked token is refused on
its next request, and the page then signs out):

- ``GET /``: the page; ``GET /web/{app.js,app.css}``: its script and style.
- ``GET /v1/czyx/whoami``: the caller: tenant, portal id, rights, expiry, the
  served versions it may run (each with its experts, top-k, whether it has a
  chat template and whether its scheduler reports routing, ``watch``) and
  ``store_view``, whether it may see the store view.
- ``GET /v1/czyx/models/{model}/layout``: the version's expert grid: per layer
  its experts in the order of the expert space's outer curve
  (:class:`~czyx.curves.layout.ExpertLayout`), their class values, the sparse layers.
- ``POST /v1/czyx/render`` ``{"model", "messages"}``: the prompt text and its
  token count, as ``/v1/chat/completions`` renders and encodes it.
- ``GET /v1/czyx/store``: the store view, for a portal with the ``grant`` right
  over the whole store (the owner's, or one attenuated from it keeping every
  space, tenant and class): the spaces, the model versions with the extents each
  shares with other spaces, the portals (granted, expired, revoked) and the last
  :data:`AUDIT_TAIL` audit entries, newest first. Other portals get 403.

The live expert view is the chat request itself, streamed with the header
``X-Czyx-Watch: routes`` (see :mod:`czyx.server.app`): each decode token's
routing arrives as an ``event: czyx.routes`` SSE event beside the text chunks.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from czyx.inference.batch import Scheduler
from czyx.portals.caveats import GRANT
from czyx.portals.permission import Permission, Scope
from czyx.server.app import ApiError, ServedModel, ServerError, _bad, chat_text

#: The page's files (the only names ``/web/`` serves) and their media types.
WEB_DIR = Path(__file__).with_name("web")
WEB_FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
}
#: Audit entries the store view shows (the newest).
AUDIT_TAIL = 200
#: Headers of every page file: nothing but this origin's own script, style and requests.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def may_see_store(perm: Permission) -> bool:
    """Whether a portal may see the store view: the ``grant`` right over every space,
    for every tenant, with no class or layer scope (the owner's reach)."""
    return (
        GRANT in perm.rights
        and perm.spaces is None
        and perm.tenants is None
        and perm.scope == Scope()
        and not perm.space_scopes
    )


def _load_files() -> dict[str, bytes]:
    files = {}
    for name in WEB_FILES:
        path = WEB_DIR / name
        try:
            files[name] = path.read_bytes()
        except OSError as exc:
            raise ServerError(f"the playground's {path} cannot be read: {exc}") from None
    return files


def _layout(store, served: ServedModel) -> dict[str, Any]:
    """The layout endpoint's body for ``served`` (computed once per version)."""
    from czyx.store.models.expert_layout import layout_from_manifest
    from czyx.store.models.mount_errors import ModelSpaceError

    cfg = served.engine.cfg
    n_layers, n_experts = int(cfg.n_layers), int(cfg.n_experts)
    lay = None
    for sel in served.spaces.scoped:
        manifest = store.manifest(_selector(sel))
        if isinstance(manifest.get("layout"), dict):
            lay = layout_from_manifest(manifest)
            break
    if lay is not None and (lay.n_layers, lay.n_classes) != (n_layers, n_experts):
        # (opening the version refuses this already: never draw one grid as another's)
        raise ModelSpaceError(
            f"{served.ref}: its layout is {lay.n_layers} x {lay.n_classes}, "
            f"the model {n_layers} x {n_experts}"
        )
    if lay is not None:
        slots = lay.slot_table
        order = np.argsort(slots, axis=1, kind="stable")  # experts by curve slot, per layer
        classes = lay.class_array(np.arange(n_layers)[:, None], np.arange(n_experts)[None, :])
        curve = lay.outer
    else:  # (no layout recorded: the router's own order)
        order = np.tile(np.arange(n_experts), (n_layers, 1))
        classes = order
        curve = None
    return {
        "model": served.ref,
        "n_layers": n_layers,
        "n_experts": n_experts,
        "top_k": int(cfg.top_k),
        "sparse_layers": [bool(s) for s in cfg.sparse_layers],
        "curve": curve,
        "order": order.tolist(),
        "classes": np.asarray(classes).tolist(),
    }


def _selector(raw: bytes):
    from czyx.space import Selector

    return Selector(raw)


def _caveats(d: dict, names: dict[str, str]) -> str:
    parts = []
    for c in d.get("caveats", []):
        if c.get("kind") == "Spaces":
            parts.append("spaces=" + "+".join(names.get(s, s[:12]) for s in c["spaces"]))
        elif c.get("kind") == "Rights":
            parts.append("rights=" + ",".join(c["rights"]))
        elif "classes" in c:
            parts.append("classes=" + str(c["classes"]))
        elif "layers" in c:
            parts.append("layers=" + str(c["layers"]))
        elif "tenant" in c:
            parts.append("tenant=" + str(c["tenant"]))
        elif c.get("kind") == "Expires":
            continue  # (its own column)
        elif c.get("kind"):
            parts.append(str(c["kind"]).lower())
    return " ".join(parts) or "(everything)"


def store_view(store, served: list[str]) -> dict[str, Any]:
    """The store view's body: spaces, versions and what they share, portals, audit tail."""
    from czyx.portals.authority import PortalAuthority
    from czyx.store.models.mount import ADAPTER_KIND, MODEL_KIND

    tags = store.tags()
    names: dict[str, list[str]] = {}
    for tag, sel in sorted(tags.items()):
        names.setdefault(sel.hex(), []).append(tag)
    manifests = {sel.hex(): store.manifest(sel) for sel in store.spaces()}
    trunk_of: dict[str, list[str]] = {}  # a trunk space -> the tags whose version holds it
    for sel, m in manifests.items():
        if isinstance(m.get("trunk"), str):
            trunk_of.setdefault(m["trunk"], []).extend(names.get(sel, []))
    spaces = [
        {
            "selector": sel,
            "kind": m.get("kind"),
            "arch": m.get("arch"),
            "tags": names.get(sel, []),
            "trunk_of": sorted(trunk_of.get(sel, [])),
        }
        for sel, m in manifests.items()
    ]
    versions = []
    for tag, sel in sorted(tags.items()):
        m = store.manifest(sel) if store.has_space(sel) else {}
        if m.get("kind") not in (MODEL_KIND, ADAPTER_KIND):
            continue
        own = extents = 0
        shared: dict[str, int] = collections.Counter()
        for _key, rec in store.scan(sel):
            extents += 1
            if "blk" in rec:
                shared[rec["blk"]] += int(rec["len"])
            else:
                own += int(rec["len"])
        versions.append({
            "tag": tag,
            "selector": sel.hex(),
            "kind": "adapter" if m["kind"] == ADAPTER_KIND else "model",
            "arch": m.get("arch"),
            "base": m.get("base"),
            "served": tag in served,
            "extents": extents,
            "own_bytes": own,
            "shared": [
                {"space": s, "tags": names.get(s, []), "bytes": b}
                for s, b in sorted(shared.items())
            ],
        })  # fmt: skip
    short = {s: t[0] + " trunk" for s, t in trunk_of.items() if t}
    short.update({s: t[0] for s, t in names.items()})
    portals = [
        {
            "id": d.get("id"),
            "kind": d.get("kind"),
            "status": d["status"],
            "tenant": d.get("tenant"),
            "parent": d.get("parent"),
            "created": d.get("created"),
            "expires": d.get("expires"),
            "revoked": d.get("revoked"),
            "caveats": _caveats(d, short),
        }
        for d in PortalAuthority(store).descriptors()
    ]
    audit = list(collections.deque(store.audit_log(), maxlen=AUDIT_TAIL))[::-1]
    body = {"spaces": spaces, "versions": versions, "portals": portals, "audit": audit}
    # (audit fields are whatever an event recorded: anything not JSON becomes its text)
    return json.loads(json.dumps(body, default=str))


class Playground:
    """The page and its endpoints over one app's route handlers (``czyx.server.app._Api``)."""

    def __init__(self, api) -> None:
        self.api = api
        self.state = api.state
        self.files = _load_files()
        self._layouts: dict[str, dict[str, Any]] = {}

    def routes(self) -> list[BaseRoute]:
        """The playground's routes (mounted by :func:`~czyx.server.app.create_app`)."""
        return [
            Route("/", self.index, methods=["GET"]),
            Route("/web/{name}", self.file, methods=["GET"]),
            Route("/v1/czyx/whoami", self.whoami, methods=["GET"]),
            Route("/v1/czyx/models/{model:path}/layout", self.layout, methods=["GET"]),
            Route("/v1/czyx/render", self.render, methods=["POST"]),
            Route("/v1/czyx/store", self.store, methods=["GET"]),
        ]

    # -- the page ------------------------------------------------------------

    async def index(self, request: Request) -> Response:
        return Response(
            self.files["index.html"], headers=PAGE_HEADERS, media_type=WEB_FILES["index.html"]
        )

    async def file(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in WEB_FILES or name == "index.html":
            return ApiError(404, f"no file /web/{name}", code="not_found").response()
        return Response(self.files[name], headers=PAGE_HEADERS, media_type=WEB_FILES[name])

    # -- the endpoints -------------------------------------------------------

    async def _checked(self, request: Request, endpoint: str, fn) -> Response:
        """Authenticate, run ``fn(caller)`` (-> (model or None, body)), audit, answer."""
        caller = model = None
        try:
            caller = self.api._caller(request)
            model, body = await fn(caller)
        except ApiError as exc:
            await self.api._audit(caller, endpoint, model, exc.status, None)
            return exc.response()
        await self.api._audit(caller, endpoint, model, 200, None)
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    async def whoami(self, request: Request) -> Response:
        async def fn(caller):
            perm = caller.permission
            models = []
            for ref in self.state.gate.visible(caller):
                served = self.state.models[ref]
                cfg = served.engine.cfg
                models.append({
                    "id": ref,
                    "n_layers": int(cfg.n_layers),
                    "n_experts": int(cfg.n_experts),
                    "top_k": int(cfg.top_k),
                    "chat_template": served.template is not None,
                    # (a scheduler of another kind, czyx serve --ray's, reports no routing)
                    "watch": isinstance(served.scheduler, Scheduler),
                })  # fmt: skip
            return None, {
                "tenant": caller.tenant,
                "portal": caller.portal_id,
                "rights": sorted(perm.rights),
                "expires": perm.expires,
                "models": models,
                "store_view": may_see_store(perm),
            }

        return await self._checked(request, "playground.whoami", fn)

    async def layout(self, request: Request) -> Response:
        ref = request.path_params["model"]

        async def fn(caller):
            served, _ = self.api._served(caller, ref)
            body = self._layouts.get(ref)
            if body is None:
                body = await run_in_threadpool(_layout, self.state.store, served)
                self._layouts[ref] = body
            return ref, body

        return await self._checked(request, "playground.layout", fn)

    async def render(self, request: Request) -> Response:
        async def fn(caller):
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise _bad("the request body is not JSON") from None
            if not isinstance(body, dict) or not isinstance(body.get("model"), str):
                raise _bad("the body must be an object with model and messages", "model")
            served, _ = self.api._served(caller, body["model"])
            text = chat_text(body, served)
            return served.ref, {"prompt": text, "tokens": len(served.tokenizer.encode(text))}

        return await self._checked(request, "playground.render", fn)

    async def store(self, request: Request) -> Response:
        async def fn(caller):
            if not may_see_store(caller.permission):
                raise ApiError(
                    403,
                    "the store view needs a portal with the grant right over the whole store",
                    "permission_error",
                    "permission_denied",
                )
            return None, await run_in_threadpool(
                store_view, self.state.store, list(self.state.models)
            )

        return await self._checked(request, "playground.store", fn)
