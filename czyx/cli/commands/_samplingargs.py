"""The sampling flags ``czyx run`` and ``czyx chat`` share, with one default each."""

from __future__ import annotations

import argparse

from czyx.inference.sampling import SamplingParams

_DEFAULTS = SamplingParams()


def add_penalty_args(p: argparse.ArgumentParser) -> None:
    """``--presence-penalty`` and ``--frequency-penalty`` (OpenAI's; off by default)."""
    p.add_argument(
        "--presence-penalty",
        type=float,
        default=_DEFAULTS.presence_penalty,
        help="lower a token already generated, once (OpenAI's; 0: off)",
    )
    p.add_argument(
        "--frequency-penalty",
        type=float,
        default=_DEFAULTS.frequency_penalty,
        help="lower a token by this for each time it was generated (OpenAI's; 0: off)",
    )
