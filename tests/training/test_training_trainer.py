"""Trainer: config validation, exact resume, torchrun (2 processes, gloo) = 1 process, end-to-end drafter."""
import csv
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from dspark.models import load_model
from dspark.training.config import ConfigError, config_from_dict, load_config
from dspark.training.trainer import Trainer
from tiny_target import make_target_dir, random_dataset


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = make_target_dir(root / "target")
    return root, target, random_dataset(root / "data.jsonl", 16, seed=2)


def raw_config(env, out, draft_vocab=0, **optim):
    root, target, data = env
    return {"target": {"name": str(target)},
            "drafter": {"layer_ids": [0, 1, 2], "num_layers": 2, "block_size": 4, "rank": 8, "head": "markov",
                        "draft_vocab": draft_vocab},
            "data": {"dataset": str(data), "anchors_per_seq": 6, "max_seq_len": 64, "feature_dtype": "bfloat16"},
            "optim": {"batch_seqs": 4, "max_steps": 4, "warmup_steps": 2, "lr": 3e-3, "loss_chunk_blocks": 5,
                      **optim},
            "run": {"out_dir": str(out), "ckpt_every": 100, "progress": False, "threads": 1}}


def weights(path):
    return load_file(str(path / "model.safetensors"))


def test_config_rejects_unknown_keys_and_bad_types(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['lrr'\] in \[optim\]"):
        config_from_dict({"optim": {"lrr": 1.0}})
    with pytest.raises(ConfigError, match="unknown key"):
        config_from_dict({"optimizer": {}})
    with pytest.raises(ConfigError, match="optim.max_steps must be of type int"):
        config_from_dict({}, ["optim.max_steps=1.5"])
    path = tmp_path / "c.toml"
    path.write_text('[optim]\nlr = 1e-3\n[drafter]\nlayer_ids = [1, 2]\n')
    cfg = load_config(path, ["optim.lr=2e-3", "run.out_dir=/tmp/x y", "drafter.confidence=false"])
    assert cfg.optim.lr == 2e-3 and cfg.drafter.layer_ids == (1, 2) and cfg.run.out_dir == "/tmp/x y"
    assert cfg.drafter.confidence is False
    with pytest.raises(AttributeError):
        cfg.optim.lr = 1.0  # frozen


@pytest.mark.parametrize("draft_vocab", [0, 40])
def test_resume_equals_uninterrupted_training(env, tmp_path, draft_vocab):
    loaded = load_model(str(env[1]))
    full = Trainer(config_from_dict(raw_config(env, tmp_path / "full", draft_vocab)), loaded=loaded)
    full.run()
    part = Trainer(config_from_dict(raw_config(env, tmp_path / "part", draft_vocab)), loaded=loaded)
    part.train_step()
    part.train_step()
    part.save()
    del part
    resumed = Trainer(config_from_dict(raw_config(env, tmp_path / "part", draft_vocab)), loaded=loaded)
    assert resumed.step == 2
    torch.manual_seed(1234)  # resume must not depend on the RNG state of the new process
    summary = resumed.run()
    assert summary["step"] == 4
    a, b = weights(tmp_path / "full" / "drafter"), weights(tmp_path / "part" / "drafter")
    for key in a:
        assert torch.equal(a[key], b[key]), key
    if draft_vocab:  # the ids travel with the weights, and the export records how much of the data they cover
        assert a["vocab_ids"].dtype == torch.int64 and a["vocab_ids"].numel() == draft_vocab
        saved = json.loads((tmp_path / "full" / "drafter" / "config.json").read_text())
        assert 0 < saved["training"]["draft_vocab_coverage"] <= 1
    steps = lambda run: [r["step"] for r in csv.DictReader(open(tmp_path / run / "train_log.csv"))]  # noqa
    assert steps("full") == ["1", "2", "3", "4"] and steps("part") == ["3", "4"]


def test_torchrun_two_processes_match_one(env, tmp_path):
    if shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None:
        pytest.skip("torchrun is not installed next to this Python")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    one.write_text(json.dumps(raw_config(env, tmp_path / "run1", grad_accum=2, max_steps=3)))
    two.write_text(json.dumps(raw_config(env, tmp_path / "run2", grad_accum=1, max_steps=3)))
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "dspark.training", "train", "--config", str(one)], check=True,
                   env=environment, capture_output=True)
    done = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "dspark.training", "train",
                           "--config", str(two)], env=environment, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = weights(tmp_path / "run1" / "drafter"), weights(tmp_path / "run2" / "drafter")
    for key in a:
        assert torch.equal(a[key], b[key]), key  # the same micro-batches and sums: bitwise equal


def test_a_failed_checkpoint_write_keeps_the_previous_one(env, tmp_path, monkeypatch):
    from dspark.training import checkpoint

    loaded = load_model(str(env[1]))
    trainer = Trainer(config_from_dict(raw_config(env, tmp_path / "r")), loaded=loaded)
    trainer.train_step()
    first = trainer.save()
    trainer.train_step()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", disk_full)
    with pytest.raises(OSError):
        trainer.save()
    monkeypatch.undo()
    assert checkpoint.latest_checkpoint(tmp_path / "r") == first
    assert [p.name for p in (tmp_path / "r" / "checkpoints").iterdir()] == sorted(["latest.json", first.name])
    assert Trainer(config_from_dict(raw_config(env, tmp_path / "r")), loaded=loaded).step == 1


def test_init_from_an_exported_drafter_continues_its_weights_and_vocabulary(env, tmp_path):
    loaded = load_model(str(env[1]))
    first = Trainer(config_from_dict(raw_config(env, tmp_path / "a", draft_vocab=48)), loaded=loaded)
    first.train_step()
    exported = first.export()
    raw = raw_config(env, tmp_path / "b", draft_vocab=48)
    raw["run"]["init_from"] = str(exported)
    second = Trainer(config_from_dict(raw), loaded=loaded)
    assert second.step == 0  # a new run: fresh optimizer and schedule
    assert torch.equal(second.model.vocab_ids, first.model.vocab_ids)
    ours, theirs = second.model.state_dict(), first.model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert second.train_step()["loss"] > 0
    raw["drafter"]["rank"], raw["run"]["out_dir"] = 4, str(tmp_path / "c")
    with pytest.raises(ConfigError, match="another architecture.*rank: 8 there, 4 here"):
        Trainer(config_from_dict(raw), loaded=loaded)


class TickClock:
    """perf_counter for the trainer: every reading is one second after the last."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        self.now += 1.0
        return self.now


def test_fit_steps_to_time_ends_the_schedule_inside_the_time_box(env, tmp_path, monkeypatch):
    from dspark.training import trainer as trainer_module

    raw = raw_config(env, tmp_path / "r", max_steps=1000, warmup_steps=12, min_lr_ratio=0.1)
    raw["run"].update(max_time_s=200.0, fit_steps_to_time=True, export_on_stop=True, ckpt_every=5)
    monkeypatch.setattr(trainer_module, "time", TickClock())
    loaded = load_model(str(env[1]))
    trainer = Trainer(config_from_dict(raw), loaded=loaded)
    result = trainer.run()
    # A loop iteration reads the clock 3 times (4 with a checkpoint's), so some 55-60 steps fit 200 s.
    assert 40 < trainer.max_steps < 70 and result["step"] == trainer.max_steps  # finished, not cut off
    assert trainer.lr_at(trainer.max_steps - 1) == pytest.approx(3e-3 * 0.1, rel=0.02)  # the cosine ran out
    training = json.loads((tmp_path / "r" / "drafter" / "config.json").read_text())["training"]
    assert training["fit"] == {"from": 1000, "to": trainer.max_steps}
    assert Trainer(config_from_dict(raw), loaded=loaded).max_steps == trainer.max_steps  # kept on resume
    raw["optim"]["max_steps"] = 2000  # a new schedule (a warm restart) is not capped by the old fit
    assert Trainer(config_from_dict(raw), loaded=loaded).max_steps == 2000


def test_profile_steps_writes_where_the_time_went(env, tmp_path):
    raw = raw_config(env, tmp_path / "r", max_steps=13)
    raw["run"]["profile_steps"] = 2
    Trainer(config_from_dict(raw), loaded=load_model(str(env[1]))).run()
    text = (tmp_path / "r" / "profile.txt").read_text()
    assert text.startswith("steps 11-12:") and "aten::" in text and "Self CPU" in text


def test_training_never_imports_the_engine_or_the_server():
    code = ("import sys, dspark.training.cli, dspark.training.trainer, dspark.training.datagen, "
            "dspark.training.datagen_local, dspark.training.datagen_endpoint, dspark.training.target_cache; "
            "bad = [m for m in sys.modules if m.startswith(('dspark.engine', 'dspark.serving'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bf16_target_trains_like_fp32_and_exports_for_the_fp32_target(env, tmp_path):
    """Online features from a bf16 target (1.3x a CPU step where bf16 products are native) must train the
    same drafter to rounding: the fp32 drafter sees features rounded to bf16 either way (data.feature_dtype),
    and the export must load onto the fp32 target it will serve."""
    from dspark.drafters.dspark_checkpoint import load_drafter_model

    loaded32 = load_model(str(env[1]))
    loaded16 = load_model(str(env[1]), "bfloat16")
    raw16 = raw_config(env, tmp_path / "bf16")
    raw16["target"]["dtype"] = "bfloat16"
    t32 = Trainer(config_from_dict(raw_config(env, tmp_path / "fp32")), loaded=loaded32)
    t16 = Trainer(config_from_dict(raw16), loaded=loaded16)
    assert all(p.dtype == torch.float32 for p in t16.params)  # AdamW keeps fp32 master weights
    s32, s16 = t32.train_step(), t16.train_step()  # the same initial weights and batch
    for key in ("ce", "tv", "conf"):
        assert s16[key] == pytest.approx(s32[key], rel=2e-3), key  # measured: within 2e-4
    t16.run()
    model, saved = load_drafter_model(tmp_path / "bf16" / "drafter", loaded32.model)  # strict fingerprint
    assert saved["training"]["config"]["target"]["dtype"] == "bfloat16"
    assert all(torch.isfinite(p).all() for p in model.parameters())
