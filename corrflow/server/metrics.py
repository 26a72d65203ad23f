"""Held-out metrics of a run as a person reads them: the per-round progress line and the end-of-run summary of
``metrics.json`` (a list: the initial model as ``"round": -1``, then one entry per round; written by the run
session)."""

from __future__ import annotations

import math


def round_line(metrics: dict, num_rounds: int) -> str:
    """``round t/n  accepted a/c  rejected j (most frequent reason)  test-loss L  accuracy A  ε E`` (accuracy only
    for tasks that have it)."""
    acc = f" accuracy {metrics['test_accuracy']:.4f}" if "test_accuracy" in metrics else ""
    loss = f" test-loss {metrics['test_loss']:.4f}" if "test_loss" in metrics else ""
    why = f" ({metrics['top_rejection']})" if metrics.get("top_rejection") else ""
    return (f"round {metrics['round'] + 1:>4}/{num_rounds}  accepted {metrics['accepted']:>3}/{metrics['cohort']:<3g}"
            f" rejected {metrics['rejected']}{why}{loss}{acc}  ε {metrics.get('epsilon', float('nan')):.3f}")


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
