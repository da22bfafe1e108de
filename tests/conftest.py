import pytest
import torch

from conformance.harness.oracle import Oracle
from conformance.model import ModelConfig, TinyHybrid

# As every front door does: the tiny model's tensors only pay for intra-op threads
# (on a loaded machine, tens of times slower).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model():
    return TinyHybrid(ModelConfig())


@pytest.fixture(scope="session")
def oracle(model):
    return Oracle(model)
