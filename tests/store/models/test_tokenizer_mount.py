"""A checkpoint's tokenizer.json travels with its trunk: mounted, verified, used, exported."""

from __future__ import annotations

from czyx.portals import open_consumer
from czyx.store import Store
from czyx.store.models.export import export
from czyx.store.models.mount import mount
from czyx.testing.tiny_models import make_tiny_checkpoint


def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    vocab["<unk>"] = 0
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str()


def test_tokenizer_is_mounted_and_exported(tmp_path):
    ckpt = make_tiny_checkpoint("mixtral", tmp_path / "ckpt")
    import json

    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    text = _tokenizer_json(vocab)
    (ckpt / "tokenizer.json").write_text(text)
    with Store.open(tmp_path / "s") as st:
        mount(st, ckpt, "tok@v1")
        with open_consumer(st, None, "tok@v1") as m:
            assert m.tokenizer_json() == text
            # The tokenizer is not a tensor: the engine's trunk roles never see it.
            assert not m.has_trunk("tokenizer")
        files = export(st, "tok@v1", tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").read_text() == text
    assert tmp_path / "out" / "tokenizer.json" in files


def test_tokenizer_changes_the_content_selector(tmp_path):
    ckpt = make_tiny_checkpoint("mixtral", tmp_path / "ckpt")
    with Store.open(tmp_path / "s") as st:
        plain = mount(st, ckpt, "a@v1").selector
        (ckpt / "tokenizer.json").write_text(_tokenizer_json(8))
        with_tok = mount(st, ckpt, "b@v1").selector
        with open_consumer(st, None, "a@v1") as m:
            assert m.tokenizer_json() is None
    assert plain != with_tok


def test_czyx_run_uses_the_mounted_tokenizer(tmp_path, capsys):
    from czyx.cli import main

    ckpt = make_tiny_checkpoint("mixtral", tmp_path / "ckpt")
    import json

    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    (ckpt / "tokenizer.json").write_text(_tokenizer_json(vocab))
    sd = str(tmp_path / "s")
    assert main(["mount", str(ckpt), "--as", "tok@v1", "--store", sd]) == 0
    argv = ["run", "tok@v1", "--prompt", "w3 w5 w7", "--max-tokens", "3", "--store", sd]
    assert main(argv) == 0
    assert "tokenizer: tokenizer.json" in capsys.readouterr().err
