"""Which chat template renders a conversation, and rendering it (sandboxed Jinja).

In order of preference: a request's own `chat_template` (vLLM's field), the server's
`--chat-template FILE`, the model's own template, and otherwise a built-in one: Gemma 3's turn
format for Gemma checkpoints that carry none (the default Gemma 3 270M is such a pretrained base
model), or a plain "role: content" transcript. A built-in template still answers, but the server
warns in its log and every chat response names its template in the `X-Chat-Template` header.
"""

from __future__ import annotations

import logging
import os

from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger(__name__)

HEADER = "X-Chat-Template"

PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")

_MAX_REQUEST_TEMPLATES = 16  # compiled per-request templates kept


class ChatTemplates:
    """The server's default template and its source; renders messages with it or a request's own."""

    def __init__(self, tokenizer, tokenizer_source: str | None, file: str | None = None):
        self.tokenizer = tokenizer
        if file is not None:
            with open(file) as f:
                self.template, self.source = f.read(), f"file:{os.path.basename(file)}"
        elif getattr(tokenizer, "chat_template", None):
            self.template, self.source = tokenizer.chat_template, tokenizer_source or "model"
        else:
            self.template, self.source = PLAIN_TEMPLATE, "builtin:plain"
        self.env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self.env.globals["raise_exception"] = _raise
        self._compiled: dict[str, object] = {}
        self._warned = False
        if self.builtin:
            log.warning("the model has no chat template of its own: chat requests use the built-in %r template "
                        "(pass --chat-template FILE for an instruction-tuned checkpoint, or use /v1/completions)",
                        self.source)

    @property
    def builtin(self) -> bool:
        return self.source.startswith("builtin:")

    def render(self, messages: list[dict], add_generation_prompt: bool = True, template: str | None = None,
               variables: dict | None = None) -> tuple[str, str]:
        """(the prompt text, the template's source). Raises ValueError when the template refuses
        the conversation or does not compile."""
        source = "request" if template is not None else self.source
        if template is None:
            template = self.template
            if self.builtin and not self._warned:
                self._warned = True
                log.warning("chat request rendered with the built-in %r template (the model has none)", source)
        tok = self.tokenizer
        try:
            compiled = self._compile(template)
            text = compiled.render(**(variables or {}), messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=getattr(tok, "bos_token", None) or "",
                                   eos_token=getattr(tok, "eos_token", None) or "")
        except Exception as e:  # noqa: BLE001 — a template refusing the conversation is the client's error
            raise ValueError(f"the chat template could not render these messages: {e}") from None
        return text, source

    def _compile(self, template: str):
        if template not in self._compiled:
            if len(self._compiled) > _MAX_REQUEST_TEMPLATES:
                self._compiled = {self.template: self._compiled.get(self.template)} if self.template in \
                    self._compiled else {}
            self._compiled[template] = self.env.from_string(template)
        return self._compiled[template]


def _raise(message):
    raise ValueError(message)
