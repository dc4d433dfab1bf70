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

from jaxserve.entrypoints.template_sandbox import TemplateSandbox, environment

log = logging.getLogger(__name__)

HEADER = "X-Chat-Template"

PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")


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
        self.env = environment()
        self._compiled = None  # compiled when first used: one that does not compile fails chat requests only
        self.sandbox = TemplateSandbox()  # requests' own templates
        self._warned = False
        if self.builtin:
            log.warning("the model has no chat template of its own: chat requests use the built-in %r template "
                        "(pass --chat-template FILE for an instruction-tuned checkpoint, or use /v1/completions)",
                        self.source)

    @property
    def builtin(self) -> bool:
        return self.source.startswith("builtin:")

    def render(self, messages: list[dict], add_generation_prompt: bool = True, template: str | None = None,
               variables: dict | None = None, timeout: float = 10.0) -> tuple[str, str]:
        """(the prompt text, the template's source). Raises ValueError when the template refuses
        the conversation or does not compile; a request's own template renders in a worker
        process (`template_sandbox`), TimeoutError past `timeout` seconds."""
        tok = self.tokenizer
        variables = {**(variables or {}), "messages": messages, "add_generation_prompt": add_generation_prompt,
                     "bos_token": getattr(tok, "bos_token", None) or "",
                     "eos_token": getattr(tok, "eos_token", None) or ""}
        if template is not None:
            return self.sandbox.render(template, variables, timeout), "request"
        if self.builtin and not self._warned:
            self._warned = True
            log.warning("chat request rendered with the built-in %r template (the model has none)", self.source)
        try:
            self._compiled = self._compiled or self.env.from_string(self.template)
            return self._compiled.render(**variables), self.source
        except Exception as e:  # noqa: BLE001 — a template refusing the conversation is the client's error
            raise ValueError(f"the chat template could not render these messages: {e}") from None

