import pytest

from conformance.harness.oracle import Oracle
from conformance.model import ModelConfig, TinyHybrid


@pytest.fixture(scope="session")
def model():
    return TinyHybrid(ModelConfig())


@pytest.fixture(scope="session")
def oracle(model):
    return Oracle(model)
