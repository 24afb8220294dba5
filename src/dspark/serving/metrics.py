"""Prometheus text exposition (format 0.0.4), written by hand: a few dozen series do not need a client library.

Series are published under `dspark:` and, where vLLM has the same quantity, also under vLLM's name (e.g.
`vllm:spec_decode_num_accepted_tokens_per_pos_total`), so existing dashboards work unchanged.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class ServerCounters:
    """What the HTTP layer counts (the engine counts tokens and rounds itself)."""

    responses: Counter = field(default_factory=Counter)  # (endpoint, status) -> n
    rejected: Counter = field(default_factory=Counter)  # reason -> n
    in_flight: int = 0  # admitted requests not yet answered (engine waiting + running + being tokenized)
    disconnects: int = 0
    timeouts: int = 0


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    esc = (str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for v in labels.values())
    return "{" + ",".join(f'{k}="{v}"' for k, v in zip(labels, esc)) + "}"


class Writer:
    """Collects samples per metric family: the text format wants each family's lines in one group, and we
    interleave dspark: and vllm: samples while adding them."""

    def __init__(self, model: str):
        self.base = {"model_name": model}
        self.families: dict[str, list[str]] = {}

    def add(self, name: str, kind: str, help_: str, value, labels: dict | None = None,
            vllm: str | None = None) -> None:
        for full in (f"dspark:{name}", vllm and f"vllm:{vllm}"):
            if not full:
                continue
            family = full.removesuffix("_total") if kind == "counter" else full
            if kind in ("histogram", "summary"):
                for suffix in ("_bucket", "_sum", "_count"):
                    family = family.removesuffix(suffix)
            lines = self.families.setdefault(family, [f"# HELP {family} {help_}", f"# TYPE {family} {kind}"])
            value_text = repr(float(value)) if isinstance(value, float) else str(int(value))
            lines.append(f"{full}{_labels({**self.base, **(labels or {})})} {value_text}")

    def text(self) -> str:
        return "\n".join(line for lines in self.families.values() for line in lines) + "\n"


def render(snapshot: dict, counters: ServerCounters, model: str, rss_bytes: int) -> str:
    s, w = snapshot["stats"], Writer(model)
    # -- requests and queue
    w.add("num_requests_running", "gauge", "Requests in the engine's running batch.", snapshot["running"],
          vllm="num_requests_running")
    w.add("num_requests_waiting", "gauge", "Requests queued for admission (KV or batch slots).",
          snapshot["waiting"], vllm="num_requests_waiting")
    w.add("server_requests_in_flight", "gauge", "Requests admitted by the HTTP layer and not yet answered.",
          counters.in_flight)
    for reason, n in sorted(s.finished.items()):
        w.add("request_finished_total", "counter", "Finished requests by finish reason.", n,
              {"finished_reason": reason}, vllm="request_success_total" if reason in ("stop", "length") else None)
    for (endpoint, status), n in sorted(counters.responses.items()):
        w.add("http_responses_total", "counter", "HTTP responses by endpoint and status code.", n,
              {"endpoint": endpoint, "status": str(status)})
    for reason, n in sorted(counters.rejected.items()):
        w.add("requests_rejected_total", "counter", "Requests refused before generation, by reason.", n,
              {"reason": reason})
    w.add("client_disconnects_total", "counter", "Requests cancelled because the client went away.",
          counters.disconnects)
    w.add("request_timeouts_total", "counter", "Requests cancelled by the per-request timeout.", counters.timeouts)
    # -- tokens and KV
    w.add("prompt_tokens_total", "counter", "Prompt tokens processed.", s.prompt_tokens, vllm="prompt_tokens_total")
    w.add("prompt_tokens_cached_total", "counter", "Prompt tokens copied from another request's KV, not computed.",
          s.cached_prompt_tokens, vllm="prefix_cache_hits_total")  # vLLM counts its hits in tokens too
    w.add("prefix_cache_hit_requests_total", "counter", "Requests that copied a shared prompt prefix.",
          s.prefix_hits)
    w.add("generation_tokens_total", "counter", "Tokens generated.", s.generation_tokens,
          vllm="generation_tokens_total")
    w.add("kv_reserved_tokens", "gauge", "KV positions reserved by admitted requests.", snapshot["kv_reserved"])
    w.add("kv_prefix_cached_tokens", "gauge", "KV positions held by finished requests kept as prompt-prefix donors "
          "(evicted before admission waits).", snapshot.get("kv_cached", 0))
    w.add("kv_budget_tokens", "gauge", "KV positions the engine may reserve.", snapshot["kv_budget"])
    w.add("kv_cache_usage_perc", "gauge", "Fraction of the KV budget reserved (0-1).",
          snapshot["kv_reserved"] / snapshot["kv_budget"] if snapshot["kv_budget"] else 0.0,
          vllm="kv_cache_usage_perc")
    # -- engine steps
    w.add("engine_step_seconds_sum", "summary", "Wall time of engine steps.", s.step_seconds_total)
    w.add("engine_step_seconds_count", "summary", "Wall time of engine steps.", s.steps)
    w.add("engine_last_step_seconds", "gauge", "Wall time of the latest engine step.", s.last_step_seconds)
    w.add("verify_budget_tokens_total", "counter", "Drafted tokens sent to verification, over all steps.",
          s.verify_budget_total)
    w.add("decode_requests_total", "counter", "Decoding requests, summed over steps (the budget's denominator).",
          s.decode_requests_total)
    w.add("verify_budget_per_request_step", "gauge",
          "Mean drafted tokens verified per decoding request per step (the scheduler's budget).",
          float(s.mean_verify_budget))
    # -- speculative decoding (vLLM's spec_decode_* where they overlap)
    w.add("spec_decode_num_drafts_total", "counter", "Verification rounds that carried at least one draft.",
          s.num_drafts, vllm="spec_decode_num_drafts_total")
    w.add("spec_decode_num_draft_tokens_total", "counter", "Drafted tokens verified.", s.num_draft_tokens,
          vllm="spec_decode_num_draft_tokens_total")
    w.add("spec_decode_num_accepted_tokens_total", "counter", "Drafted tokens accepted.", s.num_accepted_tokens,
          vllm="spec_decode_num_accepted_tokens_total")
    for pos, n in enumerate(s.accepted_per_position):
        w.add("spec_decode_num_accepted_tokens_per_pos_total", "counter", "Accepted drafts by position in block.",
              n, {"position": str(pos)}, vllm="spec_decode_num_accepted_tokens_per_pos_total")
    for pos, n in enumerate(s.verified_per_position):
        w.add("spec_decode_num_verified_tokens_per_pos_total", "counter", "Verified drafts by position in block.",
              n, {"position": str(pos)})
    # accepted length = tokens one round emits (accepted drafts + the target's own token), 1..gamma+1
    cumulative, total = 0, 0
    for length, n in enumerate(s.accepted_length_counts):
        cumulative, total = cumulative + n, total + length * n
        if length >= 1:
            w.add("spec_decode_accepted_length_bucket", "histogram", "Tokens emitted per verification round.",
                  cumulative, {"le": str(length)})
    w.add("spec_decode_accepted_length_bucket", "histogram", "Tokens emitted per verification round.", cumulative,
          {"le": "+Inf"})
    w.add("spec_decode_accepted_length_sum", "histogram", "Tokens emitted per verification round.", total)
    w.add("spec_decode_accepted_length_count", "histogram", "Tokens emitted per verification round.", cumulative)
    w.add("process_resident_memory_bytes", "gauge", "Resident memory of the server process.", rss_bytes)
    return w.text()
