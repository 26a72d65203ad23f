"""The private training run without Flower: one round as data in, a record out, and everything
that persists it (checkpoint, release journal, ledger, registry, privacy report) so that a killed
run resumes.

`prepare` fixes a run's `RunPlan`; a `Run` owns its state (read-only outside: `RunView`), noise
(in process or on Ray workers), secrets and files, and is driven by `Run.plan_next` and `Run.step`
with `Reply` values from any transport; the Flower strategies in `corrflow.strategies` are one.
"""

from corrflow.run.core import Run, open_run_directory, prepare
from corrflow.run.plan import RunPlan
from corrflow.run.resume import RunLock
from corrflow.run.round import Reply, RoundPlan, RoundRecord, SummedReplies
from corrflow.run.state import RunView

__all__ = [
    "Reply",
    "RoundPlan",
    "RoundRecord",
    "Run",
    "RunLock",
    "RunPlan",
    "RunView",
    "SummedReplies",
    "open_run_directory",
    "prepare",
]
