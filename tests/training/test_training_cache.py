"""Target cache: same loss as online features, int8 option, atomic shards with resume, refusals."""
import json

import pytest
import torch

from dspark.drafters.dspark_model import DrafterArch, DSparkModel
from dspark.models import load_model
from dspark.training import target_cache
from dspark.training.features import OnlineFeatures, load_sequences
from dspark.training.losses import batch_loss
from dspark.training.packing import load_batch, plan_batch
from dspark.training.target_cache import CacheError, CachedFeatures, build_cache, estimate
from tiny_target import make_target_dir, random_dataset

LAYERS, GAMMA = (0, 1, 2), 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    loaded = load_model(str(make_target_dir(root / "target")))
    data = load_sequences(random_dataset(root / "data.jsonl", 10), loaded.tokenizer, 64)
    return loaded, data


def loss_on(source, model, seqs):
    plans = plan_batch(source, seqs, epoch=0, seed=3, anchors_per_seq=8, block_size=GAMMA)
    with torch.no_grad():
        loss, _ = batch_loss(model, load_batch(source, plans, GAMMA, 95))
    return float(loss)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_cache_and_online_give_the_same_loss(tmp_path, setup, dtype):
    loaded, data = setup
    build_cache(tmp_path / "c", loaded.model, data, LAYERS, dtype=dtype, shard_tokens=100, batch_tokens=1 << 20,
                progress=False)
    cached = CachedFeatures(tmp_path / "c", LAYERS, target=loaded.model)
    online = OnlineFeatures(loaded.model, data, LAYERS, dtype)
    assert len(cached) == len(online) == 10 and all(torch.equal(a, b) for a, b in zip(cached.data.ids, data.ids))
    torch.manual_seed(0)
    model = DSparkModel(DrafterArch(layer_ids=LAYERS, block_size=GAMMA, mask_token_id=95, rank=8), loaded.model)
    seqs = [0, 3, 4, 9]
    assert abs(loss_on(cached, model, seqs) - loss_on(online, model, seqs)) < 1e-6
    sub = CachedFeatures(tmp_path / "c", (0, 2))  # a subset of the cached layers
    torch.testing.assert_close(sub.features([1])[0].layers, cached.features([1])[0].layers[:, [0, 2]])
    first = CachedFeatures(tmp_path / "c", LAYERS, limit=4)  # data.limit applies to a cache as to online data
    assert len(first) == 4 and all(torch.equal(a, b) for a, b in zip(first.data.ids, data.ids[:4]))
    torch.testing.assert_close(first.features([3])[0].final, cached.features([3])[0].final)


def test_interrupted_build_keeps_a_valid_cache_and_resumes(tmp_path, setup, monkeypatch):
    loaded, data = setup
    real, calls = target_cache._save_shard, []

    def disk_full(path, *args):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(path, *args)

    monkeypatch.setattr(target_cache, "_save_shard", disk_full)
    with pytest.raises(OSError):
        build_cache(tmp_path / "c", loaded.model, data, LAYERS, shard_tokens=100, progress=False)
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert len(manifest["shards"]) == 2 and not manifest["complete"]
    assert not list((tmp_path / "c").glob(".*tmp"))  # no half-written files left behind
    partial = CachedFeatures(tmp_path / "c")
    assert len(partial) == manifest["sequences"]  # what is there is readable
    monkeypatch.setattr(target_cache, "_save_shard", real)
    done = build_cache(tmp_path / "c", loaded.model, data, LAYERS, shard_tokens=100, progress=False)
    build_cache(tmp_path / "ref", loaded.model, data, LAYERS, shard_tokens=100, progress=False)
    a, b = CachedFeatures(tmp_path / "c"), CachedFeatures(tmp_path / "ref")
    assert done["complete"] and len(a) == len(b) == 10
    for i in range(10):
        assert torch.equal(a.features([i])[0].layers, b.features([i])[0].layers)


def test_resume_refuses_changed_data_or_settings(tmp_path, setup):
    loaded, data = setup
    build_cache(tmp_path / "c", loaded.model, data, LAYERS, shard_tokens=100, progress=False)
    with pytest.raises(CacheError, match="other settings"):
        build_cache(tmp_path / "c", loaded.model, data, (0, 1), progress=False)
    from dspark.training.features import TokenizedData
    changed = TokenizedData([data.ids[0].flip(0), *data.ids[1:]], data.masks)
    with pytest.raises(CacheError, match="changed"):
        build_cache(tmp_path / "c", loaded.model, changed, LAYERS, progress=False)


def test_estimate_matches_the_built_size(tmp_path, setup):
    loaded, data = setup
    est = estimate(data, len(LAYERS), 64, "bfloat16")
    manifest = build_cache(tmp_path / "c", loaded.model, data, LAYERS, progress=False)
    assert est["tokens"] == manifest["tokens"] and est["bytes_per_token"] == 4 + 1 + 4 * 64 * 2
    on_disk = sum(s["bytes"] for s in manifest["shards"])
    assert 0.9 * est["bytes"] < on_disk < 1.1 * est["bytes"] + 4096


@pytest.mark.parametrize("suffix", [".xz", ".gz"])
def test_compressed_datasets_load_like_plain_ones_and_truncation_is_an_error(tmp_path, setup, suffix):
    import gzip
    import lzma

    loaded, _ = setup
    plain = random_dataset(tmp_path / "data.jsonl", 6, seed=4)
    packed = tmp_path / f"data.jsonl{suffix}"
    packed.write_bytes((lzma.compress if suffix == ".xz" else gzip.compress)(plain.read_bytes()))
    want = load_sequences(plain, loaded.tokenizer, 64)
    assert len(want) == 6 and load_sequences(packed, loaded.tokenizer, 64).digest() == want.digest()
    if suffix == ".xz":  # a datagen directory holding only the committed, compressed copy
        plain.unlink()
        assert load_sequences(tmp_path, loaded.tokenizer, 64).digest() == want.digest()
    cut = tmp_path / f"cut.jsonl{suffix}"
    cut.write_bytes(packed.read_bytes()[: packed.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"cut.jsonl\{suffix}: the compressed file is truncated or corrupt"):
        load_sequences(cut, loaded.tokenizer, 64)
