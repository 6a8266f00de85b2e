"""llama.cpp's prompt-lookup decoding beside czyx's, on the same weights (bench-only).

Used by ``python bench/bench_speculate.py --llama``: the bundled model's stored
version, written as GGUF by czyx's own exporter
(:func:`czyx.store.models.gguf_export.export_gguf`), run by llama-cpp-python's
``Llama.generate`` greedily (``top_k=1``, ``temp=0``) without a draft model and with
``LlamaPromptLookupDecoding`` as its ``draft_model``, token ids in (a 256-entry byte
vocabulary: neither engine tokenizes), in the same interleaved rounds as czyx's
decode without drafts and with ``--speculate lookup``.

Timing as :class:`~czyx.inference.generate.GenerationStats` times czyx: decode
tokens/s is every generated token but the first (prefill gives it) over the time
from the first token to the last.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def llama_missing() -> str | None:
    """None when llama-cpp-python and its prompt-lookup drafter import, else why not."""
    try:
        import llama_cpp  # noqa: F401
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # noqa: F401
    except ImportError as exc:
        return f"llama_cpp is not importable ({exc})"
    return None


def byte_tokenizer_json() -> str:
    """A byte-level BPE ``tokenizer.json`` whose 256 tokens are the bytes, id = byte value
    (the bundled model's own ids): llama.cpp loads no GGUF without a vocabulary, and the
    bundled checkpoint has none (its tokens are bytes). Its one merge never applies (two
    NUL bytes; llama.cpp refuses a BPE vocabulary without merges)."""
    import json

    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    b2u, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):  # GPT-2's byte-to-unicode map: the byte-level pre-tokenizer's
        if b not in b2u:
            b2u[b], extra = chr(256 + extra), extra + 1
    model = {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "vocab": {b2u[b]: b for b in range(256)},
        "merges": [f"{b2u[0]} {b2u[0]}"],
    }
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
    return json.dumps(
        {
            "version": "1.0",
            "added_tokens": [],
            "normalizer": None,
            "pre_tokenizer": {**level, "use_regex": True},
            "post_processor": None,
            "decoder": level,
            "model": model,
        }
    )


def with_byte_vocabulary(src: Path, dst: Path) -> Path:
    """``dst``: a copy of the checkpoint directory ``src`` with :func:`byte_tokenizer_json`
    added (the weights' bytes unchanged: mounted, they share every extent)."""
    import shutil

    shutil.copytree(src, dst)
    (dst / "tokenizer.json").write_text(byte_tokenizer_json())
    return dst


class RecordedLookup:
    """``LlamaPromptLookupDecoding`` whose every draft is kept with the position it
    starts at, so its acceptance can be counted against the tokens generated."""

    def __init__(self, num_pred_tokens: int) -> None:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.inner = LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens)
        self.drafts: list[tuple[int, list[int]]] = []

    def __call__(self, input_ids: Any, /, **kwargs: Any) -> Any:
        out = self.inner(input_ids, **kwargs)
        self.drafts.append((len(input_ids), [int(t) for t in out]))
        return out


def draft_counts(drafts: list[tuple[int, list[int]]], seq: Sequence[int]) -> tuple[int, int]:
    """``(drafted, accepted)`` of ``drafts`` against the final sequence ``seq``: each
    draft's accepted prefix (greedy: a draft token is kept while it is the next token),
    counting only positions inside ``seq`` (a last draft past the requested length is
    neither drafted nor accepted here)."""
    drafted = accepted = 0
    for start, toks in drafts:
        toks = toks[: max(0, len(seq) - start)]
        drafted += len(toks)
        for i, t in enumerate(toks):
            if seq[start + i] != t:
                break
            accepted += 1
    return drafted, accepted


@dataclass
class LlamaRun:
    """One greedy run of llama.cpp: its tokens, decode rate and draft counts."""

    tokens: list[int]
    decode_tok_s: float
    drafted: int = 0
    accepted: int = 0
    passes: int = 0  # decode forward passes (one per draft call when drafting)


class LlamaGreedy:
    """llama-cpp-python on a GGUF file, greedy through ``Llama.generate`` (what a user of
    its ``draft_model`` runs), with prompt lookup of ``lookup`` tokens at most (0: none)."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int, lookup: int = 0) -> None:
        import llama_cpp

        from bench._llama import without_extra_bufts

        self.draft = RecordedLookup(lookup) if lookup else None
        with without_extra_bufts():
            self.llm = llama_cpp.Llama(
                model_path=str(gguf),
                n_ctx=n_ctx,
                n_batch=512,
                n_ubatch=512,
                n_threads=threads,
                n_threads_batch=threads,
                draft_model=self.draft,
                # A draft model makes it keep every row's logits, but llama-cpp-python
                # (0.3.36) sizes that buffer by this argument: given, as it must be.
                logits_all=self.draft is not None,
                verbose=False,
            )

    def run(self, prompt: Sequence[int], n: int) -> LlamaRun:
        """``n`` greedy tokens after ``prompt`` (a fresh context)."""
        llm = self.llm
        llm.reset()  # no prefix reuse from the last run: its prompt is processed again
        if self.draft is not None:
            self.draft.drafts.clear()
        out: list[int] = []
        t1 = t2 = time.perf_counter()
        gen = llm.generate(list(prompt), top_k=1, temp=0.0, repeat_penalty=1.0, reset=True)
        for tok in gen:
            out.append(int(tok))
            if len(out) == 1:
                t1 = time.perf_counter()
            if len(out) == n:
                break
        t2 = time.perf_counter()
        gen.close()
        rate = (len(out) - 1) / (t2 - t1) if t2 > t1 else 0.0
        if self.draft is None:
            return LlamaRun(out, rate, passes=max(len(out) - 1, 0))
        drafted, accepted = draft_counts(self.draft.drafts, [*prompt, *out])
        return LlamaRun(out, rate, drafted, accepted, passes=len(self.draft.drafts))

    def close(self) -> None:
        """Free the model and its context."""
        self.llm.close()


def agreement(a: Sequence[int], b: Sequence[int]) -> str:
    """Whether two greedy token sequences agree: ``identical (n/n)`` or where they part."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return f"first differs at token {i + 1} of {n}"
    return f"identical ({n}/{n})" if len(a) == len(b) else f"prefix of {n} equal, lengths differ"
