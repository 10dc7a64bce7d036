"""GET /health (liveness for probes) and GET /metrics (Prometheus, the app's own registry)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from preft_jax.cache import status as runtime_status
from serve.api.common import api_context

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    ctx = api_context(request)
    h = ctx.engine.health()
    h.update(model=ctx.model_id, adapters=len(ctx.registry.names()), adapters_draining=len(ctx.registry.draining()),
             adapter_slots=ctx.registry.capacity,
             runtime=runtime_status())       # caches and native library; "degraded": one line per mode
    if h["wedged"] or not h["loop_running"]:
        return JSONResponse(dict(h, status="unhealthy"), status_code=503)
    if not h["accepting"]:
        return JSONResponse(dict(h, status="shutting_down"), status_code=503, headers=ctx.retry)
    return dict(h, status="ok")


@router.get("/metrics")
async def metrics(request: Request):
    body, content_type = api_context(request).metrics.exposition(request.headers.get("accept"))
    return Response(body, media_type=content_type)
