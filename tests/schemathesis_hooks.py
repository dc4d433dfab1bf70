"""Schemathesis hooks for tests/test_server_clients.py: drop generated bodies that break the
cross-field rules that no JSON schema can state, and that the server rightly answers with 400.

- prompt tokens plus max_tokens must fit the context (JAXSERVE_TEST_MAX_MODEL_LEN);
- prompts x n must not exceed 256 choices;
- `echo` with `logprobs`, and `top_logprobs` without `logprobs`, are refused;
- a request's own `chat_template` may render to nothing;
- a constraint on the output (`structured_outputs`, a JSON `response_format`, `tools`) must be a
  valid schema, regex or grammar, and only one of them may be given: no JSON schema says that.
The estimate of prompt tokens is an upper bound for the tests' tokenizer (at most two tokens per
character: a word-start marker and the character), so only bodies that might overflow are dropped.
"""

from __future__ import annotations

import os

import schemathesis

MAX_MODEL_LEN = int(os.environ.get("JAXSERVE_TEST_MAX_MODEL_LEN", "256"))


def _tokens(prompt) -> list[int]:
    """Upper bounds of each prompt's token count."""
    if isinstance(prompt, str):
        return [2 * len(prompt) + 2]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [2 * len(p) + 2 for p in prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return [len(p) for p in prompt]
    if isinstance(prompt, list):
        return [len(prompt)]
    return [0]


@schemathesis.hook
def filter_case(context, case) -> bool:
    """Every phase (coverage, fuzzing) passes its cases through here."""
    return _fits(case.body)


def _constrained(body: dict) -> bool:
    fmt = body.get("response_format")
    return (body.get("structured_outputs") is not None or body.get("tools") not in (None, [])
            or body.get("tool_choice") not in (None, "none", "auto")
            or (isinstance(fmt, dict) and fmt.get("type") not in (None, "text")))


def _fits(body) -> bool:
    if not isinstance(body, dict):
        return True
    if _constrained(body):
        return False
    n = body.get("n") if isinstance(body.get("n"), int) else 1
    if body.get("top_logprobs") is not None and not body.get("logprobs"):
        return False
    if "messages" in body:  # chat
        if body.get("chat_template") is not None:
            return False
        messages = body["messages"] if isinstance(body["messages"], list) else []
        chars = sum(len(str(m.get("content") or "")) + len(str(m.get("role") or "")) + 16
                    for m in messages if isinstance(m, dict))
        wanted = body.get("max_completion_tokens") or body.get("max_tokens") or 0
        return not isinstance(wanted, (int, float)) or 2 * chars + 16 + wanted <= MAX_MODEL_LEN
    prompt = body.get("prompt")
    if body.get("echo") and body.get("logprobs") is not None:
        return False
    counts = _tokens(prompt)
    if len(counts) * n > 256:
        return False
    wanted = body.get("max_tokens")
    wanted = 16 if wanted is None else wanted
    if not isinstance(wanted, (int, float)):
        return True
    keep = body.get("truncate_prompt_tokens")
    if isinstance(keep, int) and keep >= 1:
        counts = [min(c, keep) for c in counts]
    return max(counts) + wanted <= MAX_MODEL_LEN
