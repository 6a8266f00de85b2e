"""A Hugging Face repository id resolved to its snapshot in the local hub cache.

Scope: where ``huggingface-cli download ORG/NAME`` (or ``from_pretrained``) put a
repository on this machine, so ``czyx mount ORG/NAME`` mounts it as transformers
would load it offline. Pure path logic over the cache's documented layout
(``models--ORG--NAME/refs/REVISION`` holding a commit hash,
``snapshots/COMMIT/`` the files): nothing is downloaded, no network is touched.
The cache root follows the hub's environment variables in their order of
precedence: ``HF_HUB_CACHE``, ``HUGGINGFACE_HUB_CACHE``, ``HF_HOME``/hub,
``XDG_CACHE_HOME``/huggingface/hub, then ``~/.cache/huggingface/hub``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from czyx.store.models.mount_errors import CheckpointError

#: ``ORG/NAME`` as the hub spells model repository ids.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def hub_cache_dir() -> Path:
    """The hub cache root this environment names (it need not exist)."""
    env = os.environ
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return Path(env[var]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def looks_like_repo_id(text: str) -> bool:
    """Whether ``text`` could name a hub repository (``ORG/NAME``), not a path."""
    return bool(_REPO_ID.match(text)) and ".." not in text


def snapshot_dir(repo_id: str, revision: str = "main", cache: Path | None = None) -> Path:
    """The cached snapshot of model repository ``repo_id`` at ``revision``.

    Parameters
    ----------
    repo_id
        ``ORG/NAME``.
    revision
        A branch or tag the cache has a ref for, or a 40-hex commit it holds.
    cache
        The hub cache root (default: :func:`hub_cache_dir`).

    Raises
    ------
    CheckpointError
        Not a repository id, or the cache holds no snapshot of it at ``revision``
        (the message says where it looked and how to fetch one).
    """
    if not looks_like_repo_id(repo_id):
        raise CheckpointError(f"{repo_id!r} is not a Hugging Face repository id (ORG/NAME)")
    if not revision or revision.startswith("/") or ".." in revision.split("/"):
        raise CheckpointError(f"revision {revision!r}: not a branch, tag or commit name")
    root = (cache or hub_cache_dir()) / ("models--" + repo_id.replace("/", "--"))
    commit = revision
    if not _COMMIT.match(revision):
        ref = root / "refs" / revision
        try:
            commit = ref.read_text(encoding="ascii").strip()
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointError(
                f"{repo_id}@{revision}: not in the Hugging Face cache ({ref} not found); "
                f"fetch it first: huggingface-cli download {repo_id}"
                + ("" if revision == "main" else f" --revision {revision}")
            ) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{ref}: unreadable ({exc})") from None
        if not _COMMIT.match(commit):
            raise CheckpointError(f"{ref}: not a commit hash ({commit[:60]!r})")
    snap = root / "snapshots" / commit
    if not snap.is_dir():
        raise CheckpointError(
            f"{repo_id}@{revision}: the Hugging Face cache has no snapshot {commit} ({snap}); "
            f"fetch it first: huggingface-cli download {repo_id} --revision {commit}"
        )
    return snap
