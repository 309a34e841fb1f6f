"""Fixtures shared by the gateway HTTP-layer tests: the real demo model behind the in-process backend;
and ``one_torch_thread`` for the modules that run tiny models in process
(``pytestmark = pytest.mark.usefixtures("one_torch_thread")``).

Modules that need another `backend` (e.g. a served one) define their own, which takes precedence.
"""

import pytest
import torch

from gateway.prompt import PromptBuilder
from inprocess_backend import InProcessBackend, demo_model_path, load_adapter


@pytest.fixture(scope="module")
def model():
    return load_adapter()


@pytest.fixture(scope="module")
def prompts() -> PromptBuilder:
    return PromptBuilder.from_pretrained(demo_model_path()[0])


@pytest.fixture
def backend(model) -> InProcessBackend:
    return InProcessBackend(model[0])


@pytest.fixture(scope="module")
def one_torch_thread():
    """These models are tiny: one intra-op thread is several times faster than two on a shared 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
