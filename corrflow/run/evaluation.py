"""Server-side evaluation every N rounds (``eval_every``): the held-out evaluation costs about as
much as a round of a small model, so a 2,052-round run evaluates a subset of its rounds. The
initial model and the final round are always evaluated (the learning verdict compares them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def evaluates(round_index: int, every: int, num_rounds: int) -> bool:
    """Whether round ``round_index`` (0-based) is evaluated: every ``every``-th round (1-based
    rounds N, 2N, …) and the run's last.

    Args:
        round_index: the round, 0-based.
        every: N ≥ 1.
        num_rounds: the run's planned rounds.

    Returns:
        True when the round's model is evaluated.
    """
    return (round_index + 1) % every == 0 or round_index + 1 == num_rounds


class ScheduledEvaluation:
    """The run's evaluation called on `evaluates` rounds only. `corrflow.run.Run` calls it with
    the new model inside ``step``, before the round is applied, so the round being released is the
    run's ``next_round``; `bind` gives it the run. Before it is bound (the initial model), every
    call evaluates."""

    def __init__(self, evaluate: Callable[[list[np.ndarray]], dict], every: int, num_rounds: int):
        self.evaluate, self.every, self.num_rounds = evaluate, int(every), int(num_rounds)
        self._run = None

    def bind(self, run) -> None:
        """Read the round being released from ``run`` (a `corrflow.run.Run`) from now on."""
        self._run = run

    def __call__(self, params: Sequence[np.ndarray]) -> dict:
        if self._run is None or evaluates(self._run.state.next_round, self.every, self.num_rounds):
            return self.evaluate(params)
        return {}
