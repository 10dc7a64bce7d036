"""GET /health (liveness for probes) and GET /metrics (Prometheus, the app's own registry).

/health's `degraded` lists one line per degraded mode this server runs in (a cache that cannot be
written, no native CPU library, a warm-up shape skipped after failing twice), each also logged once;
empty when everything runs as configured. Degraded modes do not make /health fail: it answers 503
only when the engine loop is dead or wedged ("unhealthy") or the server is shutting down."""
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
    # every degraded mode in one list, each as its log line says it: caches, native library, skipped warm-up
    h["degraded"] = h["runtime"]["degraded"] + [f"warm-up skipped {s}" for s in h["warmup_skipped"]]
    status = health_status(h)
    if status == "ok":
        return dict(h, status=status)
    return JSONResponse(dict(h, status=status), status_code=503,
                        headers=ctx.retry if status == "shutting_down" else None)


def health_status(h: dict) -> str:
    """"unhealthy" (the loop died while accepting, or a step is wedged), "shutting_down" (no longer
    accepting: draining, or the drain over and the process about to exit), or "ok"."""
    if h["wedged"]:
        return "unhealthy"
    if not h["accepting"]:
        return "shutting_down"
    return "ok" if h["loop_running"] else "unhealthy"


@router.get("/metrics")
async def metrics(request: Request):
    body, content_type = api_context(request).metrics.exposition(request.headers.get("accept"))
    return Response(body, media_type=content_type)
