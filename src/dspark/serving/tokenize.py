"""vLLM's /tokenize and /detokenize: the token ids a prompt or a conversation becomes on this server — the same
encoding the completion endpoints use (a chat through the model's template, a completion prompt without special
tokens) — and the text of token ids. A client counts a prompt against ``max_model_len`` before it sends it, or
builds a completions prompt of token ids, without a tokenizer of its own."""
from __future__ import annotations

import asyncio

from pydantic import Field, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .errors import ClientGone, bad_request
from .protocol import ChatMessage, StrictModel, encode_chat, encode_prompt, parse_request

MAX_DETOKENIZE = 1 << 17  # token ids per /detokenize call (the body limit comes first for most clients)


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None  # a completions prompt ...
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)  # ... or a conversation
    add_generation_prompt: bool = True  # chat: end with the assistant's turn opening, as chat completions do
    add_special_tokens: bool = False  # prompt: the tokenizer's BOS/EOS (completions add none)

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE)


async def _parse(request: Request, schema):
    """(server state, the validated request), or (state, None) if the client left."""
    state = request.app.state.dspark
    try:
        return state, await parse_request(request, schema, state.config.max_body_bytes, state.config.model_name)
    except ClientGone:
        return state, None


async def tokenize(request: Request) -> Response:
    state, req = await _parse(request, TokenizeRequest)
    if req is None:
        return Response(status_code=499)
    tokenizer, config = state.llm.tokenizer, state.llm.engine.model.config

    def encode() -> list[int]:
        if req.messages is not None:
            return encode_chat(req.messages, tokenizer, req.add_generation_prompt)
        return encode_prompt(req.prompt, tokenizer, config.vocab_size, req.add_special_tokens)

    ids = await asyncio.get_running_loop().run_in_executor(state.tokenize_pool, encode)
    return JSONResponse({"count": len(ids), "max_model_len": config.max_position, "tokens": ids})


async def detokenize(request: Request) -> Response:
    state, req = await _parse(request, DetokenizeRequest)
    if req is None:
        return Response(status_code=499)
    vocab = state.llm.engine.model.config.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise bad_request(f"token ids must be in [0, {vocab})", "tokens")
    text = await asyncio.get_running_loop().run_in_executor(state.tokenize_pool, state.llm.tokenizer.decode,
                                                            req.tokens)
    return JSONResponse({"prompt": text})
