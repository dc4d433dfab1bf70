"""Every error the app answers, in the OpenAI envelope `{"error": {"message", "type", "param", "code"}}`:

    ApiError (raised by handlers)          ─► its status, counted in jaxserve_requests_rejected
    Starlette's HTTPException (404, 405)   ─► its status, as invalid_request_error
    anything else                          ─► 500 server_error, logged, so no request takes the server down
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxserve.entrypoints.protocol import ApiError, error_body

log = logging.getLogger(__name__)


def add_error_handlers(app: FastAPI) -> None:
    """Answers `app`'s errors in the envelope; the counts go to `app.state.metrics`."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)


async def _api_error(request: Request, e: ApiError) -> JSONResponse:
    request.app.state.metrics.rejected.labels(status=str(e.status)).inc()
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), e.status, headers=e.headers)


async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(error_body(str(e.detail), "invalid_request_error"), e.status_code, headers=e.headers)


async def _unexpected(request: Request, e: Exception) -> JSONResponse:
    log.exception("unhandled error in %s", request.url.path)
    request.app.state.metrics.rejected.labels(status="500").inc()
    return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), 500)
