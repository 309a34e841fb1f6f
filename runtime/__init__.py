"""Shared runtime for every epd service: model loading and the E/P/D split, the KV
block layout, tensor wire format, settings and the cost model.

Services import this package; they never import each other.
"""
