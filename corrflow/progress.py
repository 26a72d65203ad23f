"""Progress reporting for long computations: a rich bar on stderr that appears only after one
second."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

#: Optimizers call ``callback(iteration, loss)``; returning nothing.
ProgressCallback = Callable[[int, float], None]


class Progress:
    """Context manager yielding a `ProgressCallback`; silent when ``quiet`` or for work under
    a second."""

    def __init__(
        self,
        description: str,
        total: int | None = None,
        quiet: bool = False,
        delay: float = 1.0,
        unit: str | None = None,
    ):
        self.description = description
        self.unit = unit  # counting progress ("12000 users") instead of optimizer iterations
        self.total = total
        self.quiet = quiet
        self.delay = delay
        self._bar = None
        self._task = None
        self._start = 0.0

    def __enter__(self) -> ProgressCallback:
        self._start = time.monotonic()
        return self.update

    def update(self, iteration: int | None, loss: float = float("nan")) -> None:
        if self.quiet or iteration is None:
            return
        if self._bar is None:
            if time.monotonic() - self._start < self.delay:
                return
            from rich.console import Console
            from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                console=Console(file=sys.stderr),
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(self.description, total=self.total, info="")
        info = f"{iteration} {self.unit}" if self.unit else f"iter {iteration}  loss {loss:.6g}"
        self._bar.update(self._task, completed=iteration, info=info)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()


def round_line(metrics: dict, num_rounds: int) -> str:
    """``round t/n  accepted a/c  rejected j (most frequent reason)  test-loss L  accuracy A  ε E``
    (accuracy only for tasks that have it; the reply counts only where the run publishes them, never
    in an amplified run)."""
    acc = f" accuracy {metrics['test_accuracy']:.4f}" if "test_accuracy" in metrics else ""
    loss = f" test-loss {metrics['test_loss']:.4f}" if "test_loss" in metrics else ""
    why = f" ({metrics['top_rejection']})" if metrics.get("top_rejection") else ""
    counts = (
        f"  accepted {metrics['accepted']:>3}/{metrics['cohort']:<3g} rejected "
        f"{metrics['rejected']}{why}"
        if "accepted" in metrics
        else ""
    )
    return f"round {metrics['round'] + 1:>4}/{num_rounds}{counts}{loss}{acc}  " + (
        f"ε spent {metrics['epsilon']:.3f}"
        if metrics.get("epsilon") is not None
        else "non-private (no ε)"
    )
