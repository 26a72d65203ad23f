"""The run, without Flower: the DP round as data in, record out, and everything that persists it.

`prepare` decides a run's frozen `RunPlan`; `Run` owns its state (read-only
outside: `RunView`), noise stream, secrets and files, and is driven by
`Run.plan_next` and `Run.step` with `Reply` values from any transport (the Flower
strategies in `corrflow.strategies` are one). Modules: ``core`` (the run), ``plan``, ``round``
(the round's pure steps), ``state``, ``noise`` (the noise stream), ``clipping``, ``optimizer``,
``model`` (the model's layout), ``ledger``, ``recorder`` (checkpoint → journal → registry → report
→ metrics), ``checkpoint``, ``journal``, ``registry``, ``resume`` (run lock, resume checks),
``disclosure`` (what is public, what operator-only).
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
