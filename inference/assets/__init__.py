"""Package data: the small trained MoE that ships with czyx.

``czyx-moe-stdlib/`` holds a byte-level Mixtral-format checkpoint
(``config.json`` + fp16 ``model.safetensors``, Hugging Face layout) trained by
``tools/train_moe.py`` on the Python standard library, with its
``training_log.json`` and ``TRAINING.md``. Use :func:`bundled_model_dir` to
find it from an installed package.
"""

from __future__ import annotations

from pathlib import Path

from czyx.errors import CzyxError

BUNDLED_MODEL = "czyx-moe-stdlib"


def bundled_model_dir() -> Path:
    """Directory of the bundled checkpoint; raises if the package data is missing.

    Returns
    -------
    Path
        The directory holding ``config.json`` and ``model.safetensors``.
    """
    d = Path(__file__).resolve().parent / BUNDLED_MODEL
    for name in ("config.json", "model.safetensors"):
        if not (d / name).is_file():
            raise CzyxError(f"bundled model file missing: {d / name} (was package data dropped?)")
    return d
