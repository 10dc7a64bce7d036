"""POST /v1/completions (OpenAI legacy completions: prompt lists, n, echo, logprobs, SSE)."""
from __future__ import annotations

from fastapi import APIRouter, Request

from serve import protocol, validation
from serve.api.common import api_context
from serve.api.formatting import CompletionFormat
from serve.protocol import BadRequest

DEFAULT_COMPLETION_MAX_TOKENS = 16

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request):
    ctx = api_context(request)
    body, adapter = await ctx.read(request)
    echo = protocol.get(body, "echo", bool, False)
    # echo with max_tokens 0 scores the prompt (OpenAI's legacy API and vLLM allow it): one token is
    # generated, as the engine needs, and left out of the answer
    score_only = echo and body.get("max_tokens") == 0 and type(body["max_tokens"]) is int
    if body.get("suffix"):
        raise BadRequest("'suffix' is not supported", "suffix")
    raw_prompts = protocol.completion_prompts(body)
    n = protocol.n_choices(body, len(raw_prompts))
    k_lp = protocol.completion_logprobs(body)
    stop = protocol.stop_strings(body)
    # vLLM's add_special_tokens (default true): a text prompt gets the BOS HF's tokenizer(text) gives it
    bos = protocol.get(body, "add_special_tokens", bool, True) and getattr(ctx.tokenizer, "add_bos_default", False)
    tokenizer = ctx.tokenizer
    prompts, prompt_texts, added, sps = [], [], [], []
    for prompt in raw_prompts:
        if isinstance(prompt, str):
            ctx.precheck(len(prompt.encode("utf-8")), "prompt")
            ids = await ctx.tokenize(tokenizer.encode, prompt, bos)
        else:
            ids = validation.prompt_ids(prompt, ctx.vocab)     # before any echo decodes them
        prompts.append(ids)
        added.append(int(isinstance(prompt, str) and bos))
        # echo repeats a text prompt as sent, and token ids as their text with special tokens (vLLM)
        prompt_texts.append(prompt if isinstance(prompt, str) else
                            (tokenizer.decode(ids, skip_special_tokens=False) if echo else ""))
        max_tokens = 1 if score_only else protocol.max_tokens(body, ("max_tokens",), DEFAULT_COMPLETION_MAX_TOKENS,
                                                              len(ids), ctx.max_len)
        sps.append(protocol.sampling(body, max_tokens, ctx.default_stop, logprobs=k_lp,
                                     prompt_logprobs=k_lp if echo else None))
    reqs, sink = await ctx.submit(request, prompts, adapter, sps, stop, n)
    fmt = CompletionFormat(body["model"], tokenizer, ctx.token_text, prompts, prompt_texts, n, echo, k_lp,
                           score_only, added)
    return await ctx.respond(request, reqs, sink, fmt, body)
