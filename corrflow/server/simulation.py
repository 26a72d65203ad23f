"""Run a corrflow simulation: Flower's simulation engine (Ray; ``backend="flower"``) or the in-process grid."""

from __future__ import annotations

import json
from pathlib import Path

from corrflow.strategies.config import StrategyConfig


def simulate(cfg: StrategyConfig, out_dir: str | Path, backend: str = "flower") -> dict:
    """Run ``cfg`` and return the final privacy report (also in ``out_dir/privacy_report.json``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from corrflow.clients.numpy_client import app as client_app
    from corrflow.clients.numpy_client import identity, train
    from corrflow.server.app import make_server_app, run_server

    if backend == "inprocess":
        from corrflow.server.inprocess import InProcessGrid

        run_server(InProcessGrid({"train": train, "query": identity}, cfg.num_users), cfg, out)
    else:
        from flwr.simulation import run_simulation

        run_simulation(server_app=make_server_app(cfg, out), client_app=client_app, num_supernodes=cfg.num_users,
                       backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    report_path = out / "privacy_report.json"
    if not report_path.exists():
        raise RuntimeError(f"the simulation produced no privacy report in {out} (see the log above)")
    return json.loads(report_path.read_text())
