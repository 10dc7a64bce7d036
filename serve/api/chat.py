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


def _encoder(tokenizer, add_generation_prompt: bool, continue_final_message: bool):
    def encode_chat(msgs):
        kw = {"continue_final_message": True} if continue_final_message else {}
        if hasattr(tokenizer, "encode_chat"):
            return tokenizer.encode_chat(msgs, add_generation_prompt=add_generation_prompt, **kw)
        return tokenizer.encode(tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, **kw))
    return encode_chat


def _template_flags(body: dict, msgs: list[dict]) -> tuple[bool, bool]:
    """vLLM's `add_generation_prompt` (default true) and `continue_final_message` (default false: the
    answer continues the last message, an assistant turn the client began)."""
    if protocol.get(body, "add_special_tokens", bool, False):
        raise protocol.BadRequest("'add_special_tokens' must be false on /v1/chat/completions: the chat template "
                                  "writes the special tokens", "add_special_tokens")
    add = protocol.get(body, "add_generation_prompt", bool, True)
    cont = protocol.get(body, "continue_final_message", bool, False)
    if add and cont:
        raise protocol.BadRequest("'continue_final_message' continues the last message, so it needs "
                                  "'add_generation_prompt': false", "continue_final_message")
    if cont and msgs[-1]["role"] != "assistant":
        raise protocol.BadRequest("'continue_final_message' needs the last message to be an assistant turn, "
                                  f"got role {msgs[-1]['role']!r}", "continue_final_message")
    return add, cont


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
    prompt_ids = await ctx.tokenize(_encoder(ctx.tokenizer, *_template_flags(body, msgs)), msgs)
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
