"""The cohort engine (``--backend cohort``) against the per-client path (``--backend
inprocess``) and Flower's simulation engine (Ray), printed as one JSON object.

* ``client_speedup`` — client-side CPU per client-round: on the per-client path the train message
  (the model as an ArrayRecord and the round's config), the ClientApp call (the user's sentences
  rebuilt from the generator, local SGD, the reply's ArrayRecord) and the reply's decoding into a
  `corrflow.run.Reply`; on the cohort engine the whole cohort's batched local SGD, its per-user
  data cache and the Reply arrays. Both train the same cohorts of the stackoverflow preset's model
  (nextword, d = 6,732, m = 44) over a miniature of its schedule: G groups of m users, each trained
  k = 6 times (so the cohort engine's data cache is hit 5 times in 6, as in the full run). Each
  engine first trains one untimed round of m other users (imports, first calls, numba loading its
  cached kernels: ``cohort_warm_up_round_cpu_s``), so no timed user's data is built beforehand.
* ``run_speedup`` — whole-run CPU of ``simulate --preset stackoverflow`` (``--eval-every`` as the
  preset sets it) on both engines. The per-client run of 2,052 rounds costs tens of CPU-minutes
  on this machine, so both run the same prefix of ``--rounds`` rounds of the real preset (same
  factorization, cohorts and noise calibration) and stop; the JSON gives the prefix's CPU, the
  CPU after round 1 per round (steady state), and the whole run extrapolated from them.
* ``flower`` — Flower's simulation engine on a bounded version of the same schedule (population
  G·m, 6·G rounds), its wall time per round (Ray's workers run in other processes: their CPU is
  not the driver's), or why it did not finish within ``--flower-timeout`` seconds.
* pfl-research is not a column: it runs only with a PyTorch or TensorFlow model in its own
  environment (pfl 0.6.0 pins dp-accounting < 0.6), which this benchmark does not install.

Usage: python benchmarks/simulation.py [--rounds 60] [--groups 8] [--flower-timeout 300]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from corrflow.clients.tasks import task_for
from corrflow.config import RunConfig
from corrflow.run import RoundPlan
from corrflow.run.model import ModelLayout
from corrflow.server.cohort_backend import CohortTrainer
from corrflow.server.compare import PRESETS, _preset_settings
from corrflow.server.inprocess import InProcessGrid, enable_offline_messages
from corrflow.strategies.messaging import model_record, to_reply, train_messages

PRESET = PRESETS["stackoverflow"]
EPOCHS = 6


def _schedule(groups: int, cohort: int) -> list[list[int]]:
    """Fixed-epoch cohorts over ``groups`` groups of ``cohort`` users, each group trained EPOCHS
    times."""
    return [list(range(g * cohort, (g + 1) * cohort)) for _ in range(EPOCHS) for g in range(groups)]


def _plan(t: int, users: list[int]) -> RoundPlan:
    ids = tuple(f"partition-{u}" for u in users)
    return RoundPlan(t, ids, ids).route({f"partition-{u}": u for u in users}, set(users))


def client_side(groups: int) -> dict:
    """CPU seconds per client-round of both engines' client side (module docstring). Each engine
    first trains one untimed round of users outside the timed ones (imports, first-call set-up,
    numba's loading of its compiled kernels), so neither engine's data is built before timing."""
    cfg = RunConfig(**{**_preset_settings(PRESET, 0, Path("unused")), "num_users": None})
    task = task_for(cfg)
    sent = task.initial_weights()
    rng = np.random.default_rng(0)
    sent = [(w + 0.05 * rng.normal(size=w.shape)).astype(np.float32) for w in sent]
    warm = list(range(groups * PRESET.cohort, (groups + 1) * PRESET.cohort))
    rounds = _schedule(groups, PRESET.cohort)
    enable_offline_messages()
    grid = InProcessGrid(task.handlers, (groups + 1) * PRESET.cohort)
    node_of = dict(enumerate(sorted(grid.nodes)))  # partition → the grid's node id
    layout = ModelLayout.of(sent)
    record = model_record(layout, sent)

    def per_client_round(t: int, users: list[int]) -> None:
        ids = tuple(f"partition-{u}" for u in users)
        plan = RoundPlan(t, ids, ids).route(
            {f"partition-{u}": node_of[u] for u in users}, set(grid.nodes)
        )
        messages = train_messages(cfg, plan, record, {})
        grid.push_messages(messages)
        sent_to = {m.metadata.message_id: int(m.metadata.dst_node_id) for m in messages}
        owners = dict(plan.owners)
        for msg in grid.pull_messages([]):
            to_reply(msg, sent_to[msg.metadata.reply_to_message_id], owners)

    per_client_round(len(rounds), warm)
    start = time.process_time()
    for t, users in enumerate(rounds):
        per_client_round(t, users)
    per_client = time.process_time() - start
    trainer = CohortTrainer(cfg, task, layout.keys)
    start = time.process_time()
    trainer.replies(sent, _plan(len(rounds), warm))
    warm_cohort = time.process_time() - start
    start = time.process_time()
    for t, users in enumerate(rounds):
        trainer.replies(sent, _plan(t, users))
    cohort = time.process_time() - start
    client_rounds = len(rounds) * PRESET.cohort
    return {
        "client_rounds": client_rounds,
        "per_client_cpu_ms_per_client_round": 1e3 * per_client / client_rounds,
        "cohort_cpu_ms_per_client_round": 1e3 * cohort / client_rounds,
        "cohort_warm_up_round_cpu_s": warm_cohort,
        "client_speedup": per_client / cohort,
    }


def whole_run(backend: str, rounds: int, out: Path) -> dict:
    """CPU of the stackoverflow preset's first ``rounds`` rounds on ``backend`` (this process)."""
    from corrflow.server.app import run_server

    settings = _preset_settings(PRESET, 0, out)
    cfg = RunConfig(**settings, target_epsilon=8.0)
    stop, marks = threading.Event(), []

    def end(*args):
        marks.append(time.process_time())
        if len(marks) >= rounds:
            stop.set()

    start = time.process_time()
    if backend == "cohort":
        from corrflow.server.cohort_backend import run_cohort

        run_cohort(cfg, stop_event=stop, on_round_end=end)
    else:
        task = task_for(cfg)
        run_server(
            InProcessGrid(task.handlers, cfg.num_users),
            cfg,
            quiet=True,
            stop_event=stop,
            on_round_end=end,
        )
    total = time.process_time() - start
    steady = (marks[-1] - marks[0]) / max(1, len(marks) - 1)
    startup = marks[0] - start
    return {
        "rounds": len(marks),
        "cpu_s": total,
        "startup_and_round_1_cpu_s": startup,
        "cpu_ms_per_round": 1e3 * steady,
        "whole_run_cpu_s_extrapolated": startup + steady * (PRESET.rounds - 1),
    }


def flower(groups: int, timeout: float, out: Path) -> dict:
    """Flower's simulation engine on G·m users, 6·G rounds (bounded by ``timeout`` seconds)."""
    users, rounds = groups * PRESET.cohort, EPOCHS * groups
    cmd = [
        sys.executable, "-m", "corrflow.server.cli", "simulate", "--backend", "flower",
        "--client", "nextword", "--users", str(users), "--rounds", str(rounds),
        "--epochs", str(EPOCHS), "--delta", "1e-6", "--target-epsilon", "8",
        "--out", str(out), "--json",
    ]  # fmt: skip
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"users": users, "rounds": rounds, "finished": False, "timeout_s": timeout}
    wall = time.monotonic() - start
    return {
        "users": users,
        "rounds": rounds,
        "finished": done.returncode in (0, 3),
        "exit_code": done.returncode,
        "wall_s": wall,
        "wall_ms_per_client_round": 1e3 * wall / (rounds * PRESET.cohort),
        "note": "includes Ray's start-up; the workers' CPU is in other processes",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=60, help="prefix of the preset's rounds")
    parser.add_argument("--groups", type=int, default=8, help="G of the client-side miniature")
    parser.add_argument("--flower-timeout", type=float, default=300.0)
    parser.add_argument("--no-flower", action="store_true")
    args = parser.parse_args()
    result: dict = {"preset": PRESET.name, "cohort": PRESET.cohort, "model_parameters": 6732}
    result.update(client_side(args.groups))
    with tempfile.TemporaryDirectory() as tmp:
        runs = {b: whole_run(b, args.rounds, Path(tmp) / b) for b in ("inprocess", "cohort")}
        result["runs"] = runs
        result["run_speedup"] = runs["inprocess"]["cpu_s"] / runs["cohort"]["cpu_s"]
        result["run_speedup_extrapolated"] = (
            runs["inprocess"]["whole_run_cpu_s_extrapolated"]
            / runs["cohort"]["whole_run_cpu_s_extrapolated"]
        )
        result["run_speedup_measured_on"] = f"the preset's first {args.rounds} of 2052 rounds"
        if not args.no_flower:
            result["flower"] = flower(args.groups, args.flower_timeout, Path(tmp) / "flower")
    result["pfl"] = (
        "not run: pfl 0.6.0 trains PyTorch or TensorFlow models in its own environment "
        "(dp-accounting < 0.6); not installed here"
    )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
