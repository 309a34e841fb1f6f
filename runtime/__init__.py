"""Shared runtime for every epd service, in four parts that import one way
(``model`` and ``policy`` import nothing of the others; ``worker`` imports ``model``):

- ``runtime.model``: the E/P/D split of one Hugging Face VLM, KV blocks, sampling;
- ``runtime.worker``: what every gRPC worker process shares (server life, settings, auth, wire);
- ``runtime.policy``: admission, placement and failure policy and the cost model (gateway + simulator);
- ``runtime.demo_model``: builds and trains the shipped demo checkpoint.

Services import this package (and ``cache``); they never import each other.
"""
