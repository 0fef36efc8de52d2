"""Chat templates (disagg.openai.chat): found where transformers looks, rendered as transformers'
``apply_chat_template(..., add_generation_prompt=True)`` renders them (its output is the oracle)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagg.openai.chat import ChatTemplate
from disagg.openai.errors import ApiError
from disagg.openai.protocol import Message

CONVERSATIONS = [
    [Message("user", "What is the capital of France?")],
    [Message("system", "Answer in one word."), Message("user", "Capital of Italy?")],
    [
        Message("user", "naïve café — 日本語 🙂"),
        Message("assistant", "Bonjour"),
        Message("user", "And again"),
    ],
]


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_smollm2_template_renders_as_transformers_does(smollm2_dir: Path, conversation: int) -> None:
    from transformers import AutoTokenizer

    messages = CONVERSATIONS[conversation]
    template = ChatTemplate.find(smollm2_dir)
    assert template is not None, "SmolLM2's tokenizer_config.json has a chat template"
    expected = AutoTokenizer.from_pretrained(smollm2_dir).apply_chat_template(
        [m.as_dict() for m in messages], tokenize=False, add_generation_prompt=True
    )
    assert template.render(messages) == expected
    assert template.render(messages).endswith("<|im_start|>assistant\n")


def test_a_model_without_a_template_has_none(tiny_model_dir: Path) -> None:
    assert "chat_template" not in json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert ChatTemplate.find(tiny_model_dir) is None


def write_config(folder: Path, **config: object) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_special_tokens_and_template_sources(tmp_path: Path) -> None:
    source = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
    folder = write_config(
        tmp_path / "m",
        chat_template=[{"name": "tool_use", "template": "tools"}, {"name": "default", "template": source}],
        bos_token={"__type": "AddedToken", "content": "<s>"},
        eos_token="</s>",
    )
    template = ChatTemplate.find(folder)
    assert template is not None
    assert template.render([Message("user", "hi")]) == "<s>[user]hi</s>"
    (folder / "chat_template.jinja").write_text("jinja file: {{ messages[0].content }}")
    assert ChatTemplate.find(folder).render([Message("user", "hi")]) == "jinja file: hi"
    override = tmp_path / "override.jinja"
    override.write_text("{{ messages | length }} message{% if add_generation_prompt %}, your turn{% endif %}")
    assert ChatTemplate.find(folder, override).render([Message("user", "hi")]) == "1 message, your turn"


def test_template_refusing_a_conversation_is_a_bad_request(tmp_path: Path) -> None:
    refusing = "{{ raise_exception('first must be user') }}"
    folder = write_config(
        tmp_path / "m", chat_template=f"{{% if messages[0].role != 'user' %}}{refusing}{{% endif %}}ok"
    )
    template = ChatTemplate.find(folder)
    assert template.render([Message("user", "x")]) == "ok"
    with pytest.raises(ApiError) as info:
        template.render([Message("assistant", "x")])
    assert info.value.status == 400 and "first must be user" in info.value.message


def test_templates_run_sandboxed_with_tojson(tmp_path: Path) -> None:
    folder = write_config(tmp_path / "m", chat_template="{{ messages[0] | tojson }}")
    assert ChatTemplate.find(folder).render([Message("user", "é")]) == '{"role": "user", "content": "é"}'
    sneaky = write_config(tmp_path / "s", chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(ApiError):
        ChatTemplate.find(sneaky).render([Message("user", "x")])


def test_unreadable_configs_and_templates_are_refused_at_start(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json"):
        ChatTemplate.find(folder)
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate.find(write_config(tmp_path / "b", chat_template="{% for %}"))
