"""Incremental detokenization in the server equals a full decode (byte-level BPE, a
sentencepiece-like Metaspace tokenizer, bytes), and stop strings cut the text exactly."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from czyx.inference.tokenizer import ByteTokenizer, HFTokenizer
from czyx.server.app import _TextStream

CORPUS = [
    "def main(argv):\n    return 0\n",
    "héllo wörld — ünïcode ✓ 日本語",
    "import os, sys\nprint('hi there')\n",
] * 20


def _trained(kind: str) -> HFTokenizer:
    if kind == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence(
            [decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()]
        )
        alphabet = [f"<0x{i:02X}>" for i in range(256)]
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *alphabet])
    tok.train_from_iterator(CORPUS, trainer)
    return HFTokenizer(tok.to_str())


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace", "bytes"])
def test_pieces_concatenate_to_the_full_decode(kind):
    tok = ByteTokenizer() if kind == "bytes" else _trained(kind)
    rng = np.random.default_rng(0)
    for text in CORPUS[:3]:
        ids = tok.encode(text)
        for _ in range(3):
            cut = ids + rng.integers(0, 256, 5).tolist()  # junk tail: partial UTF-8 too
            s = _TextStream(tok, (), frozenset())
            out = "".join(s.push(t) for t in cut) + s.finish()
            assert out == tok.decode(cut)


def test_stop_strings_cut_before_the_first_match_across_pieces():
    tok = ByteTokenizer()
    ids = tok.encode("abc STOP def END ghi")
    s = _TextStream(tok, ("END", "STOP"), frozenset())
    pieces = []
    for t in ids:
        pieces.append(s.push(t))
        if s.stopped:
            break
    pieces.append(s.finish())
    assert "".join(pieces) == "abc " and s.stopped
    s = _TextStream(tok, ("zz",), frozenset({ord("d")}))
    out = "".join(s.push(t) for t in ids) + s.finish()
    assert out == "abc STOP ef END ghi"  # an end-of-sequence id is never text
