"""The speculative-decoding flags ``czyx run``, ``czyx chat`` and ``czyx serve`` share,
with one default each (:class:`~czyx.inference.options.SpeculateOptions`')."""

from __future__ import annotations

import argparse

from czyx.inference.options import SPECULATE_OFF, SpeculateOptions


def add_speculate_args(p: argparse.ArgumentParser, served: bool = False) -> None:
    """``--speculate``, ``--draft-tokens``, ``--fixed-draft`` and ``--draft-cache-mb``;
    ``served``: the server's default (prompt lookup or off: ``czyx serve``, ``czyx chat``)."""
    if served:
        what = (
            "speculative decoding of a request that names none (its 'speculate' field): off "
            "(default) or lookup (drafts from the prompt and the text so far, verified in the "
            "batch's steps); greedy output is unchanged, sampled output keeps its distribution"
        )
    else:
        what = (
            "speculative decoding: off (default), lookup (drafts from the prompt and the text "
            "so far), mtp (the model's own multi-token-prediction layer: DeepSeek-V3, GLM-4.5) "
            "or draft:NAME@VER (a version of the same store, e.g. a low-bit copy of the "
            "model); greedy output is unchanged, sampled output keeps its distribution"
        )
    p.add_argument("--speculate", metavar="MODE", default=SPECULATE_OFF.mode, help=what)
    p.add_argument(
        "--draft-tokens",
        type=int,
        metavar="N",
        default=SPECULATE_OFF.draft_tokens,
        help=f"tokens drafted per step at most (default {SPECULATE_OFF.draft_tokens})",
    )
    p.add_argument(
        "--fixed-draft",
        action="store_true",
        help="always draft --draft-tokens (default: fewer, down to none, as the measured "
        "acceptance falls)",
    )
    if served:
        return
    p.add_argument(
        "--draft-cache-mb",
        type=float,
        default=SPECULATE_OFF.draft_cache_mb,
        help="draft:NAME@VER or mtp: the drafter's expert slot budget in MiB "
        "(default: the engine's default for it)",
    )


def speculate_options(args: argparse.Namespace) -> SpeculateOptions:
    """The flags as a :class:`SpeculateOptions` (ValueError with the flag's message)."""
    return SpeculateOptions(
        mode=args.speculate,
        draft_tokens=args.draft_tokens,
        adaptive=not args.fixed_draft,
        draft_cache_mb=getattr(args, "draft_cache_mb", None),
    )
