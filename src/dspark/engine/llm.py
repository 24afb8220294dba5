"""The Python API: `LLM(model=..., drafter=..., policy=...).generate(prompts, SamplingParams)`."""
from __future__ import annotations

from dataclasses import dataclass

from ..decoding import SamplingParams
from ..drafters import make_drafter
from ..drafters.base import split_precision
from ..models import DEFAULT_MODEL, load_model
from ..scheduling.registry import base_name, check_spec, make_policy
from .engine import Engine, EngineConfig
from .request import Request


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: dict
    speculative: dict
    error: str | None = None
    logprobs: list | None = None  # TokenLogprob per token of token_ids, when SamplingParams.logprobs asked
    prompt_logprobs: list | None = None  # TokenLogprob per prompt token after the first, when prompt_logprobs asked


SCHEDULED_POLICIES = ("auto", "sync", "async", "async-online")  # decide per step whether drafts are worth verifying


def drafter_options(drafter: str | None, policy: str) -> dict:
    """`auto` may pick a drafter that pays only when a confidence-scheduled policy drives it (drafters/shipped.py)."""
    if drafter is None or split_precision(drafter)[0] != "auto":
        return {}
    return {"scheduled": base_name(policy) in SCHEDULED_POLICIES}


def build_policy(name: str, drafter, model_id: str, dtype: str, model, gamma: int, threshold: float = 0.5):
    """`auto`: the asynchronous scheduler when the drafter has a confidence head, else verify every draft."""
    has_conf = drafter is not None and drafter.has_confidence
    if drafter is None:
        return make_policy("none")
    if name == "auto":
        name = "async" if has_conf else f"fixed-{gamma}"
    kwargs, base = {}, base_name(name)
    if base == "sync" or base.startswith("async"):
        from .profiling import load_or_profile, profile_key
        if has_conf:
            key = profile_key(model_id, dtype, drafter.profile_id, model)
            kwargs["sps"] = load_or_profile(model, key, drafter=drafter)
    elif base == "threshold":
        kwargs["threshold"] = threshold
    return make_policy(name, confidence_available=has_conf, **kwargs)


def completion_of(req: Request) -> Completion:
    return Completion(req.request_id, req.text, list(req.output), req.finish_reason, req.usage(), req.spec_stats(),
                      req.error, list(req.logprobs) if req.params.logprobs is not None else None,
                      list(req.prompt_logprobs) if req.params.prompt_logprobs is not None else None)


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, drafter: str | None = "auto", policy: str = "auto",
                 gamma: int = 7, dtype: str = "float32", **engine_options):
        check_spec(policy)  # a misspelt policy should not cost a model load
        self.loaded = load_model(model, dtype=dtype)
        self.tokenizer = self.loaded.tokenizer
        self.drafter = make_drafter(drafter, target=self.loaded.model, gamma=gamma,
                                    **drafter_options(drafter, policy))
        self.policy = build_policy(policy, self.drafter, model, dtype, self.loaded.model, gamma)
        self.engine = Engine(self.loaded.model, self.tokenizer, self.drafter, self.policy, self.loaded.eos_ids,
                             EngineConfig(gamma=gamma, **engine_options))

    def encode(self, prompt: str | list[int], chat: bool) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        from ..generate import prompt_ids
        return prompt_ids(self.tokenizer, prompt, chat)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None, chat: bool = True,
                 stop: tuple[str, ...] = ()) -> list[Completion]:
        """Run a batch to completion; prompts are strings (chat-templated unless chat=False) or token lists."""
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.engine.add_request(self.encode(p, chat), sp, stop) for p, sp in zip(prompts, plist)]
        while any(not r.finished for r in reqs):
            self.engine.step()
        return [completion_of(r) for r in reqs]
