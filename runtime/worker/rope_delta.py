"""The per-sequence rope delta across the handoff: one rule for a missing or different delta.

M-RoPE families (Qwen-VL): after the prompt, the token at sequence position ``p`` has
position ``p + rope_delta`` on all three axes. The gateway computes the delta from the
token ids and the images' grids (no weights needed) and sends it in ``Reserve`` (and in
``PrefillRequest``); prefill sends the delta of the prompt it ran on the final KV chunk;
the stage that prepares the prompt compares its own. A delta lost on the way is the
field's known bug (a decode side without the image grids used 0: wrong tokens, no
error), so for M-RoPE an absent delta is an error and a different one fails the
handoff, never taken as 0.

1-D families: the delta is 0 by definition; an absent field means 0 (peers that
predate it), a non-zero one is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.model.families import PositionKind


@dataclass(frozen=True, slots=True)
class RopeDeltaRule:
    kind: PositionKind

    @property
    def missing(self) -> int | None:
        """What an absent field means: 0 for a 1-D family, ``None`` (an error) for M-RoPE."""
        return None if self.kind == PositionKind.MROPE else 0

    def read(self, msg) -> int | None:
        """The ``rope_delta`` field of ``msg`` (any message with an ``optional sint64 rope_delta``)."""
        return int(msg.rope_delta) if msg.HasField("rope_delta") else self.missing

    def invalid(self, delta: int | None, what: str) -> str | None:
        """Why ``delta`` (``what`` carries it; ``None``: absent) cannot be this model's, or ``None``."""
        if delta is None:
            return f"rope delta missing: {what} carries none (required for M-RoPE models)"
        if self.kind != PositionKind.MROPE and delta != 0:
            return f"rope delta {delta} in {what}: a 1-D RoPE model has none"
        return None

    def problem(self, expected: int | None, actual: int | None, what: str, source: str = "the reservation") -> str | None:
        """Why ``actual`` (``what`` has it) is not ``expected`` (``source`` has it), or ``None`` when they agree."""
        problem = self.invalid(actual, what) or self.invalid(expected, source)
        if problem is None and actual != expected:
            problem = f"rope delta mismatch: {what} has {actual}, {source} {expected}"
        return problem
