"""The HTTP boundary: the request body (size-limited, UTF-8, JSON), OpenAI request schemas (pydantic, strict:
"0.5" is not a number) and their translation into what the engine takes: prompt token ids, SamplingParams and
stop strings. Everything past this module works on plain Python values."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect, Request

from ..decoding.sampling import MAX_LOGPROBS, SamplingError, SamplingParams
from .errors import APIError, ClientGone, bad_request, from_pydantic

MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS_TOKENS = 300  # OpenAI's limit on logit_bias entries
MAX_CHOICES = 16  # n: each choice is one engine request, so one HTTP request may hold this many batch slots
MAX_BATCH = 64  # completions: prompts × n engine requests in one HTTP request (the server's default queue)


class StrictModel(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers do, so newer clients keep working; 1e999 parses
    # to infinity in JSON, so non-finite numbers are refused here too.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False


class ContentPart(StrictModel):
    type: str
    text: str | None = None


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None


class _Common(StrictModel):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=0)  # 0 only for completions with echo (build_generation)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # -1 (vLLM) and 0 both mean off
    min_p: float | None = Field(default=None, ge=0, le=1)  # vLLM's extension; 0 means off
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # what torch's generator takes
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_STRINGS)  # vLLM's extension
    min_tokens: int | None = Field(default=None, ge=0)  # vLLM's extension: no stop before this many tokens
    logprobs: bool | int | None = None  # chat: a bool (alternatives in top_logprobs); completions: alternatives
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS_TOKENS)  # token id -> bias
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = Field(default=None, gt=0)  # vLLM's extension; 1 means off


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]  # a list of prompts is a batch
    echo: bool = False
    suffix: str | None = None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, limit: int) -> dict:
    """Refuses oversized bodies from Content-Length or while streaming them in, before any parsing."""
    declared = request.headers.get("content-length")
    if declared is not None and not declared.isdigit():
        raise bad_request("invalid Content-Length header")
    if declared is not None and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit}", None, "body_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes", None, "body_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not valid UTF-8 (byte {exc.start})", None, "invalid_encoding") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_json")
    return body


async def parse_request(request: Request, schema, limit: int, model_name: str):
    """The body read (read_json), validated against ``schema`` (a 400 naming the parameter) and checked to name
    this server's model (a 404); raises ClientGone if the client left while sending it."""
    body = await read_json(request, limit)
    try:
        parsed = schema.model_validate(body)
    except ValidationError as exc:
        raise from_pydantic(exc) from None
    if parsed.model is not None and parsed.model != model_name:
        raise APIError(404, f"the model '{parsed.model}' does not exist; this server serves '{model_name}'",
                       "model", "model_not_found")
    return parsed


@dataclass
class Generation:
    """One validated request, ready for the engine."""

    kind: str  # "chat" | "completion"
    prompts: list[list[int]]  # one, or a completions batch: choice i answers prompts[i // n]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    n: int = 1
    echo: bool = False  # completions: the answer begins with the prompt (and its log-probabilities, if asked)
    echo_texts: tuple[str | None, ...] = ()  # each prompt as sent, when it was text (token ids are decoded)
    echo_only: bool = False  # max_tokens 0 with echo: the prompt scored, nothing generated in the answer

    def choice_params(self, index: int) -> SamplingParams:
        """Choice i samples with seed + i (mod 2**64; the request's own seed for choice 0), so a seeded request of
        n choices is n seeded requests; without a seed every choice draws from fresh entropy."""
        if index == 0 or self.params.seed is None:
            return self.params
        return dataclasses.replace(self.params, seed=(self.params.seed + index) % 2**64)

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

    def choice(self, index: int) -> tuple[list[int], SamplingParams]:
        """Choice i's prompt and parameters: OpenAI orders a batch's choices prompt by prompt, n each."""
        return self.prompts[index // self.n], self.choice_params(index % self.n)


def check_unsupported(req: _Common) -> None:
    if isinstance(req, ChatCompletionRequest) and req.tools:
        raise bad_request("tools are not supported by this server", "tools", "unsupported_value")
    if isinstance(req, CompletionRequest) and req.suffix:
        raise bad_request("suffix is not supported by this server", "suffix", "unsupported_value")


def logprobs_asked(req: _Common) -> int | None:
    """SamplingParams.logprobs from OpenAI's two spellings: chat takes ``logprobs: true`` plus ``top_logprobs: n``
    alternatives, the legacy completions endpoint ``logprobs: n``. None: not asked."""
    if isinstance(req, ChatCompletionRequest):
        if req.logprobs is not None and not isinstance(req.logprobs, bool):
            raise bad_request("for chat completions logprobs is true or false; top_logprobs sets how many "
                              "alternatives", "logprobs")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None
    if isinstance(req.logprobs, bool):
        raise bad_request(f"for completions logprobs is the number of alternatives (0 to {MAX_LOGPROBS})", "logprobs")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must lie in [0, {MAX_LOGPROBS}], got {req.logprobs}", "logprobs")
    return req.logprobs


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are allowed", "stop")
    if any(s == "" for s in stops):
        raise bad_request("stop strings must not be empty", "stop")
    return tuple(dict.fromkeys(stops))


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            if any(p.type != "text" or p.text is None for p in m.content):
                raise bad_request("only text content parts are supported", f"messages.{i}.content")
            text = "".join(p.text for p in m.content)
        else:
            text = m.content or ""
        out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    return out


def encode_prompts(req: _Common, tokenizer, vocab_size: int) -> tuple[list[list[int]], str]:
    """-> (token ids of each prompt, the parameter they came from). Runs off the event loop (templating can be
    slow)."""
    if isinstance(req, ChatCompletionRequest):
        return [encode_chat(req.messages, tokenizer)], "messages"
    return [encode_prompt(p, tokenizer, vocab_size) for p in prompt_list(req)], "prompt"


def encode_chat(messages: list[ChatMessage], tokenizer, add_generation_prompt: bool = True) -> list[int]:
    try:
        ids = tokenizer.apply_chat_template(chat_messages(messages), add_generation_prompt=add_generation_prompt,
                                            tokenize=True)
    except APIError:
        raise
    except Exception as exc:  # the template rejects the conversation (e.g. roles must alternate)
        raise bad_request(f"the chat template rejected these messages: {exc}", "messages") from None
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return [int(t) for t in ids]


def prompt_list(req: CompletionRequest) -> list:
    """The completions prompt as a list of prompts, each text or token ids ([1, 2] is one prompt of ids)."""
    prompt = req.prompt
    batch = isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
    prompts = list(prompt) if batch else [prompt]
    if len(prompts) > MAX_BATCH:
        raise bad_request(f"at most {MAX_BATCH} prompts per request", "prompt")
    return prompts


def encode_prompt(prompt: str | list[int], tokenizer, vocab_size: int,
                  add_special_tokens: bool = False) -> list[int]:
    if isinstance(prompt, str):
        try:
            return list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        except Exception as exc:  # e.g. lone surrogates from a "\ud800" escape
            raise bad_request(f"the prompt could not be tokenized: {exc}", "prompt") from None
    if any(t < 0 or t >= vocab_size for t in prompt):
        raise bad_request(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    return list(prompt)


def logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} -> SamplingParams.logit_bias (ids checked against the vocabulary)."""
    pairs = []
    for key, value in (bias or {}).items():
        if not key.isdigit() or int(key) >= vocab_size:
            raise bad_request(f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}", "logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def stop_ids(ids: list[int] | None, vocab_size: int) -> tuple[int, ...]:
    if ids and any(not 0 <= t < vocab_size for t in ids):
        raise bad_request(f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
    return tuple(dict.fromkeys(ids or ()))


def build_generation(req: _Common, prompts: list[list[int]], param: str, max_position: int,
                     default_max_tokens: int, vocab_size: int) -> Generation:
    """Checks lengths against the context window (OpenAI's 400 `context_length_exceeded`) and sampling values;
    a batch is checked by its longest prompt."""
    if not prompts or not all(prompts):
        raise bad_request("the prompt is empty", param)
    prompt = max(prompts, key=len)
    if len(prompt) >= max_position:
        raise bad_request(f"this model's maximum context length is {max_position} tokens; the prompt has "
                          f"{len(prompt)} tokens", param, "context_length_exceeded")
    if len(prompts) * (req.n or 1) > MAX_BATCH:
        raise bad_request(f"{len(prompts)} prompts × n = {req.n} is more than {MAX_BATCH} answers", "n")
    asked, asked_param = req.max_tokens, "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_tokens is None and req.max_completion_tokens is not None:
        asked, asked_param = req.max_completion_tokens, "max_completion_tokens"
    echo = isinstance(req, CompletionRequest) and req.echo
    if asked == 0 and not echo:
        raise bad_request(f"{asked_param} must be at least 1 (0 only with echo, to score the prompt)", asked_param,
                          "invalid_value")
    room = max_position - len(prompt)
    if asked is not None and asked > room:
        raise bad_request(f"this model's maximum context length is {max_position} tokens; the prompt has "
                          f"{len(prompt)} and {asked_param} asks for {asked}", asked_param, "context_length_exceeded")
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    try:
        params = SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                                top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k, min_p=req.min_p or 0.0,
                                # max_tokens 0 generates one token, never shown: the prompt's last position
                                max_new_tokens=1 if asked == 0 else asked or min(default_max_tokens, room),
                                seed=req.seed, ignore_eos=req.ignore_eos, logprobs=logprobs_asked(req),
                                prompt_logprobs=logprobs_asked(req) if echo else None,
                                stop_token_ids=stop_ids(req.stop_token_ids, vocab_size),
                                logit_bias=logit_bias(req.logit_bias, vocab_size),
                                presence_penalty=req.presence_penalty or 0.0,
                                frequency_penalty=req.frequency_penalty or 0.0, min_tokens=req.min_tokens or 0,
                                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty)
    except SamplingError as exc:
        raise bad_request(str(exc)) from None
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    kind = "chat" if isinstance(req, ChatCompletionRequest) else "completion"
    texts = tuple(p if isinstance(p, str) else None for p in prompt_list(req)) if echo else ()
    return Generation(kind, prompts, params, stop_strings(req.stop), req.stream, include_usage, req.n or 1,
                      echo=echo, echo_texts=texts, echo_only=echo and asked == 0)
