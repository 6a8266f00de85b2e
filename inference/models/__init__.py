"""One readable numpy module per MoE architecture, and the registry by arch name.

``DECODERS`` maps the ``ModelInfo.arch`` string (the checkpoint's
``model_type``) to its decoder class; :func:`decoder_class` fails closed on
anything else.
"""

from __future__ import annotations

from czyx.inference.errors import UnsupportedModelError
from czyx.inference.models.decoder import DecoderConfig, MoEDecoder
from czyx.inference.models.deepseek_v2 import DeepseekV2Decoder
from czyx.inference.models.deepseek_v3 import DeepseekV3Decoder
from czyx.inference.models.dots1 import (
    Dots1Decoder,
    ExaoneMoeDecoder,
    HYV3Decoder,
    SolarOpenDecoder,
)
from czyx.inference.models.ernie4_5_moe import Ernie45MoeDecoder
from czyx.inference.models.glm4_moe import Glm4MoeDecoder
from czyx.inference.models.gpt_oss import GptOssDecoder
from czyx.inference.models.granitemoe import GraniteMoeDecoder, GraniteMoeSharedDecoder
from czyx.inference.models.hunyuan_v1_moe import HunYuanMoeV1Decoder
from czyx.inference.models.jamba import JambaDecoder
from czyx.inference.models.llama4 import Llama4TextDecoder
from czyx.inference.models.mixtral import MixtralDecoder
from czyx.inference.models.olmoe import MiniMaxM2Decoder, OlmoeDecoder
from czyx.inference.models.phimoe import PhimoeDecoder
from czyx.inference.models.qwen2_moe import Qwen2MoeDecoder
from czyx.inference.models.qwen3_moe import Qwen3MoeDecoder
from czyx.inference.models.qwen3_next import Qwen3NextDecoder

DECODERS: dict[str, type[MoEDecoder]] = {
    cls.arch: cls
    for cls in (
        MixtralDecoder,
        Qwen2MoeDecoder,
        Qwen3MoeDecoder,
        OlmoeDecoder,
        DeepseekV3Decoder,
        DeepseekV2Decoder,
        Glm4MoeDecoder,
        GptOssDecoder,
        Ernie45MoeDecoder,
        GraniteMoeDecoder,
        HunYuanMoeV1Decoder,
        Qwen3NextDecoder,
        JambaDecoder,
        PhimoeDecoder,
        Llama4TextDecoder,
        Dots1Decoder,
        SolarOpenDecoder,
        GraniteMoeSharedDecoder,
        MiniMaxM2Decoder,
        HYV3Decoder,
        ExaoneMoeDecoder,
    )
}


def decoder_class(arch: str) -> type[MoEDecoder]:
    """The decoder class of ``arch``; raises :class:`UnsupportedModelError` if unknown."""
    try:
        return DECODERS[arch]
    except KeyError:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported (known: {', '.join(sorted(DECODERS))})"
        ) from None


__all__ = ["DECODERS", "DecoderConfig", "MoEDecoder", "decoder_class"]
