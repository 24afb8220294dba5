import os
import shutil
import tempfile
from pathlib import Path

import pytest

from helpers import BENCH_DATA

# What the suite measures (kernel crossovers of tiny models, speed profiles) must never land in the user's cache,
# where a later `dspark serve` would read it. Content-addressed build outputs (de-quantised GGUF weights, compiled
# kernels: keyed by their inputs' hashes) are shared read-mostly through links, so a local run does not redo them.
SHARED_CACHE_PARTS = ("models", "native")


def pytest_configure(config):
    share_cores()
    if os.environ.get("DSPARK_TEST_CACHE_ISOLATED"):
        return  # a worker or subprocess of the suite, or a nested run: already isolated (workers share the root)
    user = Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark"))
    root = Path(tempfile.mkdtemp(prefix="dspark-test-cache-"))
    for part in SHARED_CACHE_PARTS:
        (user / part).mkdir(parents=True, exist_ok=True)
        (root / part).symlink_to(user / part, target_is_directory=True)
    os.environ["DSPARK_CACHE"] = str(root)
    os.environ["DSPARK_TEST_CACHE_ISOLATED"] = "1"
    config._dspark_test_cache = root


def share_cores():
    """Under `pytest -n N` each worker gets its share of the cores: most of the suite is Python-bound (tiny models,
    tens of thousands of small steps), where a second intra-op thread only spins, so N workers on N cores run it
    about N times as fast; tests that need several threads set them themselves."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_unconfigure(config):
    root = getattr(config, "_dspark_test_cache", None)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)  # removes the links, not what they point at


@pytest.fixture(scope="session")
def smollm2():
    from dspark.models import load_model

    return load_model()


@pytest.fixture(scope="session")
def bench_data():
    if not BENCH_DATA.is_dir():
        pytest.skip(f"../shared/bench_data not found at {BENCH_DATA}: benchmark prompts are read from there")
    return BENCH_DATA
