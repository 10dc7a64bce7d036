"""GET /v1/models, GET /v1/models/{name}; adapter admin: POST /v1/adapters, DELETE /v1/adapters/{name}."""
from __future__ import annotations

import os
import time

import anyio
from fastapi import APIRouter, Request

from serve import protocol
from serve.access import check_admin, check_api_key, resolve_adapter_path
from serve.api.common import api_context, log, unknown_model
from serve.api.formatting import model_entry
from serve.errors import AdapterExistsError, AdapterLoadError
from serve.protocol import BadRequest
from serve.registry import check_adapter_name

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request):
    ctx = api_context(request)
    check_api_key(ctx.config, request.headers)
    data = [model_entry(ctx.model_id, "base", ctx.created, ctx.model_id)]
    data += [model_entry(n, k, ctx.created, ctx.model_id) for n, k in sorted(ctx.registry.names().items())]
    return {"object": "list", "data": data}


@router.get("/v1/models/{name}")
async def get_model(name: str, request: Request):
    ctx = api_context(request)
    check_api_key(ctx.config, request.headers)
    if name == ctx.model_id:
        return model_entry(ctx.model_id, "base", ctx.created, ctx.model_id)
    kinds = ctx.registry.names()
    if name not in kinds:
        raise unknown_model(name, None)
    return model_entry(name, kinds[name], ctx.created, ctx.model_id)


@router.post("/v1/adapters")
async def load_adapter(request: Request):
    ctx = api_context(request)
    config, registry = ctx.config, ctx.registry
    check_admin(config, request.headers)
    body = protocol.parse_json(await request.body())
    name = check_adapter_name(protocol.get(body, "name", str))
    path = protocol.get(body, "path", str)
    if name == ctx.model_id:
        raise BadRequest(f"adapter name must differ from the base model id {ctx.model_id!r}", "name")
    if name in registry:
        raise AdapterExistsError(f"adapter {name!r} is already loaded; unload it first")
    real, rel = resolve_adapter_path(config, path)
    t0 = time.monotonic()
    try:
        kind = await anyio.to_thread.run_sync(registry.load, name, real)
    except AdapterLoadError as e:
        ctx.metrics.adapter_loads.labels("failed").inc()
        root = os.path.realpath(config.adapter_root) + os.sep
        raise AdapterLoadError(str(e).replace(real, rel).replace(root, ""), "path") from None
    ctx.metrics.adapter_loads.labels("ok").inc()
    log.info("loaded adapter %r (%s) from %s in %.2f s", name, kind, rel, time.monotonic() - t0)
    return {"object": "adapter", "id": name, "name": name, "kind": kind, "path": rel}


@router.delete("/v1/adapters/{name}")
async def unload_adapter(name: str, request: Request):
    ctx = api_context(request)
    check_admin(ctx.config, request.headers)
    ctx.registry.unload(name)           # UnknownAdapterError 404, AdapterInUseError 409
    return {"object": "adapter", "id": name, "deleted": True}
