"""Fixtures shared by the gateway HTTP-layer tests: the real demo model behind the in-process backend.

Modules that need another `backend` (e.g. a served one) define their own, which takes precedence.
"""

import pytest

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
