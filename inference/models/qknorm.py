"""The q/k RMS-norm attention shared by OLMoE and Qwen3-MoE.

Both architectures normalise the query and key projections with learned RMS
norms (trunk roles ``q_norm``/``k_norm``) and neither supports an attention
bias here. They differ only in the norms' width: OLMoE's span all heads at
once, Qwen3-MoE's one head (``head_dim``) at a time, which
:attr:`QKNormDecoder.qk_norm_per_head` selects.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from czyx.inference.errors import UnsupportedModelError
from czyx.inference.models.base import rms_norm
from czyx.inference.models.decoder import Layer, MoEDecoder


class QKNormDecoder(MoEDecoder):
    """A :class:`MoEDecoder` whose attention RMS-normalises q and k.

    Subclasses set :attr:`qk_norm_per_head` and call :meth:`norm_qk` from
    their :meth:`post_qkv`.
    """

    required_roles = (*MoEDecoder.required_roles, "q_norm", "k_norm")
    qk_norm_per_head: ClassVar[bool] = False

    @staticmethod
    def reject_attention_bias(config: dict[str, Any]) -> None:
        """Fail closed on ``attention_bias`` (an o_proj bias, not implemented).

        Raises
        ------
        UnsupportedModelError
            If the config sets ``attention_bias``.
        """
        if config.get("attention_bias"):
            raise UnsupportedModelError("config attention_bias=true (o_proj bias) is not supported")

    def norm_qk(self, lw: Layer, q: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """RMS-normalise ``q`` and ``k`` (``(tokens, heads * head_dim)``) with the layer's norms.

        Parameters
        ----------
        lw
            The layer's weights (``q_norm``, ``k_norm``).
        q, k
            The query and key projections, heads side by side.

        Returns
        -------
        tuple of numpy.ndarray
            The normalised ``q`` and ``k``, same shapes.
        """
        eps = self.cfg.rms_eps
        if not self.qk_norm_per_head:
            return rms_norm(q, lw.q_norm, eps), rms_norm(k, lw.k_norm, eps)
        t, hd = q.shape[0], self.cfg.head_dim
        q = rms_norm(q.reshape(t, -1, hd), lw.q_norm, eps).reshape(t, -1)
        k = rms_norm(k.reshape(t, -1, hd), lw.k_norm, eps).reshape(t, -1)
        return q, k
