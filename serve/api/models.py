"""GET /v1/models, GET /v1/models/{name} (each adapter with its serving position policy); adapter
admin: POST /v1/adapters, DELETE /v1/adapters/{name}.

DELETE drains (as vLLM and SGLang unload): the name is gone at once (new requests for it get 404
`model_not_found`, it leaves /v1/models), requests already holding it (running or queued) finish on
it, and the last one unloads it. The answer is 200 `"state": "unloaded"` when nothing held it, else
202 `"state": "draining"` with `in_use`; asking again answers the state again, and 404 once it has
unloaded. Loading the same name while it drains is a 409 `adapter_in_use`. Names a folder in
`--adapter-dir` provides are managed on disk: POST and DELETE of them are both 409 `adapter_in_adapter_dir`.
"""
from __future__ import annotations

import time

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from serve import protocol
from serve.access import check_admin, check_api_key, resolve_adapter_path
from serve.api.common import api_context, log, unknown_model
from serve.api.formatting import model_entry
from serve.errors import AdapterLoadError
from serve.protocol import BadRequest
from serve.registry import check_adapter_name

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request):
    ctx = api_context(request)
    check_api_key(ctx.config, request.headers)
    data = [model_entry(ctx.model_id, "base", ctx.created, ctx.model_id)]
    policies = ctx.registry.policies()
    data += [model_entry(n, k, ctx.created, ctx.model_id, policies.get(n))
             for n, k in sorted(ctx.registry.names().items())]
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
    return model_entry(name, kinds[name], ctx.created, ctx.model_id, ctx.registry.policies().get(name))


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
    registry.check_loadable(name)                 # 409s before the path is looked at
    real, rel = resolve_adapter_path(config, path)
    t0 = time.monotonic()
    try:
        kind = await anyio.to_thread.run_sync(registry.load, name, real, config.adapter_root)
    except AdapterLoadError as e:                  # the client gets e.public_message (no paths, no file contents)
        ctx.metrics.adapter_loads.labels("failed").inc()
        e.param = "path"
        raise
    ctx.metrics.adapter_loads.labels("ok").inc()
    log.info("loaded adapter %r (%s) from %s in %.2f s", name, kind, rel, time.monotonic() - t0)
    return {"object": "adapter", "id": name, "name": name, "kind": kind, "path": rel}


@router.delete("/v1/adapters/{name}")
async def unload_adapter(name: str, request: Request):
    ctx = api_context(request)
    check_admin(ctx.config, request.headers)
    registry = ctx.registry
    state = registry.unload(name, drain=True)     # UnknownAdapterError 404, AdapterDirError 409
    if state == "unloaded":
        log.info("unloaded adapter %r", name)
        return {"object": "adapter", "id": name, "deleted": True, "state": state}
    in_use = registry.draining().get(name, 0)
    return JSONResponse({"object": "adapter", "id": name, "deleted": True, "state": state, "in_use": in_use},
                        status_code=202)
