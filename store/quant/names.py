"""Names of matrix inputs in an importance map (shared by calibration and quantization).

Scope: one pure function, :func:`input_key`, so that the engine's calibration
hook (``inference.calibration``) and the quantizing mount (``store.quant``)
agree on names without the store importing the engine. Matrices that read the
same input share one name: in layer ``l``, q/k/v read ``L{l}.attn_in``;
o_proj reads ``L{l}.o_in``; the router, the shared expert's gate/up and the
dense MLP's gate/up read ``L{l}.moe_in`` (all tokens); routed expert ``e``'s
gate/up read ``L{l}.E{e}.in`` (only its tokens) and its down reads
``L{l}.E{e}.down_in``; the shared expert's and dense MLP's down read
``L{l}.shared.down_in`` / ``L{l}.mlp.down_in``; the head reads
``lm_head_in``. The embedding is a gather: no map.
"""

from __future__ import annotations

from czyx.store.quant.errors import CalibrationError

_LAYER_INPUT = {
    "q_proj": "attn_in",
    "k_proj": "attn_in",
    "v_proj": "attn_in",
    "o_proj": "o_in",
    "router": "moe_in",
    "shared_expert_gate": "moe_in",
    "shared_gate_proj": "moe_in",
    "shared_up_proj": "moe_in",
    "mlp_gate_proj": "moe_in",
    "mlp_up_proj": "moe_in",
    "shared_down_proj": "shared.down_in",
    "mlp_down_proj": "mlp.down_in",
    # DeepSeek's latent attention: the down-projections read the layer's input,
    # the up-projections the normalised low-rank query and the cached latent.
    "q_a_proj": "attn_in",
    "kv_a_proj": "attn_in",
    "q_b_proj": "q_b_in",
    "kv_b_proj": "kv_b_in",
    # Hybrid layers: Qwen3-Next's DeltaNet and Jamba's Mamba projections.
    "lin_qkvz": "attn_in",
    "lin_ba": "attn_in",
    "mamba_in_proj": "attn_in",
    "mamba_x_proj": "mamba.x_in",
    "mamba_dt_proj": "mamba.dt_in",
}


def input_key(layer: int | None, role: str, expert: int | None = None) -> str | None:
    """The importance-map name of the input of ``role`` (``None``: no map, e.g. embed).

    Parameters
    ----------
    layer : int or None
        The layer (``None`` for global roles).
    role : str
        A consumer role (``store.consumer.TRUNK_ROLES``) or, for routed experts,
        ``"gate_proj"``, ``"up_proj"`` or ``"down_proj"`` with ``expert`` set.
    expert : int or None
        The routed expert's index (its router byte).
    """
    if role == "embed":
        return None
    if role == "lm_head":
        return "lm_head_in"
    if layer is None:
        raise CalibrationError(f"role {role!r} needs a layer")
    if expert is not None:
        if role in ("gate_proj", "up_proj"):
            return f"L{layer}.E{expert}.in"
        if role == "down_proj":
            return f"L{layer}.E{expert}.down_in"
        raise CalibrationError(f"role {role!r} is not a routed-expert matrix")
    try:
        return f"L{layer}.{_LAYER_INPUT[role]}"
    except KeyError:
        raise CalibrationError(f"role {role!r} has no importance map (not a matrix)") from None
