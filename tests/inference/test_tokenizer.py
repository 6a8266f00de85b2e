"""Tokenizers: the byte fallback, a checkpoint's tokenizer.json, streaming decode."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from czyx.inference.errors import TokenizerError
from czyx.inference.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    StreamDecoder,
    load_tokenizer,
    tokenizer_for,
)


@given(text=st.text())
def test_bytes_round_trip(text):
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text)) == text


@given(text=st.text())
def test_streaming_emits_only_whole_characters(text):
    tok = ByteTokenizer()
    stream = StreamDecoder(tok)
    pieces = [stream.push(t) for t in tok.encode(text)]
    assert all("\ufffd" not in p for p in pieces if "\ufffd" not in text)
    assert "".join(pieces) + stream.flush() == text


def test_byte_tokenizer_needs_256_ids():
    with pytest.raises(TokenizerError):
        ByteTokenizer(100)


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])
    return tok.to_str()


def test_checkpoint_tokenizer_json_is_used(tmp_path):
    (tmp_path / "tokenizer.json").write_text(_tokenizer_json())
    tok = load_tokenizer(tmp_path, vocab_size=4)
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world") == [2, 3]
    assert tok.eos_ids == (1,)
    assert tok.decode([2, 1, 3]) == "hello world"
    assert isinstance(load_tokenizer(_tokenizer_json(), 4), HFTokenizer)


def test_directory_without_tokenizer_falls_back_to_bytes(tmp_path):
    assert isinstance(load_tokenizer(tmp_path, 300), ByteTokenizer)
    assert isinstance(load_tokenizer(None, 256), ByteTokenizer)


def test_broken_tokenizer_json_is_a_typed_error():
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        HFTokenizer('{"not": "a tokenizer"}')


def test_a_missing_path_or_a_bad_mounted_tokenizer_never_falls_back_to_bytes(tmp_path):
    with pytest.raises(TokenizerError, match="no such file"):
        load_tokenizer(tmp_path / "nope" / "tokenizer.json", 256)

    class Consumer:
        def __init__(self, text):
            self.text = text

        def tokenizer_json(self):
            return self.text

    with pytest.raises(TokenizerError):
        tokenizer_for(Consumer("\ufeff" + _tokenizer_json()), 256)  # not JSON at its start
    assert isinstance(tokenizer_for(Consumer(_tokenizer_json()), 4), HFTokenizer)
    assert isinstance(tokenizer_for(Consumer(None), 256), ByteTokenizer)
    assert isinstance(tokenizer_for(object(), 256), ByteTokenizer)
