"""EAGLE-3 baseline: engine exactness, the T = 1 law, train/inference alignment, TTT training, checkpoints."""
import json
import sys
from pathlib import Path

import pytest
import torch

from dspark.decoding import SamplingParams, make_generator
from dspark.drafters import make_drafter
from dspark.drafters.base import DraftRequest
from dspark.drafters.dspark_model import DrafterArch
from dspark.drafters.eagle3 import Eagle3Drafter
from dspark.drafters.eagle3_model import Eagle3Model
from dspark.models.transformer import Segment
from dspark.training import eagle3_losses
from dspark_testlib import speculative, tiny_target
from test_dspark_exactness import (FIRST, PROMPT, V, _engine_run, assert_first_tokens_match_target,
                                   assert_seeded_engine_reproducible, plain_greedy)

sys.path.insert(0, str(Path(__file__).parent.parent / "training"))
from tiny_target import make_target_dir, random_dataset  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def tiny_eagle3(target, steps: int = 4, seed: int = 1, gamma: int | None = None, noise: float = 0.0,
                copy: bool = False):
    """A random Eagle3 drafter over all target layers. noise: random fuse weights of that std (a drafter far
    from the target). copy: g = the last layer's state and small attention/MLP outputs, so step 1 ≈ the target's
    distribution at the anchor's position — on a target that repeats its last token, drafts get accepted."""
    L = target.config.num_layers
    arch = DrafterArch(drafter_type="eagle3", layer_ids=tuple(range(L)), num_layers=1, block_size=steps,
                       head="none", rank=0, confidence=False)
    torch.manual_seed(seed)
    model = Eagle3Model(arch, target)
    model.init_from_target(target)
    d = target.config.hidden_size
    with torch.no_grad():
        if noise:
            model.fuse.weight.normal_(0, noise)
        if copy:
            model.fuse.weight.zero_()
            model.fuse.weight[:, (L - 1) * d:] = torch.eye(d)
            model.layer.o.weight.mul_(0.1)
            model.layer.down.weight.mul_(0.1)
    return Eagle3Drafter(model.eval().requires_grad_(False), target, gamma, bf16=False)  # fp32: vs references


def test_step_weights_are_powers_of_0_8():
    from dspark.training.config import LossSection
    from dspark.training.trainer import RECIPES

    w = eagle3_losses.step_weights(7)
    assert torch.allclose(w, torch.tensor([0.8 ** k for k in range(7)]))
    assert torch.equal(RECIPES["eagle3"].weights(7, LossSection()), w)


def test_engine_greedy_with_eagle3_equals_plain_greedy():
    from dspark.scheduling.registry import make_policy

    target = tiny_target(seed=4, scale=6.0)  # greedy repeats the last token
    drafter = tiny_eagle3(target, steps=7, copy=True)
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [5, 17, 33, 2, 9], [40, 41], [7]]  # ragged, chunked prefill, 1 token
    params = [SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)] * len(prompts)
    reqs = _engine_run(target, drafter, make_policy("fixed-4"), prompts, params)
    for prompt, req in zip(prompts, reqs):
        assert req.error is None and req.output == plain_greedy(target, prompt, 24)
    assert sum(r.accepted for r in reqs) > 0  # the accept path (context rollback of rejected drafts) ran
    assert all(not r.draft.state or r.cache is not None for r in reqs)  # released, unless kept as a prefix donor


def test_engine_seeded_sampling_with_eagle3():
    target = tiny_target(seed=4, scale=2.0)
    drafter = tiny_eagle3(target, steps=7)
    assert_seeded_engine_reproducible(target, drafter)


def test_t1_output_distribution_matches_target():
    target = tiny_target(vocab=V, hidden=32, layers=2, seed=11, scale=3.0)
    drafter = tiny_eagle3(target, steps=3, noise=0.3)
    n, params, stats = 20_000, SamplingParams(temperature=1.0), {}
    outs = speculative(target, drafter, [PROMPT] * n, params, FIRST, seeds=list(range(n)), capacity=16, stats=stats)
    assert 0 < stats["accepted"] < 0.9 * stats["rounds"] * 3  # both acceptances and rejections
    assert_first_tokens_match_target(target, outs, n)


def test_training_unroll_equals_inference_chain():
    """The TTT forward on a sequence made of the drafter's own samples reproduces the drafted distributions:
    training and inference share the alignment (g_{a−1} + x_a at step 1, own h after)."""
    from dspark.training.features import OnlineFeatures, TokenizedData
    from dspark.training.packing import BlockPlan

    target = tiny_target(seed=5, scale=2.0)
    drafter = tiny_eagle3(target, steps=5)
    prompt, anchor = [5, 17, 33, 2, 9, 11, 12], 40
    cache = target.new_cache(capacity=32)
    out = target.forward(torch.tensor(prompt), [Segment(cache, 0, len(prompt))], hidden_layers=drafter.needs_layers)
    req = DraftRequest(tokens=prompt + [anchor], params=SamplingParams(temperature=1.0), generator=make_generator(3))
    drafter.observe(req, out.hidden, len(prompt))
    prop = drafter.propose([req])
    ids = torch.tensor(prompt + [anchor] + prop.tokens[0].tolist())
    other = torch.tensor([9, 8, 7, 6, 5, 4, 3, 2, 1, 2, 3, 4, 5, 6])  # a second, longer sequence in the batch
    source = OnlineFeatures(target, TokenizedData([ids, other], [torch.ones(len(ids), dtype=torch.bool),
                                                                 torch.ones(len(other), dtype=torch.bool)]),
                            drafter.needs_layers, "float32")
    a = len(prompt)
    plans = [BlockPlan(0, torch.tensor([a]), torch.ones(1, 5, dtype=torch.bool), a + 5),  # + one padding block
             BlockPlan(1, torch.tensor([2, 8]), torch.ones(2, 5, dtype=torch.bool), 13)]
    batch = eagle3_losses.load_batch(source, plans, 5, 0)
    assert batch.ctx_next.tolist() == ids[1: a + 1].tolist() + other[1:9].tolist()  # x_{t+1} of each row t
    with torch.no_grad():
        h = eagle3_losses.forward_hidden(drafter.model, batch)  # [G=2, A=2, γ, d]
        q = drafter.model.base_logits(h[0, 0]).softmax(-1)
    assert torch.isfinite(h).all()
    torch.testing.assert_close(q, prop.probs[0], atol=2e-5, rtol=1e-4)
    # Step 1 of the second sequence's anchor 8 needs no sampled token: compare it with a fresh inference.
    out2 = target.forward(other[:8], [Segment(target.new_cache(capacity=32), 0, 8)], hidden_layers=drafter.needs_layers)
    req2 = DraftRequest(tokens=other[:9].tolist(), params=SamplingParams(temperature=1.0), generator=make_generator(0))
    drafter.observe(req2, out2.hidden, 8)
    with torch.no_grad():
        q2 = drafter.model.base_logits(h[1, 1, 0]).softmax(-1)
    torch.testing.assert_close(q2, drafter.propose([req2]).probs[0, 0], atol=2e-5, rtol=1e-4)


def test_ttt_training_decreases_loss_and_checkpoint_round_trips(tmp_path):
    from safetensors.torch import load_file

    from dspark.models import load_model
    from dspark.training.config import config_from_dict
    from dspark.training.trainer import Trainer

    target_dir = make_target_dir(tmp_path / "target")
    data = random_dataset(tmp_path / "data.jsonl", 4, seed=2, lengths=(24, 40))
    loaded = load_model(str(target_dir))
    cfg = config_from_dict({
        "target": {"name": str(target_dir)},
        "drafter": {"type": "eagle3", "layer_ids": [0, 1, 2], "block_size": 7},
        # every anchor candidate each step (anchors_per_seq > candidates): the same batch, so the loss must fall
        "data": {"dataset": str(data), "anchors_per_seq": 64, "max_seq_len": 64, "feature_dtype": "float32"},
        "optim": {"batch_seqs": 4, "max_steps": 8, "warmup_steps": 1, "lr": 3e-3, "min_lr_ratio": 1.0,
                  "loss_chunk_blocks": 16},
        "run": {"out_dir": str(tmp_path / "run"), "ckpt_every": 100, "progress": False, "threads": 1}})
    trainer = Trainer(cfg, loaded=loaded)
    assert isinstance(trainer.model, Eagle3Model)
    losses = [trainer.train_step()["loss"] for _ in range(7)]
    print("TTT losses", [round(x, 3) for x in losses])
    assert losses[-1] < 0.9 * losses[0], losses
    summary = trainer.run()
    assert summary["step"] == 8
    config = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())
    assert config["drafter_type"] == config["arch"]["drafter_type"] == "eagle3"
    drafter = make_drafter(summary["drafter"], target=loaded.model)
    assert isinstance(drafter, Eagle3Drafter) and drafter.gamma == 7 and drafter.needs_layers == (0, 1, 2)
    saved = load_file(str(tmp_path / "run" / "drafter" / "model.safetensors"))
    for key, value in drafter.model.state_dict().items():
        assert torch.equal(value, saved[key]), key
    # The loaded drafter drafts exactly: greedy speculative decoding equals plain greedy.
    prompt = [5, 17, 33, 2, 9]
    got = speculative(loaded.model, drafter, [prompt], SamplingParams(temperature=0), 20, seeds=[0], capacity=64)[0]
    assert got == plain_greedy(loaded.model, prompt, 20)


def test_rollback_recomputes_the_entry_before_it():
    """observe(start=p) drops features >= p and the context entry p−1 (it pairs g_{p−1} with x_p)."""
    target = tiny_target(seed=6)
    drafter = tiny_eagle3(target, steps=3)
    seq = [5, 17, 33, 2, 9, 11]
    out = target.forward(torch.tensor(seq), [Segment(target.new_cache(capacity=16), 0, len(seq))],
                         hidden_layers=drafter.needs_layers)
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=1.0)  # sampled: probs to compare
    fresh = DraftRequest(tokens=seq[:4] + [40], params=sampled, generator=make_generator(0))
    drafter.observe(fresh, {i: h[:4] for i, h in out.hidden.items()}, 4)
    req = DraftRequest(tokens=seq + [7], params=sampled, generator=make_generator(0))
    drafter.observe(req, out.hidden, len(seq))
    drafter.propose([req])  # projects entries 0..5
    req.tokens, req.generator = seq[:4] + [40], make_generator(0)
    drafter.observe(req, {i: h[:0] for i, h in out.hidden.items()}, 0, start=4)
    a, b = drafter.propose([req]), drafter.propose([fresh])
    assert torch.equal(a.tokens, b.tokens) and torch.allclose(a.probs, b.probs)
    with pytest.raises(Exception, match="observed"):
        drafter.propose([DraftRequest(tokens=seq + [1, 2], params=greedy, generator=make_generator(0),
                                      state=req.state)])
