"""``corrflow audit``: one training run with canary clients, and what the released models show about
its ε.

The run is an ordinary in-process simulation (the production server code path from sampling to
release: on the per-client path, `InProcessGrid`, or on the cohort engine, ``--backend cohort``)
whose population holds, besides the real users, the *inserted* canaries: one SuperNode each,
scheduled, clipped, noised and accounted exactly like a real user. A canary does no training: it
returns the model it was sent plus ζ·c_j, its fixed unit direction c_j scaled to the clip norm ζ, in
every round it is asked (Andrew et al., arXiv 2302.03098). The *held-out* canaries — the candidates
whose coin came up "out" (Steinke et al., arXiv 2305.08846) — never take part; their directions are
the null.

After the run, the per-round model changes D_t = θ_{t+1} − θ_t (what an adversary who sees every
released model sees) are scored per canary with the whitened matched filter of
`corrflow.accounting.audit`, and the report gives the run's own claimed ε, the one-shot
estimate ε̂ with a bootstrap interval, the one-run 95% lower bound ε_lo, the final-model (cosine)
estimate of Andrew et al., and a PNG of the score histograms.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time

import numpy as np

from corrflow.clients.tasks import Task, get_task
from corrflow.config import RunConfig
from corrflow.errors import require
from corrflow.fileio import write_json
from corrflow.paths import run_directory
from corrflow.server.app import run_server
from corrflow.server.inprocess import InProcessGrid
from corrflow.server.simulation import RunInterruptedError, engine_output, stop_on_signals
from corrflow.strategies.canaries import (
    CANARY_KEY,
    CanaryPlan,
    RoundCapture,
    analyse,
    canary_handlers,
    write_plot,
)

log = logging.getLogger("corrflow")


#: The engines an audit trains on: both in this process (`check_audit_backend`).
AUDIT_BACKENDS = ("inprocess", "cohort")


def check_audit_backend(cfg: RunConfig, backend: str) -> None:
    """Refuse, naming the flag, an engine the audit cannot train on: it runs in this process, on
    the per-client path (``inprocess``) or the cohort engine (``cohort``, within what that engine
    serves: `corrflow.server.cohort_backend.check_supported`).

    Raises:
        InvalidArgumentError: (``--backend`` or the setting the cohort engine refuses).
    """
    require(
        backend in AUDIT_BACKENDS,
        "--backend",
        "inprocess or cohort (an audit trains in this process; Flower's Ray engine is not used)",
        backend,
    )
    if backend == "cohort":
        from corrflow.server.cohort_backend import check_supported

        check_supported(cfg)


def run_audit(
    cfg: RunConfig,
    canaries: int,
    audit_seed: int | None = None,
    *,
    backend: str = "inprocess",
    noise_key: bytes | None = None,
    quiet: bool = False,
    verbose: bool = False,
    plot: bool = True,
) -> dict:
    """Train ``cfg`` in its run directory (always a fresh run; an earlier one there is moved aside)
    with ``canaries`` candidate canaries on ``backend`` (`AUDIT_BACKENDS`), and return the audit
    (also written to ``audit.json`` there). ``noise_key``: for tests only (a real audit draws a
    fresh secret key, like every run)."""
    _check_auditable(cfg)
    check_audit_backend(cfg, backend)
    seed = secrets.randbits(32) if audit_seed is None else int(audit_seed)
    plan = CanaryPlan.draw(canaries, seed)
    real = int(cfg.num_users)
    out = run_directory(cfg.state_dir)
    cfg = cfg.replace(state_dir=str(out), num_users=real + len(plan.inserted_ids))
    out.mkdir(parents=True, exist_ok=True)
    task = get_task(cfg.client, cfg.model_dim, cfg.data_path, cfg.vocab_path, cfg.seq_len, cfg.seed)
    capture = RoundCapture([_flat_floats(task.initial_weights())], [])
    started = time.perf_counter()
    train = _train_cohort if backend == "cohort" else _train_per_client
    with stop_on_signals() as stop, engine_output(out / "engine.log", verbose):
        strategy = train(cfg, task, plan, real, capture, noise_key, quiet, stop)
    report = json.loads((out / "privacy_report.json").read_text())
    if stop.is_set() and report["rounds_completed"] < cfg.num_rounds:
        raise RunInterruptedError(report.get("stopped_reason") or "interrupted")
    require(
        report["rounds_completed"] >= 1,
        "rounds",
        "a run that released at least one round to audit",
        report.get("stopped_reason"),
    )
    users = {j: f"partition-{real + r}" for r, j in enumerate(plan.inserted_ids)}
    result = analyse(report, strategy, capture, plan, users, real, cfg)
    result["seconds"] = time.perf_counter() - started
    if plot:
        result["plot"] = str(write_plot(result, capture.scores, out / "audit.png"))
    write_json(out / "audit.json", result, sort_keys=True)
    return result


def _check_auditable(cfg: RunConfig) -> None:
    """A private cross-device run without secure aggregation."""
    require(cfg.mode == "cross-device", "mode", "cross-device (a canary is a SuperNode)", cfg.mode)
    require(
        not cfg.secure_aggregation,
        "--secagg",
        "no secure aggregation in an audit (canaries answer in the clear; the mechanism, σ and ε "
        "are those of the run without it)",
    )
    require(
        cfg.target_epsilon is not None or cfg.noise_multiplier is not None,
        "target-epsilon",
        "a private run (the audit compares against its ε)",
    )


def _flat_floats(arrays: list[np.ndarray]) -> np.ndarray:
    """The floating-point arrays of a model, flattened into one float64 vector."""
    return np.concatenate(
        [
            np.asarray(a, np.float64).ravel()
            for a in arrays
            if np.issubdtype(np.asarray(a).dtype, np.floating)
        ]
    )


def _train_per_client(
    cfg: RunConfig,
    task: Task,
    plan: CanaryPlan,
    real: int,
    capture: RoundCapture,
    noise_key: bytes | None,
    quiet: bool,
    stop: threading.Event,
):
    """The audit's run on the per-client path: the canaries are ClientApps of the in-process
    grid (node config `CANARY_KEY`). Returns the strategy that ran it."""
    node_config = {real + r: {CANARY_KEY: j} for r, j in enumerate(plan.inserted_ids)}
    handlers = canary_handlers(task.handlers, plan, float(cfg.clip_norm), cfg.reply_kind)
    grid = InProcessGrid(handlers, cfg.num_users, node_config=lambda p: node_config.get(p, {}))
    return run_server(
        grid,
        cfg,
        noise_key=noise_key,
        quiet=quiet,
        on_round_end=capture,
        fresh=True,
        stop_event=stop,
    )


def _train_cohort(
    cfg: RunConfig,
    task: Task,
    plan: CanaryPlan,
    real: int,
    capture: RoundCapture,
    noise_key: bytes | None,
    quiet: bool,
    stop: threading.Event,
):
    """The audit's run on the cohort engine: the canaries answer beside the trained cohort
    (`corrflow.server.cohort_backend.Canaries`). Returns the run's `RunView`."""
    from corrflow.server.app import run_cohort_server
    from corrflow.server.cohort_backend import Canaries, RunView

    nodes = {real + r: j for r, j in enumerate(plan.inserted_ids)}
    view: list[RunView] = []
    run_cohort_server(
        cfg,
        noise_key=noise_key,
        quiet=quiet,
        fresh=True,
        stop_event=stop,
        on_round_end=lambda metrics: capture(view[0], metrics),
        on_start=lambda run: view.append(RunView(run)),
        canaries=Canaries(plan, nodes, float(cfg.clip_norm)),
    )
    return view[0]


__all__ = ["AUDIT_BACKENDS", "check_audit_backend", "run_audit"]
