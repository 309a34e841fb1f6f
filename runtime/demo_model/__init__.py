"""The shipped demo VLM: a small, real LLaVA-style model trained on synthetic shapes.

It loads through exactly the code path a real checkpoint uses
(``AutoProcessor`` / ``AutoModelForImageTextToText``), so tests and the default
run exercise the real serving path without downloading weights.
"""
