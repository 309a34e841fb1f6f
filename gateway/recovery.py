"""What follows a failed attempt: the transitions of the failure-and-retry loop, without I/O.

A ``Failure`` is what a failed attempt showed once its workers were probed;
``choose_action`` asks the failure policy (``runtime/policy``) which recovery fits the
time left; ``plan_recovery`` turns the policy's action into a ``RecoveryPlan``: the next
``Step`` and the workers the next attempt runs on. ``gateway/handoff.py`` carries plans
out (re-arm, release, reserve); everything here is pure, so each transition is tested
without processes.

==================  =======================  ==========================================
step                the reservation          the next attempt
==================  =======================  ==========================================
``RETRY``           kept (re-armed)          same decode; same prefill, unless it was lost
``REPREFILL``       kept (re-armed)          same decode; another prefill when one is free
``OTHER_DECODE``    released                 another decode worker (a new reservation)
``FAIL``            released                 none: 503, or 504 once the deadline passed
==================  =======================  ==========================================
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from runtime.policy.cost_model import CostModel
from runtime.policy.failure_policy import FailureAction, on_transfer_failure
from runtime.policy.loads import RequestShape, StageLoads

from .attempt import AttemptOutcome
from .worker_registry import WorkerHandle


class Step(Enum):
    RETRY = "retry"
    REPREFILL = "reprefill"
    OTHER_DECODE = "other_decode"
    FAIL = "fail"

    @property
    def keeps_reservation(self) -> bool:
        return self in (Step.RETRY, Step.REPREFILL)


@dataclass(frozen=True, slots=True)
class Failure:
    """A failed attempt, after the probes. ``decode_gone``: its blocks died with it."""

    outcome: AttemptOutcome
    detail: str
    prefill_gone: bool = False   # lost during the attempt and its probe did not answer: mark it unhealthy
    decode_gone: bool = False    # lost during the attempt, or its probe did not answer: mark it unhealthy

    def __post_init__(self) -> None:
        if self.outcome is AttemptOutcome.FIRST_TOKEN:
            raise ValueError("an attempt that produced a first token did not fail")


@dataclass(frozen=True, slots=True)
class RecoveryPlan:
    step: Step
    reason: str                    # the policy's reason, for logs and metrics
    decode: WorkerHandle           # where the next attempt runs (OTHER_DECODE: the new worker)
    prefill: WorkerHandle | None   # the next attempt's prefill worker (None: colocated)


def least_loaded_decode(handles: list[WorkerHandle]) -> WorkerHandle:
    return min(handles, key=lambda h: h.inflight + h.stats.running_seqs)


def least_loaded_prefill(handles: list[WorkerHandle]) -> WorkerHandle:
    return min(handles, key=lambda h: h.inflight + h.stats.queue_depth)


def choose_action(failure: Failure, attempts: int, shape: RequestShape, cost_model: CostModel, loads: StageLoads,
                  decode_worker: str, remaining_ms: float) -> FailureAction:
    """The failure policy's verdict on transfer attempt number ``attempts`` into ``decode_worker``
    (``runtime.policy.failure_policy``, the one the simulator runs too): a decode worker that is
    gone took its blocks with it, so the policy offers only another decode worker or failure."""
    return on_transfer_failure(remaining_ms, attempts, shape, cost_model, loads, decode_worker,
                               decode_lost=failure.decode_gone)


def plan_recovery(failure: Failure, action: FailureAction, decode: WorkerHandle, prefill: WorkerHandle | None,
                  other_decodes: list[WorkerHandle], free_prefills: list[WorkerHandle]) -> RecoveryPlan:
    """The next step and its workers. ``other_decodes``/``free_prefills``: the healthy workers
    other than this attempt's (after the probes' marks); ``other_decodes`` is not empty when the
    action is ``other_decode`` (the policy offers it only then)."""
    step = Step(action.kind)
    if step is Step.FAIL:
        return RecoveryPlan(step, action.reason, decode, prefill)
    if prefill is not None and free_prefills and (failure.outcome is AttemptOutcome.PREFILL_LOST
                                                  or step is Step.REPREFILL):   # colocated stays colocated
        prefill = least_loaded_prefill(free_prefills)
    if step is Step.OTHER_DECODE:
        decode = least_loaded_decode(other_decodes)
    return RecoveryPlan(step, action.reason, decode, prefill)
