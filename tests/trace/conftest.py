import pytest

from trace_helpers import tiny_llama


@pytest.fixture
def llama():
    return tiny_llama()
