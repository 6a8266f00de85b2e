"""Chat templates render exactly as transformers renders them (its own function is the
reference), and fail closed on a config without one or a template that raises."""

from __future__ import annotations

import json

import pytest

from czyx.server.template import TemplateError, from_tokenizer_config, load_template

# A ChatML-style template exercising trim/lstrip blocks, loop controls, tojson,
# namespace-free conditionals and raise_exception.
CHATML = """{% for message in messages %}
{% if message['role'] not in ['system', 'user', 'assistant'] %}
{{ raise_exception('bad role ' + message['role']) }}
{% endif %}
{% if loop.index0 > 8 %}{% break %}{% endif %}
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}
{% endfor %}
{% if add_generation_prompt %}
{{ '<|im_start|>assistant\\n' }}
{% endif %}
{{ bos_token }}{{ {'k': 'é<>'} | tojson }}"""

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say <hi> & bye"},
    {"role": "assistant", "content": "hi"},
    {"role": "user", "content": "again"},
]


def test_rendering_matches_transformers():
    from transformers.utils.chat_template_utils import render_jinja_template

    cfg = {"chat_template": CHATML, "bos_token": "<s>", "eos_token": {"content": "</s>"}}
    tpl = from_tokenizer_config(cfg)
    assert tpl.eos_token == "</s>"
    for gen in (True, False):
        want, _ = render_jinja_template(
            conversations=[MESSAGES],
            chat_template=CHATML,
            add_generation_prompt=gen,
            bos_token="<s>",
            eos_token="</s>",
        )
        assert tpl.render(MESSAGES, add_generation_prompt=gen) == want[0]


def test_named_templates_files_and_refusals(tmp_path):
    cfg = {"chat_template": [{"name": "default", "template": "{{ messages[0]['content'] }}"}]}
    p = tmp_path / "tokenizer_config.json"
    p.write_text(json.dumps(cfg))
    assert load_template(tmp_path).render([{"role": "user", "content": "x"}]) == "x"
    j = tmp_path / "t.jinja"
    j.write_text("[{{ messages | length }}]")
    assert load_template(j).render(MESSAGES) == "[4]"
    (tmp_path / "none.json").write_text("{}")
    with pytest.raises(TemplateError, match="no chat_template"):
        load_template(tmp_path / "none.json")
    with pytest.raises(TemplateError, match="no such file"):
        load_template(tmp_path / "missing.json")
    with pytest.raises(TemplateError):
        from_tokenizer_config({"chat_template": "{% if %}"})
    with pytest.raises(TemplateError, match="bad role"):
        from_tokenizer_config({"chat_template": CHATML}).render([{"role": "tool", "content": ""}])


def _save_transformers_tokenizer(path, template: str) -> None:
    """A tokenizer saved by transformers itself, with ``template`` as its chat template
    (transformers 5 writes it to chat_template.jinja, not into tokenizer_config.json)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hi": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = template
    fast.save_pretrained(path)


def _transformers_render(path, gen: bool) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)


def test_a_checkpoint_saved_by_transformers_5_renders_as_transformers_loads_it(tmp_path):
    _save_transformers_tokenizer(tmp_path, CHATML)
    assert (tmp_path / "chat_template.jinja").read_text() == CHATML
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    for path in (tmp_path, tmp_path / "tokenizer_config.json", tmp_path / "chat_template.jinja"):
        tpl = load_template(path)
        assert tpl.eos_token == "</s>"  # the config's special tokens, whichever file named
        for gen in (True, False):
            assert tpl.render(MESSAGES, add_generation_prompt=gen) == _transformers_render(
                tmp_path, gen
            )


def test_chat_template_jinja_takes_priority_over_the_config_as_in_transformers(tmp_path):
    _save_transformers_tokenizer(tmp_path, CHATML)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = "{{ 'from the config' }}"
    cfg_path.write_text(json.dumps(cfg))
    want = _transformers_render(tmp_path, True)
    assert want.startswith("<|im_start|>system")  # transformers took the .jinja file
    assert load_template(tmp_path).render(MESSAGES) == want
    tpl = from_tokenizer_config(cfg, (tmp_path / "chat_template.jinja").read_text())
    assert tpl.render(MESSAGES) == want
    # The config alone, named by path, is that file's template.
    assert load_template(cfg_path).render(MESSAGES) == "from the config"


def test_template_files_that_are_not_text_or_json_are_refused(tmp_path):
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(TemplateError, match="not UTF-8"):
        load_template(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }}")
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(TemplateError, match="not a JSON object"):
        load_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert load_template(tmp_path).render(MESSAGES) == "4"
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(TemplateError, match="no chat_template"):
        load_template(tmp_path)
