"""The FastAPI app: routes, OpenAI-shaped errors, API-key check and shutdown.

``create_app(llm, config)`` serves one ``AsyncLLM``. Every error is answered as
``{"error": {"message", "type", "param", "code"}}``: 400 for invalid requests (``param`` names the
field, including pydantic's parse errors, which FastAPI would answer 422), 401 for a missing or
wrong API key, 404 for another model name, 429 when the waiting queue is full, 500 when the
request's engine step failed (the server and the other requests go on), 503 while shutting down.
The key guards ``/v1/*``; ``/health`` and ``/metrics`` stay open for probes and scrapers.
"""
from __future__ import annotations

import hmac
import logging
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from .chat import create_chat_completion
from .completions import create_completion
from .metrics import engine_snapshot
from .protocol import ApiError, ChatCompletionRequest, CompletionRequest
from .serving import ClientDisconnected, ServerConfig, ServerState

logger = logging.getLogger("hybrid_engine.server")


def create_app(llm, config: ServerConfig) -> FastAPI:
    state = ServerState(llm, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # in-flight requests have finished or were aborted (ServerState.start_draining); stop the engine
        state.close()
        logger.info("engine shut down")

    app = FastAPI(title="hybrid-engine", lifespan=lifespan)
    app.state.server = state

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        if e.status != 500:
            state.metrics.reject(e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        msg = f"{param}: {first.get('msg', 'invalid request')}" if param else first.get("msg", "invalid request")
        return await _api_error(request, ApiError(400, msg, param=param))

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        logger.error("unhandled error serving %s", request.url.path, exc_info=e)
        return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").body(),
                            status_code=500)

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, e: ClientDisconnected):
        return Response(status_code=499)        # nobody reads it: the client has gone

    async def check_key(request: Request) -> None:
        key = config.api_key
        if key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    v1 = [Depends(check_key)]

    @app.post("/v1/completions", dependencies=v1)
    async def completions(req: CompletionRequest, request: Request):
        return await create_completion(state, req, request)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await create_chat_completion(state, req, request)

    @app.get("/v1/models", dependencies=v1)
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": state.created,
                                            "owned_by": "hybrid-engine", "max_model_len": state.max_model_len}]}

    @app.get("/health")
    async def health():
        snap = engine_snapshot(llm)
        ok = not state.closing
        return JSONResponse({"status": "ok" if ok else "shutting_down", **snap}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        data, ctype = state.metrics.render()
        return Response(data, media_type=ctype)

    return app
