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
