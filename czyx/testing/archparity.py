"""Architecture parity against transformers, through the whole store path (tests and bench).

One call, :func:`run_parity`, takes a tiny random transformers model of an
architecture, writes it as a checkpoint (the per-expert form
``save_pretrained`` writes, or the stacked ``experts.gate_up_proj`` form
transformers 5.x holds in memory), mounts it into a fresh store, opens it
through a portal and measures:

* the largest absolute logit difference from transformers over a prompt;
* whether greedy decoding gives transformers' tokens with every expert
  resident, and with a quarter of the experts' bytes as cache;
* whether ``czyx export`` writes the source's safetensors files back byte
  for byte, and transformers' logits from the exported directory.

``tests/inference/models`` assert on the result; ``bench/arch_table.py``
prints it as the architecture table. A refusal (a typed czyx error while
mounting or opening) is reported with its one-line message, not raised.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from czyx.errors import CzyxError
from czyx.testing.tiny_models import build_tiny_model, model_class


@dataclass(frozen=True)
class ParityResult:
    """What :func:`run_parity` measured (``refused`` set: nothing else was)."""

    arch: str
    layout: str  # "fused": the state dict as transformers holds it; else save_pretrained's files
    refused: str | None = None
    source_layout: str = ""  # the expert tensors mount found: "per_expert" or "fused" (stacked)
    max_diff: float = float("nan")
    logit_range: float = float("nan")
    greedy_full: bool = False
    greedy_quarter: bool = False
    quarter_misses: int = 0
    export_identical: bool = False
    export_max_diff: float = float("nan")
    tokens: int = 0

    @property
    def green(self) -> bool:
        """Mounted, logits within 1e-5 of the logit range, greedy equal at full and quarter
        cache, export exact.

        Relative to the range, as the goal is stated: a hybrid model's float32 noise
        floor is above 1e-5 absolute (transformers' own chunked prompt and token-by-token
        decode of Qwen3-Next differ by 1.4e-5 on its tiny config).
        """
        tol = 1e-5 * self.logit_range
        return (
            self.refused is None
            and self.max_diff <= tol
            and self.greedy_full
            and self.greedy_quarter
            and self.export_identical
            and self.export_max_diff <= tol
        )


def write_checkpoint(model: Any, path: Path, fused: bool) -> Path:
    """Write ``model`` as ``save_pretrained`` does, or (``fused``) its state dict as held."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    if fused:
        model.config.save_pretrained(path)
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        model.save_pretrained(path)
    return path


def reference(model: Any, prompt: np.ndarray, steps: int) -> tuple[np.ndarray, list[int]]:
    """transformers' logits over ``prompt`` and its ``steps`` greedy tokens after it.

    Greedy is a plain argmax loop over transformers' KV cache: ``generate``
    would add logits processors (``min_new_tokens`` masks the end-of-sequence
    id), which is not the model's own choice.
    """
    import torch
    from transformers import DynamicCache

    ids = torch.tensor(np.asarray(prompt))[None]
    tokens: list[int] = []
    with torch.no_grad():
        logits = model(ids).logits[0].float().numpy()
        cache = DynamicCache(config=model.config)
        out = model(ids, cache=cache, use_cache=True).logits[0, -1]
        for _ in range(steps):
            tok = int(torch.argmax(out))
            tokens.append(tok)
            out = model(torch.tensor([[tok]]), cache=cache, use_cache=True).logits[0, -1]
    return logits, tokens


def run_parity(
    arch: str,
    workdir: Path,
    *,
    fused: bool,
    seed: int = 0,
    prompt_len: int = 12,
    steps: int = 16,
    model: Any = None,
    **overrides: Any,
) -> ParityResult:
    """Mount, run and export a tiny ``arch`` model; compare each step with transformers.

    Parameters
    ----------
    arch
        A :data:`czyx.testing.tiny_models.ARCHES` name.
    workdir
        An empty scratch directory (checkpoint, store and export go under it).
    fused
        Write stacked expert tensors instead of ``save_pretrained``'s per-expert ones.
    model
        A prebuilt transformers model (else ``build_tiny_model(arch, seed, **overrides)``).
    """
    import torch

    from czyx.inference.engine import Engine
    from czyx.inference.generate import generate_ids
    from czyx.inference.opened import OpenedModel
    from czyx.store import Store
    from czyx.store.models.export import export
    from czyx.store.models.mount import mount

    layout = "fused" if fused else "per_expert"
    if model is None:
        model = build_tiny_model(arch, seed, **overrides)
    vocab = int(model.config.vocab_size)
    prompt = np.random.default_rng(seed + 7).integers(0, vocab, prompt_len)
    want, want_tokens = reference(model, prompt, steps)
    src = write_checkpoint(model, workdir / "ckpt", fused)
    store_dir = workdir / "store"
    tag = f"{arch.replace('_', '-')}@1"
    from czyx.store.models.checkpoint import Checkpoint
    from czyx.store.models.mount_plan import plan_checkpoint

    store = Store.open(store_dir)
    try:
        try:
            with Checkpoint(src) as ckpt:
                source_layout = plan_checkpoint(ckpt).expert_layout
            mount(store, src, tag)
        except CzyxError as exc:
            return ParityResult(arch, layout, refused=f"{type(exc).__name__}: {exc}")
        out = workdir / "export"
        export(store, tag, out)
    finally:
        store.close()
    opened = OpenedModel(str(store_dir), tag, None)
    try:
        try:
            got = Engine(opened.consumer).prefill(prompt, all_logits=True)
        except CzyxError as exc:
            return ParityResult(arch, layout, refused=f"{type(exc).__name__}: {exc}")
        full, _ = generate_ids(Engine(opened.consumer), prompt.tolist(), steps)
        small = Engine(opened.consumer, cache_fraction=0.25)
        quarter, _ = generate_ids(small, prompt.tolist(), steps)
        misses = small.stats().misses
    finally:
        opened.close()
    identical = all(
        (out / f.name).read_bytes() == f.read_bytes() for f in sorted(src.glob("*.safetensors"))
    )
    reloaded = model_class(arch).from_pretrained(out).eval()
    with torch.no_grad():
        again = reloaded(torch.tensor(prompt)[None]).logits[0].float().numpy()
    shutil.rmtree(out, ignore_errors=True)
    return ParityResult(
        arch,
        layout,
        source_layout=source_layout,
        max_diff=float(np.abs(got - want).max()),
        logit_range=float(want.max() - want.min()),
        greedy_full=full == want_tokens,
        greedy_quarter=quarter == want_tokens,
        quarter_misses=int(misses),
        export_identical=identical,
        export_max_diff=float(np.abs(again - want).max()),
        tokens=steps,
    )
