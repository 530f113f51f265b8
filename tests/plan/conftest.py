import pytest
from plan_models import TINY, WIDE, write_config


@pytest.fixture(autouse=True)
def _plan_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("GPUDOCTOR_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "plan-cache"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return write_config(tmp_path_factory.mktemp("tiny"), TINY)


@pytest.fixture(scope="session")
def wide_model(tmp_path_factory):
    return write_config(tmp_path_factory.mktemp("wide"), {**WIDE, "num_hidden_layers": 6})
