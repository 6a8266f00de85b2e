"""Calibration importance maps as records at the weights' coordinates.

Scope: converting the serialised importance map of
:meth:`inference.calibration.ImportanceCollector.to_dict` into records keyed
like the model's own records, and back. A routed expert's map (its input and
its down projection's input) sits at the expert's key, ``Key(cls=class value,
z=layer)``, exactly where its weights are. A trunk input is stored at the key
of the first trunk matrix that reads it (``L{l}.attn_in`` at ``q_proj``,
``L{l}.o_in`` at ``o_proj``, ``L{l}.moe_in`` at ``router``, the shared
expert's and dense MLP's down inputs at their ``down_proj``, ``lm_head_in`` at
``lm_head``), i.e. ``Key(cls=role index, z=layer, y=1)``: the trunk's key
with ``y = 1``, so it can live in the same space as expert records without
colliding. Sums and counts are stored (not means) so that maps merge exactly.

The store code that publishes the records (a space per calibration, its
manifest holding the provenance) is the caller's; this module does no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping

from czyx.key import Key
from store.quant.errors import CalibrationError

#: Tag of the serialised map (the same as ``inference.calibration.FORMAT_TAG``).
FORMAT_TAG = "czyx-importance/1"

_EXPERT = re.compile(r"^L(\d+)\.E(\d+)\.(in|down_in)$")
_LAYER = re.compile(r"^L(\d+)\.(attn_in|o_in|moe_in|shared\.down_in|mlp\.down_in)$")
#: The trunk role at whose key each layer-level input is stored.
READER_ROLE = {
    "attn_in": "q_proj",
    "o_in": "o_proj",
    "moe_in": "router",
    "shared.down_in": "shared_down_proj",
    "mlp.down_in": "mlp_down_proj",
}


def importance_records(
    data: Mapping[str, object],
    class_of: Callable[[int, int], int],
    role_index: Mapping[str, int],
) -> list[tuple[bytes, dict]]:
    """Records for every matrix input of a serialised importance map.

    Parameters
    ----------
    data : mapping
        ``ImportanceCollector.to_dict(...)`` output.
    class_of : callable
        ``(layer, router byte) -> class value`` of the model's layout.
    role_index : mapping
        Trunk role -> class value of the model's trunk keys.

    Returns
    -------
    list of (bytes, dict)
        ``(packed key, record)`` pairs, one per expert and one per trunk input.

    Raises
    ------
    CalibrationError
        On a wrong tag or a name that is not a known matrix input.
    """
    if data.get("format") != FORMAT_TAG:
        raise CalibrationError(f"not an importance map (expected format {FORMAT_TAG!r})")
    experts: dict[tuple[int, int], dict] = {}
    out: list[tuple[bytes, dict]] = []
    for name, rec in dict(data["matrices"]).items():  # type: ignore[arg-type]
        entry = {"count": int(rec["count"]), "cols": int(rec["cols"]), "sumsq": rec["sumsq"]}
        m = _EXPERT.match(name)
        if m:
            layer, byte, part = int(m.group(1)), int(m.group(2)), m.group(3)
            experts.setdefault((layer, byte), {"layer": layer, "expert": byte, "inputs": {}})
            experts[(layer, byte)]["inputs"][part] = entry
            continue
        m = _LAYER.match(name)
        if m:
            layer, role = int(m.group(1)), READER_ROLE[m.group(2)]
        elif name == "lm_head_in":
            layer, role = 0, "lm_head"
        else:
            raise CalibrationError(f"importance {name!r} is not a known matrix input")
        if role not in role_index:
            raise CalibrationError(f"importance {name!r}: the model has no role {role!r} index")
        key = Key(int(role_index[role]), layer, 1, 0).pack()
        out.append((key, {"name": name, **entry}))
    for (layer, byte), rec in sorted(experts.items()):
        out.append((Key(int(class_of(layer, byte)), layer, 0, 0).pack(), rec))
    return out


def importance_from_records(records: Iterable[dict], provenance: dict) -> dict[str, object]:
    """Inverse of :func:`importance_records`: the serialised map (with ``provenance``).

    Raises
    ------
    CalibrationError
        On a record that is neither an expert's nor a trunk input's.
    """
    mats: dict[str, dict] = {}
    for rec in records:
        if "name" in rec:
            mats[str(rec["name"])] = {k: rec[k] for k in ("count", "cols", "sumsq")}
        elif "inputs" in rec:
            for part, entry in dict(rec["inputs"]).items():
                mats[f"L{rec['layer']}.E{rec['expert']}.{part}"] = dict(entry)
        else:
            raise CalibrationError(f"record {sorted(rec)} is not an importance record")
    return {"format": FORMAT_TAG, "provenance": dict(provenance), "matrices": mats}
