"""POST /v1/chat/completions (chat template off the event loop, n, logprobs, SSE)."""
from __future__ import annotations

from fastapi import APIRouter, Request

from serve import protocol
from serve.api.common import api_context
from serve.api.formatting import ChatFormat
from serve.errors import RequestError

DEFAULT_CHAT_MAX_TOKENS = 256
CHAT_TEMPLATE_OVERHEAD_TOKENS = 256     # room the pre-check leaves for the template's own tokens

router = APIRouter()


def _encoder(tokenizer):
    def encode_chat(msgs):
        if hasattr(tokenizer, "encode_chat"):
            return tokenizer.encode_chat(msgs, add_generation_prompt=True)
        return tokenizer.encode(tokenizer.apply_chat_template(msgs, add_generation_prompt=True))
    return encode_chat


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    ctx = api_context(request)
    body, adapter = await ctx.read(request)
    n = protocol.n_choices(body)
    if protocol.get(body, "echo", bool, False):
        raise protocol.BadRequest("'echo' is not supported on /v1/chat/completions", "echo")
    k_lp = protocol.chat_logprobs(body)
    msgs = protocol.chat_messages(body)
    ctx.precheck(sum(len(m["content"].encode("utf-8")) for m in msgs), "the conversation",
                 CHAT_TEMPLATE_OVERHEAD_TOKENS)
    prompt_ids = await ctx.tokenize(_encoder(ctx.tokenizer), msgs)
    max_tokens = protocol.max_tokens(body, ("max_completion_tokens", "max_tokens"), DEFAULT_CHAT_MAX_TOKENS,
                                     len(prompt_ids), ctx.max_len)
    sp = protocol.sampling(body, max_tokens, ctx.default_stop, logprobs=k_lp, chat=True)
    stop = protocol.stop_strings(body)
    try:
        reqs, sink = await ctx.submit(request, [prompt_ids], adapter, [sp], stop, n)
    except RequestError as e:            # the engine's words are a completion's: 'prompt', 'max_tokens'
        key = protocol.max_tokens_key(body)
        words = {"prompt": ("messages", "the conversation"), "max_tokens": (key, key)}
        raise protocol.in_body_words(e, words) from None
    fmt = ChatFormat(body["model"], ctx.tokenizer, ctx.token_text, prompt_ids, len(reqs), k_lp)
    return await ctx.respond(request, reqs, sink, fmt, body)
