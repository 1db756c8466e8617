"""Chat messages to a prompt, with the chat template of the model's own tokenizer_config.json."""

from __future__ import annotations

import json
import os
from datetime import datetime


class ChatTemplate:
    """The Jinja chat template of a Hugging Face model folder, rendered in a sandbox."""

    def __init__(self, template: str, bos_token: str = "", eos_token: str = ""):
        from jinja2 import StrictUndefined
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise ValueError(f"messages: the chat template refuses them: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=StrictUndefined,
                                           extensions=["jinja2.ext.loopcontrols"])
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: datetime.now().strftime(fmt))
        self._template = env.from_string(template)
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        from jinja2 import UndefinedError

        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token, tools=None)
        except UndefinedError as e:
            raise ValueError(f"messages: the chat template needs something the request lacks ({e})") from None

    @classmethod
    def from_folder(cls, folder: str | None) -> "ChatTemplate | None":
        """The template of tokenizer_config.json (or chat_template.jinja) in `folder`; None without one."""
        if not folder:
            return None
        config_path = os.path.join(folder, "tokenizer_config.json")
        config = {}
        if os.path.exists(config_path):
            with open(config_path) as f:
                config = json.load(f)
        jinja_path = os.path.join(folder, "chat_template.jinja")
        if not config.get("chat_template") and os.path.exists(jinja_path):
            with open(jinja_path) as f:
                config = {**config, "chat_template": f.read()}
        return cls.from_config(config)

    @classmethod
    def from_config(cls, config: dict) -> "ChatTemplate | None":
        """The template of a tokenizer_config.json's contents; None without one."""
        template = config.get("chat_template")
        if isinstance(template, list):                 # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if not template:
            return None

        def token(name: str) -> str:
            value = config.get(name) or ""
            return value.get("content", "") if isinstance(value, dict) else value

        return cls(template, token("bos_token"), token("eos_token"))

    @classmethod
    def for_tokenizer(cls, tokenizer, model_dir: str | None = None) -> "ChatTemplate | None":
        """The template that came with `tokenizer` (its tokenizer_config), else the one in model_dir."""
        config = getattr(tokenizer, "config", None)
        found = cls.from_config(config) if isinstance(config, dict) else None
        return found or cls.from_folder(getattr(tokenizer, "folder", None) or model_dir)
