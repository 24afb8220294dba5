"""Continuous-batching engine: each step drafts for every running request, lets the policy choose how many
drafts each verifies, runs ONE flattened target forward (verification blocks and prefill chunks together),
verifies, commits or rolls back, and streams.

    step:  reap aborted → admit (KV budget) → reuse prompt prefixes → draft → select ℓ → forward → verify
           → commit & stream
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from ..decoding import SamplingParams
from ..decoding.batch import verify_requests
from ..decoding.logprobs import step_logprobs, token_logprobs
from ..drafters.base import Drafter
from ..models.transformer import Segment, Transformer
from .detok import update_text
from .draft_feed import DraftFeed
from .prefix_cache import Match, PrefixCache
from .request import Request, RequestOutput, Status
from .stats import EngineStats
from .step_plan import StepPlan, plan_step


class RequestRejected(ValueError):
    """A request that can never run (too long for the context or the KV budget)."""


@dataclass(frozen=True)
class EngineConfig:
    gamma: int = 7
    max_running: int = 64
    kv_budget_tokens: int | None = None  # None: derived from kv_budget_gb
    kv_budget_gb: float = 4.0
    prefill_chunk: int = 512
    record_confidences: bool = False  # keep each round's raw confidence logits on the request (calibration)
    prefix_cache: bool = True  # copy shared prompt prefixes from running and finished requests (prefix_cache.py)
    prefix_min_tokens: int = 16  # shortest prefix worth copying
    prefix_cache_entries: int = 256  # finished requests kept as donors (within the KV budget)

    def __post_init__(self) -> None:
        if self.gamma < 1 or self.max_running < 1 or self.prefill_chunk < 1 or self.prefix_min_tokens < 1:
            raise ValueError("gamma, max_running, prefill_chunk and prefix_min_tokens must be >= 1")
        if self.prefix_cache_entries < 0:
            raise ValueError("prefix_cache_entries must be >= 0")


class Engine:
    def __init__(self, model: Transformer, tokenizer, drafter: Drafter | None, policy, eos_ids=(),
                 config: EngineConfig = EngineConfig()):
        self.model, self.tokenizer, self.drafter, self.policy = model, tokenizer, drafter, policy
        self.config, self.eos_ids = config, tuple(eos_ids)
        c = model.config
        per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * model.embed.element_size()
        self.kv_budget = config.kv_budget_tokens or int(config.kv_budget_gb * 2**30 // per_token)
        self.kv_reserved = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._aborting: dict[str, Request] = {}  # aborted since the last step: reaped without scanning the queue
        self.last_plan: StepPlan | None = None
        self.stats = EngineStats(gamma=config.gamma)
        self.feed = DraftFeed(drafter)
        # a model drafter that cannot hand over its context would lose the prefix's target states
        shareable = config.prefix_cache and (drafter is None or drafter.can_share_prefixes)
        self.prefixes = PrefixCache(config.prefix_min_tokens, config.prefix_cache_entries) if shareable else None

    # ------------------------------------------------------------------ intake
    def add_request(self, prompt: list[int], params: SamplingParams, stop_strings=(), request_id=None) -> Request:
        if not prompt:
            raise RequestRejected("the prompt is empty")
        if len(prompt) >= self.model.config.max_position:
            raise RequestRejected(f"prompt has {len(prompt)} tokens; the context window is "
                                  f"{self.model.config.max_position}")
        vocab = self.model.config.vocab_size
        if any(t >= vocab for t, _ in params.logit_bias):
            raise RequestRejected(f"logit_bias names a token id beyond the vocabulary of {vocab}")
        req = Request(prompt=list(prompt), params=params, stop_strings=tuple(stop_strings))
        if request_id is not None:
            req.request_id = request_id
        if self._positions(req) > self.kv_budget:
            raise RequestRejected(f"request needs {self._positions(req)} KV positions (prompt + max_tokens); "
                                  f"the engine's KV budget is {self.kv_budget}")
        self.waiting.append(req)
        self.requests[req.request_id] = req
        return req

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None:
            req.aborted = True
            self._aborting[request_id] = req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _positions(self, req: Request) -> int:
        return min(req.needed_positions(self.config.gamma), self.model.config.max_position)

    @property
    def kv_cached(self) -> int:
        """KV positions held by finished requests kept as prefix donors (evicted before admission waits)."""
        return self.prefixes.kept_positions if self.prefixes else 0

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_running:
            req = self.waiting[0]
            need = self._positions(req)
            while self.kv_cached and self.kv_reserved + self.kv_cached + need > self.kv_budget:
                self._forget(self.prefixes.pop_oldest())
            if self.kv_reserved + need > self.kv_budget:
                return  # wait until running requests free their KV
            self.waiting.popleft()
            req.reserved, self.kv_reserved = need, self.kv_reserved + need
            req.cache = self.model.new_cache(capacity=need)
            req.status = Status.PREFILL
            self.running.append(req)

    def _release(self, req: Request) -> None:
        self.kv_reserved -= req.reserved
        req.reserved = 0
        self._drop_draft_state(req)
        self.requests.pop(req.request_id, None)

    def _drop_draft_state(self, req: Request) -> None:
        if self.drafter is not None:
            self.feed.drop(req)
            self.drafter.release(req.draft)

    def _finish(self, req: Request, reason: str) -> None:
        """A request that ended normally stays a prefix donor while the KV budget and entry limit allow."""
        keep = self.prefixes is not None and self.config.prefix_cache_entries > 0 and req.cache is not None
        req.finish(reason, keep_cache=keep)
        self.stats.record_finish(reason)
        if not keep:
            self._release(req)
            return
        self.kv_reserved -= req.reserved
        req.reserved = req.cache.compact()  # a donor holds what it computed, not what it had reserved
        self.requests.pop(req.request_id, None)
        for old in self.prefixes.keep(req):
            self._forget(old)

    def reset_prefix_cache(self) -> int:
        """Evict every finished request kept as a prefix donor (vLLM's reset_prefix_cache): a benchmark cell then
        starts with none of the prompts an earlier cell left behind. Returns how many were evicted."""
        evicted = 0
        while self.prefixes is not None and self.prefixes.kept:
            self._forget(self.prefixes.pop_oldest())
            evicted += 1
        return evicted

    def _forget(self, donor: Request) -> None:
        """Evict a kept donor: its KV, drafter context and pending states go."""
        donor.cache, donor.reserved = None, 0
        self._drop_draft_state(donor)

    # ------------------------------------------------------------------ prompt prefixes
    def _reuse_prefixes(self) -> None:
        """Each newly admitted request copies the longest prompt prefix a donor holds, or waits for a donor that is
        prefilling it (prefix_cache.py)."""
        for req in self.running:
            if req.status is not Status.PREFILL or req.prefix_state == "done":
                continue
            match = self.prefixes.find(req, self.running, self._coverage)
            req.prefix_state = "waiting" if match is not None and match.wait else "done"
            if match is not None and not match.wait:
                self._adopt(req, match)

    def _coverage(self, donor: Request) -> int:
        """Positions whose target states the donor can pass on to a model drafter (fed or pending)."""
        if not self.feed.active:
            return donor.num_tokens
        return self.drafter.observed(donor.draft) + self.feed.backlog(donor)

    def _adopt(self, req: Request, match: Match) -> None:
        donor, m = match.donor, match.length
        try:
            req.cache.copy_prefix(donor.cache, m)
            if self.feed.active:
                fed = min(self.drafter.observed(donor.draft), m)
                self.drafter.share_context(donor.draft, req.draft, fed)
                self.feed.share(donor, req, m - fed)
        except Exception:  # nothing is lost: the request prefills its whole prompt instead
            req.cache.truncate(0)
            self._drop_draft_state(req)
            return
        req.prefilled = req.cached_tokens = m
        self.stats.prefix_hits += 1
        self.stats.cached_prompt_tokens += m
        self.prefixes.touch(donor)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs = self._reap_aborted()
        self._admit()
        if not self.running:
            return outputs
        if self.prefixes is not None:
            self._reuse_prefixes()
        failed: list[RequestOutput] = []  # requests whose deferred feed failed while planning
        plan = plan_step(self.running, self.drafter, self.policy, self.config, self.model.config.max_position,
                         before_draft=lambda reqs: self.feed.flush(reqs, lambda r, e: self._fail(r, e, failed)),
                         backlog=self.feed.backlog)
        self.last_plan = plan
        if failed:
            outputs += failed
            self.running = [r for r in self.running if not r.finished]
            if not len(plan.tokens):
                return outputs
        t_forward = time.perf_counter()
        try:
            out = self.model.forward(plan.tokens, plan.segments, logit_rows=plan.logit_rows,
                                     hidden_layers=self.drafter.needs_layers if self.drafter else ())
        except Exception as exc:  # a failed shared forward fails the requests in it, not the engine
            for req in plan.decoding + plan.prefilling:
                self._fail(req, exc, outputs)
            self.running = [r for r in self.running if not r.finished]
            return outputs
        forward_s = time.perf_counter() - t_forward
        self._observed: list[tuple[Request, int, int]] = []
        outputs += self._commit_decoding(plan, out)
        outputs += self._commit_prefill(plan, out)
        self._report_step(plan, forward_s, time.perf_counter() - t_forward - forward_s)
        t_observe = time.perf_counter()
        self._feed_drafter(out, outputs)
        drafter_s = plan.propose_seconds + time.perf_counter() - t_observe
        self.running = [r for r in self.running if not r.finished]
        verified = int(plan.lengths.sum()) if plan.decoding else 0
        self.stats.record_step(time.perf_counter() - t0, len(plan.decoding), verified, forward_s, drafter_s)
        return outputs

    def _report_step(self, plan: StepPlan, forward_s: float, commit_s: float) -> None:
        """Tell a policy that prices steps live (AsyncPolicy with ``live``) what this one cost: the forward, its
        commit (sampling, verification, emitting) and the proposal, with the feeding of deferred target states
        apart. A forward with prefill in it is not a step the speed profile prices."""
        if not getattr(self.policy, "observes_steps", False) or plan.prefilling or not plan.decoding:
            return  # the common case costs no bookkeeping
        self.policy.observe_step(plan.verified_tokens, len(plan.decoding), forward_s, plan.drafted_requests,
                                 plan.draft_depth, plan.draft_call_seconds, commit_s=commit_s,
                                 feed_s=plan.propose_seconds - plan.draft_call_seconds)

    def _reap_aborted(self) -> list[RequestOutput]:
        outs, aborting = [], list(self._aborting.values())
        self._aborting.clear()
        for req in aborting:  # a scan of every waiting request cost 0.4 ms a step with 4,000 queued
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            else:
                continue  # it finished before it was reaped
            req.finish("abort")
            self._release(req)
            self.stats.record_finish("abort")
            outs.append(RequestOutput(req.request_id, [], "", True, "abort", req))
        return outs

    def _commit_decoding(self, plan: StepPlan, out) -> list[RequestOutput]:
        if not plan.decoding:
            return []
        reqs = plan.decoding
        logits = [out.logits[rows] for rows in plan.decode_logit_rows]
        result = verify_requests(logits, plan.drafts, plan.lengths, plan.draft_probs, [r.params for r in reqs],
                                 [r.generator for r in reqs], self._stop_mask(reqs, plan.drafts, plan.lengths),
                                 table=(out.logits, [rows.start for rows in plan.decode_logit_rows]),
                                 histories=[r.output for r in reqs], stop_ids=[self._stop_ids(r) for r in reqs],
                                 prompts=[r.prompt for r in reqs], draft_rows=plan.draft_rows,
                                 draft_vocab=plan.draft_vocab)
        observe = getattr(self.policy, "observe_outcomes", None)  # online calibration (scheduling/acceptance_tracker)
        if observe is not None and plan.confidences is not None:
            observe(plan.confidences, plan.lengths.numpy(), result.accepted.numpy())
        emitted = [result.emitted(plan.drafts, i) for i in range(len(reqs))]
        entries = step_logprobs([r.params.logprobs for r in reqs], emitted, out.logits, plan.decode_logit_rows)
        outputs = []
        for i, req in enumerate(reqs):
            try:
                a = int(result.accepted[i])
                req.cache.truncate(len(req.prompt) + len(req.output) + a)  # anchor + accepted drafts stay
                req.rounds, req.accepted = req.rounds + 1, req.accepted + a
                req.drafted += int(plan.lengths[i])
                req.accepted_hist.append(a)
                req.verified_hist.append(int(plan.lengths[i]))
                if self.config.record_confidences and plan.confidence_logits is not None:
                    req.confidence_hist.append(plan.confidence_logits[i])
                self.stats.record_round(int(plan.lengths[i]), a)
                self._observed.append((req, plan.decode_token_rows[i][0], a + 1))  # anchor + accepted drafts
                outputs.append(self._emit(req, emitted[i], entries[i]))
            except Exception as exc:
                self._fail(req, exc, outputs)
        return outputs

    def _commit_prefill(self, plan: StepPlan, out) -> list[RequestOutput]:
        outputs = []
        for req, rows, logit_row, prompt_rows in zip(plan.prefilling, plan.prefill_token_rows,
                                                     plan.prefill_logit_rows, plan.prefill_prompt_rows):
            try:
                if prompt_rows is not None:  # row j predicted the prompt token after this chunk's token j
                    targets = req.prompt[req.prefilled + 1: req.prefilled + 1 + len(rows)]
                    req.prompt_logprobs += token_logprobs(out.logits[prompt_rows.start: prompt_rows.stop], targets,
                                                          req.params.prompt_logprobs)
                req.prefilled += len(rows)
                self.stats.prompt_tokens += len(rows)
                self._observed.append((req, rows[0], len(rows)))
                if logit_row is None:
                    continue  # more prompt chunks to go
                empty = torch.zeros(1, 0, dtype=torch.long)
                first = verify_requests([out.logits[logit_row: logit_row + 1]], empty, torch.zeros(1, dtype=torch.long),
                                        None, [req.params], [req.generator], torch.zeros(1, 0, dtype=torch.bool),
                                        stop_ids=[self._stop_ids(req)], prompts=[req.prompt])
                req.status = Status.DECODE
                token = int(first.next_token[0])
                asked = req.params.logprobs
                outputs.append(self._emit(req, [token], None if asked is None else
                                          token_logprobs(out.logits[logit_row: logit_row + 1], [token], asked)))
            except Exception as exc:
                self._fail(req, exc, outputs)
        return outputs

    # ------------------------------------------------------------------ helpers
    def _stop_ids(self, req: Request) -> set[int]:
        return set(req.params.stop_token_ids) | (set() if req.params.ignore_eos else set(self.eos_ids))

    def _stop_mask(self, reqs: list[Request], drafts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[R, g] whether each draft is one of its request's stop tokens (one isin per distinct stop set)."""
        mask = torch.zeros(drafts.shape, dtype=torch.bool)
        if not int(lengths.max()):
            return mask  # nothing verified: no draft can stop a request
        groups: dict[frozenset[int], list[int]] = {}
        for i, req in enumerate(reqs):
            groups.setdefault(frozenset(self._stop_ids(req)), []).append(i)
        for stops, rows in groups.items():
            if stops:
                idx = torch.tensor(rows)
                mask[idx] = torch.isin(drafts[idx], torch.tensor(sorted(stops)))
        return mask

    def _feed_drafter(self, out, outputs: list[RequestOutput]) -> None:
        """Keep the target states of every token committed this step for the drafter (fed before it drafts, or
        now for a request holding its bound of pending rows: a failure then fails it here, with its final output)."""
        live = [(r, first, n) for r, first, n in self._observed if not r.finished or r.cache is not None]
        if not self.feed.active or not out.hidden or not live:
            return
        self.feed.stash(live, out.hidden, lambda req, exc: self._fail_feed(req, exc, outputs), out.stacked)
        for req, _, _ in live:
            if req.finished:  # kept as a prefix donor: its pending states stop holding whole steps alive
                self.feed.compact(req)

    def _fail_feed(self, req: Request, exc: Exception, outputs: list) -> None:
        """A failed feed fails a running request; a kept donor (already answered) is only evicted."""
        if req.finished:
            self._forget(self.prefixes.discard(req))
        else:
            self._fail(req, exc, outputs)

    def _emit(self, req: Request, tokens: list[int], logprobs: list | None = None) -> RequestOutput:
        """logprobs: the tokens' TokenLogprob entries, for a request that asked for them."""
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        stops, before = self._stop_ids(req), len(req.output)
        chunk, reason = tokens[: req.params.max_new_tokens - before], None
        for j, t in enumerate(chunk):
            if t in stops:
                chunk, reason = chunk[: j + 1], "stop"
                break
        req.output.extend(chunk)
        req.draft.tokens.extend(chunk)
        new_logprobs = None if logprobs is None else logprobs[: len(chunk)]  # cut with the tokens
        if new_logprobs is not None:
            req.logprobs.extend(new_logprobs)
        self.stats.generation_tokens += len(chunk)
        if reason is None and (len(req.output) >= req.params.max_new_tokens
                               or req.num_tokens >= self.model.config.max_position):
            reason = "length"
        piece, stop_hit = (update_text(req, self.tokenizer, len(chunk), final=reason is not None) if self.tokenizer
                           else ("", False))
        reason = "stop" if stop_hit else reason
        if reason:
            self._finish(req, reason)
        return RequestOutput(req.request_id, req.output[before:], piece, req.finished, req.finish_reason, req,
                             new_logprobs)

    def _fail(self, req: Request, exc: Exception, outputs: list) -> None:
        req.finish("error", f"{type(exc).__name__}: {exc}")
        self._release(req)
        self.stats.record_finish("error")
        outputs.append(RequestOutput(req.request_id, [], "", True, "error", req))
