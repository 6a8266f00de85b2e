"""Text <-> token ids: the checkpoint's ``tokenizer.json`` when it has one, bytes otherwise.

The byte tokenizer maps each UTF-8 byte to its value (ids 0..255), so it
works with any model whose vocabulary has at least 256 entries and needs no
file. Streaming decode emits only complete characters.
"""

from __future__ import annotations

import os
from typing import Protocol

from czyx.inference.errors import TokenizerError


class Tokenizer(Protocol):
    """What generation needs from a tokenizer."""

    name: str
    eos_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        ...

    def decode(self, ids: list[int]) -> str:
        """The text of token ids ``ids``."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as token ids (0..255); no end-of-sequence token of its own."""

    name = "bytes"

    def __init__(self, vocab_size: int = 256) -> None:
        if vocab_size < 256:
            raise TokenizerError(
                f"byte tokenizer needs a vocabulary of 256, the model has {vocab_size}"
            )
        self.eos_ids: tuple[int, ...] = ()

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Bytes to text; ids >= 256 (specials) are dropped, bad UTF-8 replaced."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers`` tokenizer loaded from ``tokenizer.json`` text."""

    name = "tokenizer.json"

    def __init__(self, json_text: str) -> None:
        try:
            from tokenizers import Tokenizer as _Tok

            self._tok = _Tok.from_str(json_text)
        except Exception as exc:  # the library raises plain Exceptions on bad files
            raise TokenizerError(f"tokenizer.json could not be loaded: {exc}") from exc
        eos = []
        for name in ("</s>", "<|endoftext|>", "<|im_end|>", "<eos>", "<|end_of_text|>"):
            tid = self._tok.token_to_id(name)
            if tid is not None:
                eos.append(tid)
        self.eos_ids = tuple(eos)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``, special tokens skipped."""
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(source: str | os.PathLike | None, vocab_size: int) -> Tokenizer:
    """The tokenizer for a model.

    Parameters
    ----------
    source
        A checkpoint directory (its ``tokenizer.json`` is used if present),
        a ``tokenizer.json`` path, the file's JSON text, or None.
    vocab_size
        The model's vocabulary, for the byte fallback's check.

    Raises
    ------
    TokenizerError
        ``source`` names neither a directory nor an existing file, or the
        ``tokenizer.json`` does not load. Bytes are the fallback only for
        ``None`` and for a directory without a ``tokenizer.json``.
    """
    if source is None:
        return ByteTokenizer(vocab_size)
    text = str(source)
    if text.lstrip().startswith("{"):
        return HFTokenizer(text)
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            return ByteTokenizer(vocab_size)
    elif not os.path.isfile(path):
        raise TokenizerError(f"tokenizer {path!r}: no such file or directory")
    with open(path, encoding="utf-8") as f:
        return HFTokenizer(f.read())


def tokenizer_for(consumer: object, vocab_size: int) -> Tokenizer:
    """The tokenizer of an opened model: its mounted ``tokenizer.json`` if the
    consumer carries one (``ModelConsumer.tokenizer_json``, optional), else bytes."""
    src = getattr(consumer, "tokenizer_json", None)
    if callable(src):
        src = src()
    if src is None:
        return ByteTokenizer(vocab_size)
    if isinstance(src, bytes):
        src = src.decode("utf-8")
    return HFTokenizer(src)  # JSON text, never a path: a bad one must not fall back to bytes


class StreamDecoder:
    """Incremental detokenizer: each call returns the new complete text.

    It re-decodes the tokens since the last emitted boundary and holds back a
    trailing U+FFFD (an incomplete UTF-8 sequence) until it completes.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.emitted = 0  # characters of decode(ids) already returned

    def push(self, token: int) -> str:
        """Add a token; return the text it completes (maybe empty)."""
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new = text[self.emitted :]
        self.emitted = len(text)
        return new

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character as U+FFFD)."""
        text = self.tok.decode(self.ids)
        new = text[self.emitted :]
        self.emitted = len(text)
        return new
