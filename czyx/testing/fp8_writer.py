"""Write a transformers MoE model as an FP8 block-scaled checkpoint, as DeepSeek-V3 publishes.

Tests only. Every linear weight except the routers and the output head
(DeepSeek keeps those, the embeddings and the norms in bf16/f32) becomes
``F8_E4M3`` codes plus a float32 ``weight_scale_inv`` per ``block`` of
``[rows, cols]`` (``scale = amax(block) / 448``, codes = ``w / scale`` cast by
torch's ``float8_e4m3fn``), and ``config.json`` gets DeepSeek's
``quantization_config``. :func:`fp8_reference` is the model whose weights are
those codes dequantized (``code * scale_inv`` in float32).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any


def _fp8_target(name: str) -> bool:
    if not name.endswith(".weight") or "norm" in name or "embed" in name or "lm_head" in name:
        return False
    return not name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "_gate.weight"))


def _quantize(w: Any, block: tuple[int, int]) -> tuple[Any, Any]:
    import torch

    r, c = w.shape
    b0, b1 = block
    nr, nc = -(-r // b0), -(-c // b1)
    pad = torch.zeros(nr * b0, nc * b1, dtype=torch.float32)
    pad[:r, :c] = w.float()
    blocks = pad.reshape(nr, b0, nc, b1)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = (amax / 448.0).float()
    q = (blocks / scale[:, None, :, None]).reshape(nr * b0, nc * b1)[:r, :c]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def write_fp8_checkpoint(
    model: Any, path: str | os.PathLike[str], block: tuple[int, int] = (128, 128)
) -> Path:
    """Save ``model`` then rewrite its weights as FP8 + ``weight_scale_inv``; returns ``path``."""
    from safetensors.torch import load_file, save_file

    path = Path(path)
    model.save_pretrained(path)
    files = sorted(path.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError("write_fp8_checkpoint expects one unsharded safetensors file")
    state = load_file(str(files[0]))
    out = {}
    for name, t in state.items():
        if _fp8_target(name) and t.ndim == 2:
            q, s = _quantize(t, block)
            out[name] = q
            out[name[: -len(".weight")] + ".weight_scale_inv"] = s
        else:
            out[name] = t.contiguous()
    save_file(out, str(files[0]), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def fp8_reference(model: Any, path: str | os.PathLike[str]) -> Any:
    """A copy of ``model`` with the FP8 checkpoint at ``path``'s dequantized weights."""
    import torch
    from safetensors.torch import load_file

    cfg = json.loads((Path(path) / "config.json").read_text())
    b0, b1 = cfg["quantization_config"]["weight_block_size"]
    (f,) = sorted(Path(path).glob("*.safetensors"))
    state = load_file(str(f))
    deq = {}
    for name, t in state.items():
        if t.dtype == torch.float8_e4m3fn:
            s = state[name[: -len(".weight")] + ".weight_scale_inv"]
            full = s.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[: t.shape[0], : t.shape[1]]
            deq[name] = t.float() * full
        elif not name.endswith("weight_scale_inv"):
            deq[name] = t.float()
    ref = copy.deepcopy(model)
    missing, unexpected = ref.load_state_dict(_to_model_keys(ref, deq), strict=False)
    if missing or unexpected:
        raise ValueError(f"reference keys: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return ref


def _to_model_keys(model: Any, deq: dict) -> dict:
    """Per-expert saved names back to the model's stacked parameters (transformers 5)."""
    import torch

    sd = model.state_dict()
    out = {k: v for k, v in deq.items() if k in sd}
    for key in sd:  # Mixtral's saved names: block_sparse_moe.*
        alt = key.replace(".mlp.", ".block_sparse_moe.")
        if key not in out and alt in deq:
            out[key] = deq[alt]
    for key in sd:
        if key.endswith("experts.gate_up_proj"):
            prefix = key[: -len("gate_up_proj")]
            n = sd[key].shape[0]
            g = [_expert(deq, prefix, e, ("gate_proj", "w1")) for e in range(n)]
            u = [_expert(deq, prefix, e, ("up_proj", "w3")) for e in range(n)]
            out[key] = torch.stack([torch.cat([a, b]) for a, b in zip(g, u, strict=True)])
        elif key.endswith("experts.down_proj"):
            prefix = key[: -len("down_proj")]
            n = sd[key].shape[0]
            out[key] = torch.stack([_expert(deq, prefix, e, ("down_proj", "w2")) for e in range(n)])
    return out


def _expert(deq: dict, prefix: str, e: int, names: tuple[str, str]) -> Any:
    for p in (prefix, prefix.replace("mlp.experts.", "block_sparse_moe.experts.")):
        for n in names:
            k = f"{p}{e}.{n}.weight"
            if k in deq:
                return deq[k]
    raise KeyError(f"{prefix}{e}.{names[0]}")
