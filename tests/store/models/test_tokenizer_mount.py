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


TOKENIZER_CONFIG = (
    '{\n  "chat_template": "{% for m in messages %}{{ m[\'content\'] }}{% endfor %}",\n'
    '  "eos_token": "</s>",\n  "model_max_length": 4096\n}\n'
)


def test_side_files_are_kept_and_exported_byte_identical(tmp_path):
    """Issues 16/19: generation_config.json and tokenizer_config.json travel with the
    trunk (verified records), come back byte for byte on export, and are content."""
    import os

    ckpt = make_tiny_checkpoint("mixtral", tmp_path / "ckpt")
    gen = (ckpt / "generation_config.json").read_bytes()  # written by transformers
    with Store.open(tmp_path / "s") as st:
        plain = mount(st, ckpt, "a@v1").selector
        (ckpt / "tokenizer_config.json").write_text(TOKENIZER_CONFIG)
        kept = mount(st, ckpt, "b@v1").selector
        with open_consumer(st, None, "b@v1") as m:
            assert m.side_file("tokenizer_config.json").decode() == TOKENIZER_CONFIG
            assert m.side_file("generation_config.json") == gen
            assert not m.has_trunk("tokenizer_config") and not m.has_trunk("generation_config")
        with open_consumer(st, None, "a@v1") as m:
            assert m.side_file("tokenizer_config.json") is None
            assert m.side_file("generation_config.json") == gen
        files = export(st, "b@v1", tmp_path / "out")
        export(st, "a@v1", tmp_path / "out_a")
    assert plain != kept  # the files are part of the content
    out = tmp_path / "out"
    assert (out / "tokenizer_config.json").read_text() == TOKENIZER_CONFIG
    assert (out / "generation_config.json").read_bytes() == gen
    assert {out / "tokenizer_config.json", out / "generation_config.json"} <= set(files)
    assert sorted(os.listdir(tmp_path / "out_a")) == sorted(
        n for n in os.listdir(ckpt) if n != "tokenizer_config.json"
    )


def test_a_side_file_that_is_not_a_regular_json_file_is_refused(tmp_path):
    import os

    import pytest

    from czyx.store.models.mount_errors import CheckpointError

    ckpt = make_tiny_checkpoint("mixtral", tmp_path / "ckpt")
    with Store.open(tmp_path / "s") as st:
        (ckpt / "tokenizer_config.json").write_text("{not json")
        with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: not JSON"):
            mount(st, ckpt, "a@v1")
        (ckpt / "tokenizer_config.json").unlink()
        (ckpt / "generation_config.json").unlink()
        os.mkfifo(ckpt / "generation_config.json")  # must be refused, not waited on
        with pytest.raises(CheckpointError, match=r"generation_config\.json: not a regular file"):
            mount(st, ckpt, "a@v1")
        assert "a@v1" not in st.tags()


def test_a_chat_template_jinja_is_kept_and_exported_byte_identical(tmp_path):
    """transformers 5 saves a chat template to chat_template.jinja: it travels with the
    trunk as tokenizer_config.json does, and a file that is not UTF-8 is refused."""
    import pytest

    from czyx.store.models.mount_errors import CheckpointError

    ckpt = make_tiny_checkpoint("mixtral", tmp_path / "ckpt")
    jinja = "{% for m in messages %}{{ m['content'] }}\u00e9{% endfor %}\n".encode()
    with Store.open(tmp_path / "s") as st:
        plain = mount(st, ckpt, "a@v1").selector
        (ckpt / "chat_template.jinja").write_bytes(jinja)
        kept = mount(st, ckpt, "b@v1").selector
        with open_consumer(st, None, "b@v1") as m:
            assert m.side_file("chat_template.jinja") == jinja
            assert not m.has_trunk("chat_template")
        with open_consumer(st, None, "a@v1") as m:
            assert m.side_file("chat_template.jinja") is None
        files = export(st, "b@v1", tmp_path / "out")
        (ckpt / "chat_template.jinja").write_bytes(b"{{ x }}\xff")
        with pytest.raises(CheckpointError, match=r"chat_template\.jinja: not UTF-8"):
            mount(st, ckpt, "c@v1")
        assert "c@v1" not in st.tags()
    assert plain != kept  # the file is part of the content
    assert (tmp_path / "out" / "chat_template.jinja").read_bytes() == jinja
    assert tmp_path / "out" / "chat_template.jinja" in files
