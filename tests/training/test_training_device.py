"""On a GPU (skipped without one): our forward and the training step give the CPU's numbers.

These guard the device paths the shipped drafter was trained with (scripts/train_default_drafter.sh); CI has
no GPU, so they run where one is lent."""
import pytest
import torch

from dspark.models import load_model
from dspark.models.transformer import Segment
from dspark.training.config import config_from_dict
from dspark.training.trainer import Trainer
from tiny_target import make_target_dir, random_dataset

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("device")
    return root, make_target_dir(root / "target"), random_dataset(root / "data.jsonl", 8, seed=3)


def _forward(model, seqs, cached=True):
    segments = [Segment(model.new_cache() if cached else None, 0, len(s)) for s in seqs]
    out = model.forward(torch.cat(seqs), segments, hidden_layers=(1,))
    return out.logits.cpu(), out.hidden[1].cpu()


@cuda
def test_ragged_forward_on_gpu_matches_cpu(env):
    _, target, _ = env
    seqs = [torch.randint(2, 90, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 17, 1)]
    cpu = _forward(load_model(str(target)).model, seqs)
    gpu_model = load_model(str(target), device="cuda").model
    for cached in (True, False):  # the serving path, and training features' padded path
        gpu = _forward(gpu_model, seqs, cached)
        for a, b in zip(cpu, gpu):
            assert torch.allclose(a, b, rtol=1e-3, atol=1e-3), (cached, float((a - b).abs().max()))


@cuda
@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_training_steps_on_gpu_match_cpu(env, tmp_path, kind):
    root, target, data = env

    def run(device):
        cfg = config_from_dict({
            "target": {"name": str(target), "device": device},
            "drafter": {"type": kind, "layer_ids": [0, 1, 2], "num_layers": 1 if kind == "eagle3" else 2, "block_size": 4, "rank": 8,
                        "draft_vocab": 64},
            "data": {"dataset": str(data), "anchors_per_seq": 6, "max_seq_len": 64, "feature_dtype": "float32"},
            "optim": {"batch_seqs": 4, "max_steps": 3, "warmup_steps": 1, "lr": 1e-3, "head_dtype": "float32"},
            "run": {"out_dir": str(tmp_path / device), "progress": False, "resume": False}})
        trainer = Trainer(cfg)
        losses = [trainer.train_step()["loss"] for _ in range(2)]
        trainer.save()  # checkpoint (optimizer state on the device) and an exact resume from it
        resumed = Trainer(config_from_dict({**cfg.to_dict(), "run": {**cfg.to_dict()["run"], "resume": True}}))
        assert resumed.step == 2
        return losses + [resumed.train_step()["loss"]], resumed.export()

    cpu_losses, _ = run("cpu")
    gpu_losses, exported = run("cuda")
    assert (exported / "model.safetensors").is_file()
    assert gpu_losses == pytest.approx(cpu_losses, rel=2e-3), (cpu_losses, gpu_losses)
