"""The end-of-run summary of ``metrics.json`` (a list: the initial model as ``"round": -1``, then one entry per
round; written by the run session)."""

from __future__ import annotations

import math


def summary(entries: list[dict]) -> dict:
    """Initial and final held-out loss (and accuracy), and the loss's relative improvement over the run."""
    first, last = entries[0], entries[-1]
    out = {"initial_test_loss": first["test_loss"], "final_test_loss": last["test_loss"],
           "rounds_evaluated": len(entries) - 1}
    if "test_accuracy" in first:
        out.update(initial_test_accuracy=first["test_accuracy"], final_test_accuracy=last["test_accuracy"])
    if first["test_loss"] and math.isfinite(first["test_loss"]):
        out["loss_improvement"] = 1.0 - last["test_loss"] / first["test_loss"]
    return out
