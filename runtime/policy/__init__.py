"""Admission, placement and failure policy with its cost model: pure functions the gateway and the simulator both call (no I/O, no model)."""
