"""Planning a training run without Flower: factorization, participation (cohort planner) and noise
calibration.

`plan_privacy` turns a run's settings into its factorization, participation and calibrated σ
(what the strategy runs); ``corrflow plan`` ranks candidate mechanisms
(`corrflow.planning.candidates`) by the noise they leave in the trained model
(`corrflow.planning.score`) and writes the recommended one as a recipe
(`corrflow.planning.recipe`). How to use it: docs/how-to/plan.md.
"""

from corrflow.planning.run import (
    build_planner,
    load_graph,
    load_or_build_factorization,
    plan_privacy,
)
from corrflow.planning.score import (
    Damping,
    closed_loop_error,
    closed_loop_response,
    estimate_damping,
)

__all__ = [
    "Damping",
    "build_planner",
    "closed_loop_error",
    "closed_loop_response",
    "estimate_damping",
    "load_graph",
    "load_or_build_factorization",
    "plan_privacy",
]
