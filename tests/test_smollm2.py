"""The embedded SmolLM2-135M: our forward vs transformers, and speculative == plain on real prompts."""
import math

import pytest
import torch

from dspark.decoding import SamplingParams
from dspark.drafters import make_drafter
from dspark.engine import Generation, TransformerTarget
from dspark.models import Segment
from helpers import bench_prompts, chat_ids

MAX_NEW = 48


class RecordingTarget(TransformerTarget):
    """Keeps the last-row logits of every forward: in plain decoding, the logits that chose each token."""

    def __init__(self, model):
        super().__init__(model)
        self.rows = []

    def forward(self, state, start, tokens, last_only=False):
        logits = super().forward(state, start, tokens, last_only)
        self.rows.append(logits[-1].clone())
        return logits


def run(target, drafter, ids, params, eos):
    return [t for chunk in Generation(target, drafter, ids, params, eos) for t in chunk]


def test_logits_match_transformers_reading_the_gguf_itself(smollm2):
    """transformers de-quantises the GGUF with its own converter: an independent check of ours too."""
    from transformers import AutoModelForCausalLM
    from dspark.models.loader import EMBEDDED, embedded_path

    path = embedded_path("smollm2-135m-instruct")
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor(chat_ids(smollm2.tokenizer, "Name three prime numbers and explain why."))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    ours = smollm2.model.forward(ids, [Segment(smollm2.model.new_cache(), 0, len(ids))]).logits
    diff = float((ours - ref).abs().max() / ref.abs().max())
    print(f"SmolLM2-135M max relative logit difference vs transformers: {diff:.2e}")
    assert diff < 1e-3
    assert torch.equal(ours[-1].argmax(), ref[-1].argmax())


@pytest.fixture(scope="module")
def plain_runs() -> dict:
    """prompt -> (plain greedy tokens, the logits that chose each): the DSpark case's prompts are the first of the
    n-gram case's, so their reference decoding runs once."""
    return {}


@pytest.mark.parametrize("drafter_name,per_set", [("ngram", 3), ("dspark", 2)])
def test_greedy_speculation_equals_plain_decoding(smollm2, bench_data, plain_runs, drafter_name, per_set):
    """Real prompts (3 a set for n-gram, 2 for the shipped DSpark drafter): token-identical, or the first divergence
    is a float near-tie (top-2 gap < 1e-4)."""
    model, eos = smollm2.model, smollm2.eos_ids
    drafter = make_drafter(drafter_name, target=model, gamma=7)
    layers = drafter.needs_layers
    greedy = SamplingParams(temperature=0, max_new_tokens=MAX_NEW)
    prompts = bench_prompts(per_set)
    assert len(prompts) >= 4 * per_set
    identical, accepted = 0, 0
    for text in prompts:
        ids = chat_ids(smollm2.tokenizer, text)
        if text not in plain_runs:
            recorder = RecordingTarget(model)
            plain_runs[text] = (run(recorder, None, ids, greedy, eos), recorder.rows)
        plain, rows = plain_runs[text]
        gen = Generation(TransformerTarget(model, hidden_layers=layers), drafter, ids, greedy, eos)
        spec = [t for chunk in gen for t in chunk]
        accepted += gen.stats.accepted
        if spec == plain:
            identical += 1
            continue
        i = next(k for k, (a, b) in enumerate(zip(spec, plain)) if a != b) if spec[:len(plain)] != plain[:len(spec)] \
            else min(len(spec), len(plain))
        top2 = rows[i].topk(2).values
        gap = float(top2[0] - top2[1])
        print(f"divergence at token {i}: top-2 logit gap {gap:.2e}")
        assert gap < 1e-4, f"outputs diverge at token {i} although the top-2 gap is {gap}"
    print(f"{identical}/{len(prompts)} identical; {accepted} drafts accepted")
    assert accepted > 0  # the comparison must actually exercise multi-token verification
    assert identical >= len(prompts) - 2


def test_shipped_drafter_is_found_by_the_targets_fingerprint(smollm2):
    from dspark.drafters import DrafterError
    from dspark.drafters.ngram import NGramDrafter
    from dspark.drafters.shipped import auto_allowed, shipped_for

    drafter = make_drafter("dspark", target=smollm2.model)
    assert drafter.has_confidence and drafter.calibration is not None and drafter.gamma == 7
    path = shipped_for(smollm2.model)
    for scheduled in (False, True):  # defaults.json decides, from measurements, where auto may pick it
        auto = make_drafter("auto", target=smollm2.model, scheduled=scheduled)
        assert isinstance(auto, NGramDrafter) != auto_allowed(path, scheduled)
    assert auto_allowed(path, scheduled=True)  # the engine's async scheduler keeps it from costing (README)
    from helpers import hf_model, ours_from_hf
    with pytest.raises(DrafterError, match="no shipped DSpark drafter matches this target"):
        make_drafter("dspark", target=ours_from_hf(hf_model("llama")))


@pytest.mark.parametrize("drafter_name", ["none", "ngram"])
def test_same_seed_same_output(smollm2, drafter_name):
    drafter = make_drafter(drafter_name, gamma=5)
    target = TransformerTarget(smollm2.model)
    ids = chat_ids(smollm2.tokenizer, "Write a short poem about the sea, then repeat it.")
    outs = [run(target, drafter, ids, SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=40, seed=s),
                smollm2.eos_ids) for s in (11, 11, 12)]
    assert outs[0] == outs[1]
    assert outs[0] != outs[2]


@pytest.fixture(scope="module")
def smollm2_bf16():
    from dspark.models import load_model

    return load_model(dtype="bfloat16")


def bf16_ulp(x: float) -> float:
    """The spacing of bf16 numbers at |x| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0 ** -133


def test_bf16_engine_greedy_equals_plain_up_to_one_ulp_ties(smollm2_bf16, bench_data):
    """A bf16 target through the batched engine (the shipped drafter, the async scheduler, 8 prompts in one batch)
    against one-request plain decoding in bf16. The LM head's logits are rounded to bf16, and oneDNN rounds a
    one-row product and an n-row one differently, so an exact tie or a one-ulp gap can flip between the two runs:
    every divergence must be such a tie, the two tokens within one bf16 ulp of each other in both runs, never a
    real difference (when written, 2 of the 8 diverged, each at a gap of 0 in one run and one ulp in the other)."""
    from dspark.engine.engine import Engine, EngineConfig
    from dspark.scheduling.registry import make_policy

    model, tok, eos = smollm2_bf16.model, smollm2_bf16.tokenizer, smollm2_bf16.eos_ids
    assert model.embed.dtype == torch.bfloat16
    prompts = [chat_ids(tok, text) for text in bench_prompts(2)]
    n = 40
    drafter = make_drafter("dspark", target=model, gamma=7)
    policy = make_policy("async", sps=lambda b: 1.0 / (0.01 + 1e-4 * b))  # flat prices: drafts get verified
    engine = Engine(model, tok, drafter, policy, eos, EngineConfig(gamma=7))
    reqs = [engine.add_request(ids, SamplingParams(temperature=0, max_new_tokens=n, logprobs=5)) for ids in prompts]
    while engine.has_unfinished():
        engine.step()
    assert sum(r.accepted for r in reqs) > 0
    identical = 0
    for req, ids in zip(reqs, prompts):
        recorder = RecordingTarget(model)
        plain = run(recorder, None, ids, SamplingParams(temperature=0, max_new_tokens=n), eos)
        if req.output == plain:
            identical += 1
            continue
        i = next(k for k, (a, b) in enumerate(zip(plain, req.output)) if a != b)  # both ran n tokens, no EOS yet
        a, b = plain[i], req.output[i]  # plain's choice, the engine's
        row = recorder.rows[i].float()
        top = dict(req.logprobs[i].top)  # log-softmax: differences are logit differences
        assert a in top, f"token {i}: plain's choice is not among the engine's top 5"
        plain_gap, engine_gap = float(row[a] - row[b]), top[b] - top[a]
        ulp = bf16_ulp(float(row[a]))
        print(f"divergence at token {i}: plain gap {plain_gap}, engine gap {engine_gap:.6f}, one ulp {ulp}")
        assert 0 <= plain_gap <= ulp and -1e-4 <= engine_gap <= ulp + 1e-4
    print(f"{identical}/{len(prompts)} identical")
    assert identical >= len(prompts) // 4
    from dspark.models import kernel_choice
    if all(p.native and p.native_rows == kernel_choice.EVERY_ROW for p in kernel_choice.projections(model)):
        # our bf16 kernel serves every row count (a CPU whose torch packs no bf16 weights, e.g. AVX2 only), and a
        # row's result does not depend on the rows beside it: no tie can flip, every output is plain decoding's
        assert identical == len(prompts)
