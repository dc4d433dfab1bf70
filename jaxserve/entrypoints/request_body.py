"""A request's body as its pydantic model: a 413 past the server's max_body_bytes, a 400 naming the
field for what does not validate.

A body over `PARSE_APART_BYTES` is validated in a worker process (`worker_processes.py`). On the
API process's event loop, validating a JSON schema of 500 kB (13,000 properties) held the GIL for
11-15 ms, and pickling its objects for the constraint's check 5 ms more: every stream stopped for
one gap that long (docs/serving.md). The worker hands the model back with its JSON schemas as text,
which pickles as one string; `StructuredOutputs` reads a schema as text or as an object alike.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from jaxserve.entrypoints.offload import TIME_LIMIT_S, off_loop, over_time_limit
from jaxserve.entrypoints.protocol import ApiError, describe
from jaxserve.entrypoints.worker_processes import WorkerProcesses

PARSE_APART_BYTES = 64 << 10  # bodies larger than this are validated in a worker process
PARSERS = 2  # worker processes that validate large bodies
_parsers = WorkerProcesses(PARSERS, "jaxserve-parse")


async def parsed_body(request: Request, model: type[BaseModel]) -> BaseModel:
    """The request's body validated as `model` (ApiError 413 or 400)."""
    body = await _read(request)
    if len(body) <= PARSE_APART_BYTES:
        return validated(model, body)
    what = "validating the request body"

    def parse():
        try:
            ok, outcome = _parsers.call(_validated_apart, (model, body), TIME_LIMIT_S, what)
        except TimeoutError:  # its worker killed
            raise over_time_limit(what) from None
        if not ok:
            message, param = outcome
            raise ApiError(400, message, param=param)
        return outcome
    return await off_loop(parse, what=what)


def validated(model: type[BaseModel], body: bytes) -> BaseModel:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        message, param = describe(e, model)
        raise ApiError(400, message, param=param)


def schemas_as_text(request: BaseModel) -> BaseModel:
    """The request with the JSON schemas of `structured_outputs.json` and
    `response_format.json_schema.schema` as JSON text (changed in place)."""
    so = getattr(request, "structured_outputs", None)
    if so is not None and isinstance(so.json_, dict):
        so.json_ = json.dumps(so.json_)
    fmt = getattr(request, "response_format", None)
    if fmt is not None and fmt.json_schema is not None and isinstance(fmt.json_schema.schema_, dict):
        fmt.json_schema.schema_ = json.dumps(fmt.json_schema.schema_)
    return request


def _validated_apart(model: type[BaseModel], body: bytes):
    """In a worker: (True, the model with its schemas as text), or (False, (message, param))."""
    try:
        return True, schemas_as_text(validated(model, body))
    except ApiError as e:
        return False, (e.message, e.param)


async def _read(request: Request) -> bytes:
    max_bytes = request.app.state.options.max_body_bytes
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise ApiError(413, f"the request body ({length} bytes) exceeds the limit of {max_bytes} bytes",
                       code="body_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise ApiError(413, f"the request body exceeds the limit of {max_bytes} bytes",
                               code="body_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(400, "the client disconnected while sending the body")
    return b"".join(chunks)
