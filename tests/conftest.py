import pytest

from conformance.model import ModelConfig, TinyHybrid
from conformance.oracle import Oracle


@pytest.fixture(scope="session")
def model():
    return TinyHybrid(ModelConfig())


@pytest.fixture(scope="session")
def oracle(model):
    return Oracle(model)
