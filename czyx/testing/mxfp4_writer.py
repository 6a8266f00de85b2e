"""Write a transformers GPT-OSS model as an MXFP4 checkpoint, the way GPT-OSS is published.

Tests only. Each layer's stacked ``mlp.experts.gate_up_proj [E, H, 2I]`` and
``down_proj [E, I, H]`` become ``*_blocks [E, R, G, 16]`` (two FP4 E2M1 codes
a byte, low nibble first) and ``*_scales [E, R, G]`` (E8M0, bias 127) over
the transposed ``[E, R, 32 G]`` rows, as transformers' ``integrations/mxfp4``
reads them; ``config.json`` gets GPT-OSS's ``quantization_config``. The
quantizer is the OCP MX one: scale exponent ``floor(log2(amax)) - 2`` per
block of 32, each value to its nearest E2M1 value (saturating at 6).
:func:`mxfp4_reference` is the model whose expert weights are those codes
dequantized (with transformers' own ``convert_moe_packed_tensors``).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

_E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
_PROJ = ("gate_up_proj", "down_proj")


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w [E, C, R]`` float -> ``(blocks [E, R, C/32, 16], scales [E, R, C/32])`` uint8."""
    e, c, r = w.shape
    if c % 32:
        raise ValueError(f"MXFP4 needs the blocked axis ({c}) to be a multiple of 32")
    rows = np.ascontiguousarray(np.swapaxes(w.astype(np.float32), 1, 2)).reshape(e, r, c // 32, 32)
    amax = np.abs(rows).max(axis=-1)
    with np.errstate(divide="ignore"):
        exp = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-38))) - 2, 0)
    exp = np.clip(exp, -127, 127).astype(np.int32)
    scaled = rows / np.ldexp(np.float32(1), exp)[..., None]
    codes = np.abs(scaled[..., None] - _E2M1).argmin(axis=-1).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.astype(np.uint8), (exp + 127).astype(np.uint8)


def write_mxfp4_checkpoint(model: Any, path: str | os.PathLike[str]) -> Path:
    """Save GPT-OSS ``model`` with its routed experts in MXFP4; returns ``path``."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    model.save_pretrained(path)
    (f,) = sorted(path.glob("*.safetensors"))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    out = {}
    for name, t in state.items():
        if name.endswith(_PROJ) and ".experts." in name:
            blocks, scales = quantize_mxfp4(t.float().numpy())
            out[name + "_blocks"] = torch.from_numpy(blocks)
            out[name + "_scales"] = torch.from_numpy(scales)
        else:
            out[name] = t
    f.unlink()
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def mxfp4_reference(model: Any, path: str | os.PathLike[str]) -> Any:
    """A copy of ``model`` with the MXFP4 checkpoint at ``path``'s dequantized experts
    (transformers' ``convert_moe_packed_tensors`` in float32)."""
    import torch
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    state = load_file(str(Path(path) / "model.safetensors"))
    ref = copy.deepcopy(model)
    new = {}
    for name in ref.state_dict():
        if name.endswith(_PROJ) and ".experts." in name:
            new[name] = convert_moe_packed_tensors(
                state[name + "_blocks"], state[name + "_scales"], dtype=torch.float32
            )
    _, unexpected = ref.load_state_dict(new, strict=False)
    if unexpected or not new:
        raise ValueError(f"reference keys: unexpected {unexpected[:4]}")
    return ref
