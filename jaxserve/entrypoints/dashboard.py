"""The live dashboard: hand-written HTML, CSS and JS in jaxserve/entrypoints/static/, served by the API process.

    GET /dashboard                   dashboard.html (told whether the server wants an API key)
    GET /dashboard/dashboard.js      polls GET /v1/engine/state 4 times a second; with its modules
        (api, charts, pool, slots, prompt .js) it draws the slots, the page pool, the queue and
        charts, and streams the answer to a prompt
    GET /dashboard/dashboard.css

`router` holds these routes, for create_app (api_server.py) to include. The page itself holds no
engine data, so it is served without the key; it asks for the key when the server has one and
sends it with every API call. A strict Content-Security-Policy lets the page load only its own
files and talk only to this server: it works offline, and nothing it shows can run as script.
"""

from __future__ import annotations

import importlib.resources

from fastapi import APIRouter, Request
from starlette.responses import Response

from jaxserve.entrypoints import openapi

JS, CSS = "text/javascript; charset=utf-8", "text/css; charset=utf-8"
# dashboard.js is the entry point; it imports the others as ES modules (no build step)
FILES = {"dashboard.css": CSS, "dashboard.js": JS, "api.js": JS, "charts.js": JS, "pool.js": JS, "prompt.js": JS,
         "slots.js": JS}
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def read(name: str) -> bytes:
    """One of the dashboard's files, from the installed package."""
    return (importlib.resources.files("jaxserve.entrypoints") / "static" / name).read_bytes()


_PAGES = {auth: read("dashboard.html").replace(b"{{AUTH}}", b"required" if auth else b"none")
          for auth in (False, True)}  # keyed by whether the server wants an API key

router = APIRouter()


@router.get("/dashboard", response_class=Response, responses=openapi.static_file(
    "text/html", "the live dashboard of the engine (slots, KV pages, queue, charts, a prompt form)"))
async def dashboard(request: Request):  # no docstring: it would become the operation's description
    return Response(_PAGES[request.app.state.options.auth], media_type="text/html; charset=utf-8", headers=HEADERS)


def _asset_route(name: str, media_type: str) -> None:
    body = read(name)

    @router.get(f"/dashboard/{name}", response_class=Response,
                responses=openapi.static_file(media_type.split(";")[0], f"the dashboard's {name}"))
    async def asset():
        return Response(body, media_type=media_type, headers=HEADERS)


for _name, _media_type in FILES.items():
    _asset_route(_name, _media_type)
