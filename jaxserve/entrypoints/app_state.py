"""What the routes find in `request.app.state` (FastAPI's place for what an app shares):

    engine   the EngineClient (engine_client.py)
    metrics  its Metrics
    model    ServedModel: the served model's name, limits, tokenizer and chat templates
    options  ServerOptions: the API key, the body limit, the default max_tokens, the tool-call parser
    owns_engine  the app started its engine, so it stops it when it shuts down

`create_app` (api_server.py) fills them in once; handlers only read them.
"""

from __future__ import annotations

import dataclasses
import time

from jaxserve.engine.core_process import EngineInfo
from jaxserve.entrypoints.chat_template import ChatTemplates
from jaxserve.entrypoints.protocol import ApiError
from jaxserve.entrypoints.tool_parsers import PARSERS

DEFAULT_MAX_BODY_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """How the server treats requests, whatever the model."""

    api_key: str | None = None  # None: no Authorization header is asked for
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # past it: 413
    default_max_tokens: int | None = None  # a request's max_tokens when it sets none (within the context)
    trust_request_chat_template: bool = False  # render a request's own chat_template (else 400)
    tool_call_parser: str | None = None  # reads tool calls from replies: tool_choice "auto" (else 400)

    def __post_init__(self):
        d = self.default_max_tokens
        if d is not None and (not isinstance(d, int) or d < 1):
            raise ValueError(f"default_max_tokens must be an integer >= 1, got {d!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {self.tool_call_parser!r}")

    @property
    def auth(self) -> bool:
        return self.api_key is not None


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """The one model the server serves, as requests see it: its name, context, tokenizer, chat templates."""

    name: str
    info: EngineInfo
    templates: ChatTemplates
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @classmethod
    def of(cls, info: EngineInfo, name: str | None = None, chat_template: str | None = None) -> "ServedModel":
        """The model the engine reports in `info`, served as `name` (default: its own name)."""
        return cls(name or info.model_name, info, ChatTemplates(info.tokenizer, info.chat_template_source,
                                                                 chat_template))

    @property
    def tokenizer(self):
        return self.info.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    def check_model(self, body) -> None:
        """404 for a request that names another model."""
        if body.model is not None and body.model != self.name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {self.name!r}",
                           param="model", code="model_not_found")

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: pass token ids instead of text", param="prompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def truncate(self, ids: list[int], keep: int | None) -> list[int]:
        """The last `keep` tokens of a prompt (vLLM's truncate_prompt_tokens; -1: the context)."""
        if keep is None:
            return ids
        keep = self.max_model_len if keep == -1 else keep
        if keep < 1:
            raise ApiError(400, "truncate_prompt_tokens must be -1 or an integer >= 1", param="truncate_prompt_tokens")
        return ids[-keep:]

    def room(self, prompt_tokens: int) -> int:
        """The tokens the context leaves after `prompt_tokens` (at least 1: a prompt that fills
        the context is answered with the 400 that names both numbers)."""
        return max(1, self.max_model_len - prompt_tokens)
