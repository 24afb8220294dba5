import pytest

from helpers import BENCH_DATA


@pytest.fixture(scope="session")
def smollm2():
    from dspark.models import load_model

    return load_model()


@pytest.fixture(scope="session")
def bench_data():
    if not BENCH_DATA.is_dir():
        pytest.skip(f"../shared/bench_data not found at {BENCH_DATA}: benchmark prompts are read from there")
    return BENCH_DATA
