"""The ASGI app of `jaxserve serve` while its engine starts, so the port answers from the first
second: `/health` (and every other path) says 503 with the start-up's progress, in the OpenAI
error envelope with a `startup` field, until the engine is ready; then every request goes to the
real app.

    uvicorn ─► StartingApp ─► 503 {"error": ..., "startup": {"phase": "compiling", "done": 12, "total": 33}}
                          └─► (once `app` is set) the FastAPI app of jaxserve.entrypoints.api_server
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from jaxserve.entrypoints.protocol import error_body


class StartingApp:
    def __init__(self, client):
        self.client = client  # an EngineClient whose engine is starting; its `startup` is the progress
        self.app = None  # the real app, once the engine is ready
        self.failed: str | None = None  # why the engine did not start, or why its restarts gave up

    async def __call__(self, scope, receive, send):
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] == "lifespan":  # the real app's lifespan has nothing to start or stop here
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        state = dict(self.client.startup)
        if self.failed:
            message, state = self.failed, {"phase": "failed"}  # a sentence: "the engine did not start: ..."
        elif state.get("phase") == "compiling":
            message = f"the engine is starting: compiling step programs ({state['done']} of {state['total']})"
        else:
            message = f"the engine is starting ({state.get('phase', 'starting')})"
        body = error_body(message, "server_error", code="engine_starting") | {"startup": state}
        await JSONResponse(body, 503, headers={"Retry-After": "1"})(scope, receive, send)
