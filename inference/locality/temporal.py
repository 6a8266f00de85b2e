"""Temporal reuse: does token t select the experts token t-lag selected?

Scope: overlap of consecutive tokens' expert sets per layer, at several lags,
against a baseline with identical usage: the same trace with its tokens
shuffled (a fixed seed, averaged over a few draws). Reuse well above the
baseline is what makes recency caches (LRU) beat a static hot set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from czyx.inference.trace import RoutingTrace


def overlap_at_lag(experts: np.ndarray, segments: np.ndarray, lag: int) -> np.ndarray:
    """Mean share of token t's experts also selected by token t-lag, per layer.

    Only pairs in the same segment count.

    Parameters
    ----------
    experts : np.ndarray
        ``[T, L, k]`` selections.
    segments : np.ndarray
        ``[T]`` sequence ids.
    lag : int
        Distance in tokens (>= 1).

    Returns
    -------
    np.ndarray
        float ``[L]``; NaN where no pair exists.
    """
    if lag < 1:
        raise ValueError(f"lag must be >= 1, got {lag}")
    cur, prev = experts[lag:], experts[:-lag]
    same = segments[lag:] == segments[:-lag]
    if not same.any():
        return np.full(experts.shape[1], np.nan)
    hit = (cur[:, :, :, None] == prev[:, :, None, :]).any(axis=3)  # [T', L, k]
    return hit[same].mean(axis=(0, 2))


@dataclass(frozen=True)
class TemporalReuse:
    """Reuse at each lag, observed and shuffled, averaged over layers and per layer.

    Attributes
    ----------
    lags : tuple[int, ...]
        The lags measured.
    observed : np.ndarray
        ``[len(lags), L]`` overlap share on the trace.
    shuffled : np.ndarray
        ``[len(lags), L]`` the same on token-shuffled traces (mean of draws).
    """

    lags: tuple[int, ...]
    observed: np.ndarray
    shuffled: np.ndarray

    def ratio(self) -> np.ndarray:
        """Observed / shuffled per lag, averaged over layers."""
        return self.observed.mean(axis=1) / self.shuffled.mean(axis=1)


def temporal_reuse(
    trace: RoutingTrace, lags: Sequence[int] = (1, 2, 4, 8, 16), draws: int = 3, seed: int = 0
) -> TemporalReuse:
    """Measure reuse at ``lags`` against a token-shuffled baseline with the same usage."""
    rng = np.random.default_rng(seed)
    obs = np.stack([overlap_at_lag(trace.experts, trace.segments, g) for g in lags])
    flat = np.zeros_like(trace.segments)  # shuffled tokens have no segment structure
    shuf = np.zeros_like(obs)
    for _ in range(draws):
        e = trace.experts[rng.permutation(trace.n_tokens)]
        shuf += np.stack([overlap_at_lag(e, flat, g) for g in lags])
    return TemporalReuse(lags=tuple(int(g) for g in lags), observed=obs, shuffled=shuf / draws)
