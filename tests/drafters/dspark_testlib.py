"""Tiny random targets, random DSpark drafters, and a batched speculative loop that calls observe().

The loop is the engine contract in miniature: prefill with hidden-state taps → observe → (propose → verify
forward → verify → truncate → observe)*. It runs many requests at once so statistical tests stay fast.
"""
from __future__ import annotations

import torch

from dspark.decoding import SamplingParams, draw_uniforms, make_generator, sample_from, to_probs, verify, verify_greedy
from dspark.drafters.base import DraftRequest
from dspark.drafters.dspark import DSparkDrafter
from dspark.drafters.dspark_model import DrafterArch, DSparkModel
from dspark.models.config import parse_hf_config
from dspark.models.transformer import Segment
from dspark.models.weights import build_transformer


def tiny_target(vocab: int = 96, hidden: int = 64, layers: int = 3, seed: int = 0, scale: float = 1.0):
    """A random Llama in our runtime (built from HF-named tensors, like real checkpoints)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
               num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw)).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(scale)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return build_transformer(parse_hf_config(raw), state, torch.float32)


def tiny_drafter(target, *, head: str = "markov", rank: int = 8, block: int = 4, layers: int = 1, seed: int = 1,
                 head_scale: float | None = None, confidence: bool = True, gamma: int | None = None,
                 bf16: bool = False) -> DSparkDrafter:
    """A random DSpark/DFlash drafter for `target`; fp32 products unless `bf16` (not the CPU-dependent default,
    so that tests comparing against fp32 references behave the same on every machine)."""
    L = target.config.num_layers
    arch = DrafterArch(drafter_type="dspark" if head != "none" else "dflash", layer_ids=tuple(range(L)),
                       num_layers=layers, block_size=block, mask_token_id=target.config.vocab_size - 1,
                       head=head, rank=rank if head != "none" else 0, confidence=confidence)
    torch.manual_seed(seed)
    model = DSparkModel(arch, target)
    model.init_from_target(target)
    if model.head is not None and head_scale is not None:
        with torch.no_grad():  # make the sequential head matter: its bias is then comparable to the logits
            model.head.w1.weight.normal_(0, head_scale)
            model.head.w2.weight.normal_(0, head_scale)
    return DSparkDrafter(model.eval().requires_grad_(False), target, gamma, bf16=bf16)


def speculative(target, drafter, prompts: list[list[int]], params: SamplingParams, n_tokens: int,
                seeds: list[int], capacity: int = 32, stats: dict | None = None) -> list[list[int]]:
    """Generate n_tokens per prompt with speculative decoding (no stop tokens) -> emitted tokens per request.
    `stats` (optional) receives the number of rounds and of accepted drafts."""
    R, layers = len(prompts), drafter.needs_layers
    caches = [target.new_cache(capacity=capacity) for _ in range(R)]
    requests = [DraftRequest(tokens=list(p), params=params, generator=make_generator(s))
                for p, s in zip(prompts, seeds)]
    lengths = [len(p) for p in prompts]
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    out = target.forward(torch.tensor([t for p in prompts for t in p]),
                         [Segment(c, 0, n) for c, n in zip(caches, lengths)],
                         logit_rows=offsets[1:] - 1, hidden_layers=layers)
    drafter.observe_batch(requests, out.hidden, offsets[:-1].tolist(), lengths)
    probs = to_probs(out.logits, params)
    u = torch.cat([torch.rand(1, generator=r.generator, dtype=torch.float64) for r in requests])
    emitted = [[t] for t in sample_from(probs, u).tolist()]
    for r, e in zip(requests, emitted):
        r.tokens.append(e[0])
    active = list(range(R))
    while active:
        accepted = _round(target, drafter, [requests[i] for i in active], [caches[i] for i in active], params,
                          [emitted[i] for i in active])
        if stats is not None:
            stats["rounds"] = stats.get("rounds", 0) + len(active)
            stats["accepted"] = stats.get("accepted", 0) + accepted
        active = [i for i in active if len(emitted[i]) < n_tokens]
    return [e[:n_tokens] for e in emitted]


def _round(target, drafter, requests, caches, params, emitted) -> int:
    prop = drafter.propose(requests)
    R, gamma = prop.tokens.shape
    starts = [len(r.tokens) - 1 for r in requests]
    tokens = torch.cat([torch.cat([torch.tensor([r.tokens[-1]]), prop.tokens[i]]) for i, r in enumerate(requests)])
    out = target.forward(tokens, [Segment(c, s, gamma + 1) for c, s in zip(caches, starts)],
                         hidden_layers=drafter.needs_layers)
    logits = out.logits.view(R, gamma + 1, -1)
    num = prop.num_tokens
    if params.greedy:
        result = verify_greedy(prop.tokens, logits, num)
    else:
        uniforms = draw_uniforms([r.generator for r in requests], num, gamma)
        result = verify(prop.tokens, prop.probs, to_probs(logits, params), num, uniforms, vocab=prop.vocab)
    counts = []
    for i, (r, c, s) in enumerate(zip(requests, caches, starts)):
        kept = int(result.accepted[i]) + 1  # the anchor and the accepted drafts stay in the target cache
        c.truncate(s + kept)
        counts.append(kept)
        new = result.emitted(prop.tokens, i)
        r.tokens.extend(new)
        emitted[i].extend(new)
    drafter.observe_batch(requests, out.hidden, [i * (gamma + 1) for i in range(R)], counts)
    return int(result.accepted.sum())
