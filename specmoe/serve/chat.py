"""The model's chat template, rendered with jinja2 the way transformers renders it.

Where the template comes from: `chat_template.jinja` in the checkpoint directory if present,
else `chat_template` in tokenizer_config.json (a string, or a list of {name, template} of which
the one named "default" is used). Rendering matches transformers' `apply_chat_template`: a
sandboxed jinja2 environment with trim_blocks and lstrip_blocks and the loop-controls extension,
a `tojson` filter that keeps non-ASCII text, the globals `raise_exception` and `strftime_now`,
and the variables `messages`, `add_generation_prompt` and the tokenizer's special tokens
(`bos_token`, `eos_token`, ...). The rendered text already holds the special tokens the template
writes, so it is tokenized without adding the tokenizer's own (no second BOS).
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from specmoe.errors import CheckpointError

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def template_source(model_dir: Path, tokenizer_config: dict) -> str | None:
    f = Path(model_dir) / "chat_template.jinja"
    if f.is_file():
        return f.read_text(encoding="utf-8")
    t = tokenizer_config.get("chat_template")
    if isinstance(t, list):
        named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
        t = named.get("default")
    if t is not None and not isinstance(t, str):
        raise CheckpointError(f"{model_dir}/tokenizer_config.json: chat_template must be a string or a list of "
                              "{name, template} objects")
    return t


class ChatTemplate:
    def __init__(self, source: str, tokenizer_config: dict):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._errors = (jinja2.exceptions.TemplateError,)
        try:
            self.template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise CheckpointError(f"the chat template does not parse: {e}") from None
        self.special = {}
        for k in SPECIAL_KEYS:
            v = tokenizer_config.get(k)
            v = v.get("content") if isinstance(v, dict) else v
            if isinstance(v, str):
                self.special[k] = v

    @classmethod
    def load(cls, llm) -> "ChatTemplate | None":
        """The LLM's model's template, or None when it has none (or no tokenizer)."""
        if llm.tokenizer is None:
            return None
        src = template_source(llm.path, llm.tokenizer.config)
        return cls(src, llm.tokenizer.config) if src else None

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text; a template error (e.g. its raise_exception on an unsupported role) is a 400
        naming `messages`."""
        from specmoe.serve.protocol import bad
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        tools=None, documents=None, **self.special)
        except self._errors as e:
            raise bad("messages", f"the chat template refused the messages: {e}") from None
