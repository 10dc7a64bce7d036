"""POST /v1/completions (OpenAI legacy completions: prompt lists, n, echo, logprobs, SSE)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from serve import protocol
from serve.access import check_api_key
from serve.api.common import api_context, client_closed, include_usage
from serve.api.formatting import CompletionFormat
from serve.protocol import BadRequest

DEFAULT_COMPLETION_MAX_TOKENS = 16

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request):
    ctx = api_context(request)
    check_api_key(ctx.config, request.headers)
    body = protocol.parse_json(await request.body())
    adapter = ctx.adapter_for(body)
    protocol.common_checks(body)
    echo = protocol.get(body, "echo", bool, False)
    if body.get("suffix"):
        raise BadRequest("'suffix' is not supported", "suffix")
    raw_prompts = protocol.completion_prompts(body)
    n = protocol.n_choices(body, ctx.engine.config.max_num_seqs, len(raw_prompts))
    k_lp = protocol.completion_logprobs(body)
    stop = protocol.stop_strings(body)
    tokenizer = ctx.tokenizer
    prompts, prompt_texts, sps = [], [], []
    for prompt in raw_prompts:
        if isinstance(prompt, str):
            ctx.precheck(len(prompt.encode("utf-8")), "prompt")
            ids = await ctx.tokenize(tokenizer.encode, prompt)
        else:
            ids = prompt
        prompts.append(ids)
        prompt_texts.append(prompt if isinstance(prompt, str) else (tokenizer.decode(ids) if echo else ""))
        max_tokens = protocol.max_tokens(body, ("max_tokens",), DEFAULT_COMPLETION_MAX_TOKENS, len(ids), ctx.max_len)
        sps.append(protocol.sampling(body, max_tokens, ctx.default_stop, ctx.vocab, logprobs=k_lp,
                                     prompt_logprobs=k_lp if echo else None))
    reqs, sink = await ctx.submit(request, prompts, adapter, sps, stop, n)
    fmt = CompletionFormat(body["model"], tokenizer, ctx.token_text, prompts, prompt_texts, n, echo, k_lp)
    if body.get("stream"):
        return StreamingResponse(ctx.stream(reqs, sink, fmt, include_usage(body)), media_type="text/event-stream")
    results = await ctx.wait(request, reqs, sink)
    if results is None:
        return client_closed()
    return fmt.response(reqs, results)
