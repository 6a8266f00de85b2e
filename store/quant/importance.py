"""Calibration importance maps as records at the weights' coordinates.

Scope: converting the serialised importance map of
:meth:`inference.calibration.ImportanceCollector.to_dict` into records keyed
like the model's own records, and back. A routed expert's map (its input and
its down projection's input) sits at the expert's key (``Key(cls=class value,
z=layer)``; :func:`czyx.expert_key.expert_key` with the model's class shift),
exactly where its weights are. A trunk input is stored at the key
of the first trunk matrix that reads it (``L{l}.attn_in`` at ``q_proj``,
``L{l}.o_in`` at ``o_proj``, ``L{l}.moe_in`` at ``router``, the shared
expert's and dense MLP's down inputs at their ``down_proj``, ``lm_head_in`` at
``lm_head``), i.e. ``Key(cls=role index, z=layer, y=2**shift)``: the trunk's key
with ``y`` one past the largest ``y`` an expert key of the model has (``y = 1``
with at most 256 experts a layer), so it can live in the same space as expert
records without colliding. Sums and counts are stored (not means) so that maps merge exactly.

The store code that publishes the records (a space per calibration, its
manifest holding the provenance) is the caller's; this module does no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping

from czyx.expert_key import expert_key
from czyx.key import Key
from czyx.store.interfaces import StoreInterface
from czyx.store.quant.errors import CalibrationError

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
    class_shift: int = 0,
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
    class_shift : int
        The model's :func:`czyx.expert_key.class_shift` (0 up to 256 experts a layer).

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
        key = Key(int(role_index[role]), layer, 1 << class_shift, 0).pack()
        out.append((key, {"name": name, **entry}))
    for (layer, byte), rec in sorted(experts.items()):
        out.append((expert_key(int(class_of(layer, byte)), layer, class_shift).pack(), rec))
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


#: Manifest kind of an importance space.
IMPORTANCE_KIND = "czyx-importance"


def publish_importance(
    store: StoreInterface,
    model: object,
    data: Mapping[str, object],
    class_of: Callable[[int, int], int],
    role_index: Mapping[str, int],
    tag: str | None = None,
    class_shift: int = 0,
) -> object:
    """Publish an importance map as its own sealed space beside the model version.

    The space is content-addressed: its manifest names the model's selector,
    the provenance (text SHA-256, token count) and a hash of the records, so
    the same calibration of the same version is the same space. Records are
    :func:`importance_records` (the weights' coordinates).

    Parameters
    ----------
    store : store.Store
        An open store.
    model : czyx.space.Selector
        The model version's selector (its expert space).
    data : mapping
        ``ImportanceCollector.to_dict(provenance)``.
    class_of, role_index, class_shift
        As for :func:`importance_records` (the model's layout and trunk roles).
    tag : str or None
        A tag to point at the space (``set_tag`` semantics: idempotent).

    Returns
    -------
    czyx.space.Selector
        The importance space.
    """
    import hashlib

    import msgpack

    from czyx.space import Selector

    recs = importance_records(data, class_of, role_index, class_shift)
    digest = hashlib.sha256()
    for key, rec in sorted(recs, key=lambda kr: kr[0]):
        digest.update(key)
        digest.update(msgpack.packb(rec, use_bin_type=True))
    manifest = {
        "kind": IMPORTANCE_KIND,
        "version": 1,
        "model": model.hex(),  # type: ignore[attr-defined]
        "provenance": dict(data["provenance"]),  # type: ignore[arg-type]
        "records_sha256": digest.hexdigest(),
        "n_records": len(recs),
    }
    sel = Selector.from_manifest(manifest)
    if not store.has_space(sel):  # type: ignore[attr-defined]
        with store.begin_space(sel, manifest) as w:  # type: ignore[attr-defined]
            w.put_many(recs)
    if tag is not None:
        store.set_tag(tag, sel)  # type: ignore[attr-defined]
    return sel


def load_importance(store: StoreInterface, space: object) -> tuple[dict[str, object], str]:
    """``(serialised map, model selector hex)`` of a published importance space.

    Raises
    ------
    CalibrationError
        If the space is not an importance space.
    """
    manifest = store.manifest(space)  # type: ignore[attr-defined]
    if manifest.get("kind") != IMPORTANCE_KIND:
        raise CalibrationError(
            f"space {space.hex()} is not an importance map (kind {manifest.get('kind')!r})"  # type: ignore[attr-defined]
        )
    records = [rec for _, rec in store.scan(space)]  # type: ignore[attr-defined]
    return importance_from_records(records, manifest["provenance"]), str(manifest["model"])
