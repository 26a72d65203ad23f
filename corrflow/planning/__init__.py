"""Planning a training run without Flower: factorization, participation (cohort planner) and noise calibration.
"""

from corrflow.planning.run import build_planner, load_graph, load_or_build_factorization, plan_privacy

__all__ = ["build_planner", "load_graph", "load_or_build_factorization", "plan_privacy"]
