"""Chat messages -> one prompt string, through the model's chat template in a jinja2 sandbox.

The template comes from the model directory's `tokenizer_config.json` (`chat_template`: a
string, or a list of named templates whose "default" is used) or `chat_template.jinja`, and
is rendered by jinja2's `ImmutableSandboxedEnvironment`: a template can read the messages and
call the few helpers given here, never Python code from the model directory. A preset (or a
directory without a template) gets `DEFAULT_TEMPLATE`, plain role-tagged turns.
"""
from __future__ import annotations

import json
import os

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hetero_jax.outputs import RequestError

DEFAULT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def read_template(model_dir: str | None) -> str:
    """The chat template of a model directory (None, or none found: `DEFAULT_TEMPLATE`)."""
    if not model_dir:
        return DEFAULT_TEMPLATE
    jinja = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    path = os.path.join(model_dir, "tokenizer_config.json")
    if not os.path.isfile(path):
        return DEFAULT_TEMPLATE
    with open(path, encoding="utf-8") as f:
        template = json.load(f).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else DEFAULT_TEMPLATE


class ChatTemplate:
    """A compiled template; `render(messages)` -> the prompt text."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(source)
        self.special = dict(bos_token=bos_token, eos_token=eos_token)

    def render(self, messages: list, add_generation_prompt: bool = True) -> str:
        """`messages`: [{"role", "content": str}]. A template that fails -> RequestError."""
        try:
            return self.template.render(messages=messages,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.special)
        except TemplateError as e:
            raise RequestError(0, "messages", f"the chat template refused these messages: "
                                              f"{e}") from e


def special_tokens(tokenizer) -> dict:
    """The bos/eos strings a template may print (empty where the tokenizer has none)."""
    def text(name: str) -> str:
        value = getattr(tokenizer, name, "") if tokenizer is not None else ""
        return value if isinstance(value, str) else ""
    return dict(bos_token=text("bos_token"), eos_token=text("eos_token"))


def template_of(tokenizer) -> ChatTemplate:
    """The tokenizer's own chat template (transformers reads it from the model directory),
    else `DEFAULT_TEMPLATE`, with its special tokens."""
    source = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    return ChatTemplate(source if isinstance(source, str) else DEFAULT_TEMPLATE,
                        **special_tokens(tokenizer))


def _raise(message: str):
    raise TemplateError(message)
