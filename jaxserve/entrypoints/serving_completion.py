"""POST /v1/completions: text or token-id prompts (one or a list), each answered by n choices of
text, optionally after the prompt (`echo`), with OpenAI's legacy logprobs.

    body ─► prompts as token ids (tokenized, truncated) ─► max_tokens (default 16, or the
    server's default within the context) ─► SamplingParams ─► CompletionServing (serving.py)
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from jaxserve.entrypoints.choice import Choice
from jaxserve.entrypoints.constraints import checked_constraint
from jaxserve.entrypoints.offload import off_loop
from jaxserve.entrypoints.protocol import ApiError, CompletionRequest
from jaxserve.entrypoints.serving import Serving, sampling_params

OPENAI_MAX_TOKENS = 16  # OpenAI's default for a completion that sets no max_tokens


async def create_completion(http_request: Request, body: CompletionRequest, arrival: float) -> Response:
    """Answers a parsed completion request (400 / 404 / 429 / 503 before any byte is sent)."""
    state = http_request.app.state
    model, default_max_tokens = state.model, state.options.default_max_tokens
    model.check_model(body)
    texts = _prompts(body.prompt)
    if body.echo and body.logprobs is not None:
        raise ApiError(400, "echo with logprobs is not supported (prompt logprobs are not computed)",
                       param="echo")
    add_special = body.add_special_tokens is not False
    prompts, echo = await off_loop(_tokenize, model, texts, add_special, body, what="tokenizing the prompt",
                                   param="prompt")
    max_tokens = body.max_tokens
    if max_tokens is None:
        max_tokens = (min(default_max_tokens, model.room(max(map(len, prompts)))) if default_max_tokens
                      else OPENAI_MAX_TOKENS)
    structured = (await checked_constraint(body, chat=False))[0]
    params = sampling_params(body, max_tokens, body.logprobs, model.info.vocab_size, structured)
    return await CompletionServing(http_request, body, prompts, params, echo, arrival).respond()


def _tokenize(model, texts: list, add_special: bool, body: CompletionRequest) -> tuple[list, list[str]]:
    """Each prompt's token ids (truncated as asked), and its text when it is echoed."""
    prompts = [model.truncate(model.encode(p, add_special) if isinstance(p, str) else p, body.truncate_prompt_tokens)
               for p in texts]
    tokenizer = model.tokenizer
    echo = [(p if isinstance(p, str) else tokenizer.decode(p) if tokenizer else "") if body.echo else ""
            for p in texts]
    return prompts, echo


def _prompts(prompt) -> list:
    """A list of prompts, each a string or a list of token ids."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ApiError(400, "prompt must not be empty", param="prompt")
    return prompts


class CompletionServing(Serving):
    """A completion's choices: `text` (after the echoed prompt) and legacy logprobs."""

    ID_PREFIX, OBJECT, CHUNK_OBJECT = "cmpl", "text_completion", "text_completion"

    def __init__(self, http_request: Request, body: CompletionRequest, prompts: list[list[int]], params,
                 echo: list[str], arrival: float):
        """`echo`: per prompt, the text to put before its choices ("" for none)."""
        super().__init__(http_request, body, prompts, params, body.logprobs is not None, arrival)
        self.echo = [e for e in echo for _ in range(body.n)]

    def final_choice(self, index: int) -> dict:
        c = self.choices[index]
        return {"index": index, "text": self.echo[index] + c.final_text, "finish_reason": c.finish_reason,
                "logprobs": _logprobs(c, 0, c.num_tokens) if self.logprobs else None}

    def delta_choice(self, index: int, text: str, start: int, end: int) -> dict:
        c = self.choices[index]
        logprobs = _logprobs(c, start, end, len(self.echo[index])) if self.logprobs else None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}

    def opening_choice(self, index: int) -> dict | None:
        if not self.echo[index]:
            return None
        return {"index": index, "text": self.echo[index], "logprobs": None, "finish_reason": None}


def _logprobs(c: Choice, start: int, end: int, base: int = 0) -> dict:
    """OpenAI's legacy logprobs of tokens start..end; text offsets count from `base`."""
    return {"tokens": c.pieces[start:end], "token_logprobs": c.logprobs[start:end],
            "top_logprobs": [_first_of_each(top) for top in c.tops[start:end]],
            "text_offset": [base + o for o in c.offsets[start:end]]}


def _first_of_each(top: list[tuple[str, float]]) -> dict[str, float]:
    """{text: logprob}, best first; tokens that print the same text keep the likeliest one."""
    out: dict[str, float] = {}
    for text, logprob in top:
        out.setdefault(text, logprob)
    return out
