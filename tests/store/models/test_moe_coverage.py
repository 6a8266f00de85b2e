"""Every MoE causal-LM class of the installed transformers: run, or refused with a reason.

The model types are read from transformers itself (its causal-LM auto mapping;
a type is MoE when its config class declares routed-expert fields, itself or
in its text/FFN sub-config, or its name says ``moe``), so a transformers
upgrade that adds one fails here until it is either supported or listed in
:data:`czyx.store.models.archs.REFUSED_MOE` with what it lacks. A supported
type must have a decoder in the engine's registry; a refused one is mounted
and mount's one line must name what is missing.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from czyx.inference.models import DECODERS
from czyx.store import Store
from czyx.store.models.archs import REFUSED_MOE, arch_for_config
from czyx.store.models.mount import mount
from czyx.store.models.mount_errors import UnknownArchitectureError

# A config class declaring any of these (itself or a sub-config in its file) routes to experts.
_EXPERT_FIELD = re.compile(
    r"^\s+(?:self\.)?(num_experts|num_local_experts|n_routed_experts|moe_num_experts|"
    r"num_experts_per_tok|moe_intermediate_size)\b\s*[:=]",
    re.M,
)


@cache
def moe_model_types() -> tuple[str, ...]:
    """The MoE model types among transformers' causal-LM classes.

    Each type's configuration source is read as text, not imported: importing
    two hundred config modules costs seconds, and some defaults do not validate.
    """
    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    models = Path(transformers.__file__).parent / "models"
    out = []
    for mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        folder = models / model_type_to_module_name(mt)
        src = "".join(f.read_text() for f in sorted(folder.glob("configuration_*.py")))
        if "moe" in mt or _EXPERT_FIELD.search(src):
            out.append(mt)
    return tuple(out)


def test_the_census_finds_the_known_moe_types():
    types = moe_model_types()
    for mt in ("mixtral", "phimoe", "llama4_text", "qwen3_next", "jamba", "dbrx", "dots1"):
        assert mt in types
    assert "llama" not in types and "qwen2" not in types  # dense models are not counted
    assert len(types) > 50


def test_every_moe_type_runs_or_is_refused_with_a_reason():
    unaccounted = []
    for mt in moe_model_types():
        if mt in REFUSED_MOE:
            continue
        try:
            spec = arch_for_config({"model_type": mt})
        except UnknownArchitectureError:
            unaccounted.append(mt)
            continue
        assert spec.name in DECODERS, f"{mt} mounts as {spec.name}, which the engine lacks"
    assert not unaccounted, f"MoE model types neither run nor refused: {unaccounted}"


def test_refusals_at_mount_are_one_line_naming_what_is_missing(tmp_path):
    weights = {"model.embed_tokens.weight": np.zeros((2, 2), np.float32)}
    with Store.open(tmp_path / "store") as store:
        for mt, why in sorted(REFUSED_MOE.items()):
            assert why and "\n" not in why
            ckpt = tmp_path / mt
            ckpt.mkdir()
            (ckpt / "config.json").write_text(json.dumps({"model_type": mt}))
            save_file(weights, str(ckpt / "model.safetensors"))
            with pytest.raises(UnknownArchitectureError) as err:
                mount(store, ckpt, "x@1")
            msg = str(err.value)
            assert "\n" not in msg and f"{mt!r}" in msg and f"czyx has no {why}" in msg


def test_no_type_is_both_run_and_refused():
    """A type that gains a decoder leaves the refusal table (its entry would be stale)."""
    from czyx.store.models.archs import ARCHS

    run = {mt for spec in ARCHS.values() for mt in spec.model_types}
    assert not run & set(REFUSED_MOE)
