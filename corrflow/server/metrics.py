"""Held-out metrics of a run: the initial model's evaluation, the per-round progress line, ``metrics.json`` (a list:
the initial model as ``"round": -1``, then one entry per round) and the end-of-run summary."""

from __future__ import annotations

import json
import math
from pathlib import Path


def initial_entry(evaluate, params) -> dict:
    """The initial model's held-out metrics, recorded as round −1 (the baseline every later round compares to)."""
    return {"round": -1, **evaluate(params)}


def round_line(metrics: dict, num_rounds: int) -> str:
    """``round t/n  replies r/c  rejected j  test-loss L  accuracy A  ε E`` (accuracy only for tasks that have it)."""
    acc = f"  accuracy {metrics['test_accuracy']:.4f}" if "test_accuracy" in metrics else ""
    return (f"round {metrics['round'] + 1:>4}/{num_rounds}  replies {metrics['replies']:>3}/{metrics['cohort']:<4g} "
            f"rejected {metrics['rejected']:<2} test-loss {metrics['test_loss']:.4f}{acc}  "
            f"ε {metrics.get('epsilon', float('nan')):.3f}")


def write_metrics(path: str | Path, initial: dict, history: list[dict]) -> list[dict]:
    entries = [initial, *history]
    Path(path).write_text(json.dumps(entries, indent=1))
    return entries


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
