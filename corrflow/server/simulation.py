"""Run a corrflow simulation: Flower's simulation engine (Ray; ``backend="flower"``) or the in-process grid."""

from __future__ import annotations

import json
from pathlib import Path

from corrflow.strategies.config import StrategyConfig


def simulate(cfg: StrategyConfig, out_dir: str | Path, backend: str = "flower") -> dict:
    """Run ``cfg`` and return the final privacy report (also in ``out_dir/privacy_report.json``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from corrflow.clients.tasks import get_task
    from corrflow.server.app import make_server_app, run_server

    task = get_task(cfg.client, cfg.model_dim, cfg.data_path, cfg.vocab_path, cfg.seq_len, cfg.seed)
    if backend == "inprocess":
        from corrflow.server.inprocess import InProcessGrid

        run_server(InProcessGrid(task.handlers, cfg.num_users), cfg, out)
    else:
        from flwr.simulation import run_simulation

        run_simulation(server_app=make_server_app(cfg, out), client_app=task.client_app,
                       num_supernodes=cfg.num_users, backend_config=_backend_config(cfg))
    report_path = out / "privacy_report.json"
    if not report_path.exists():
        raise RuntimeError(f"the simulation produced no privacy report in {out} (see the log above)")
    return json.loads(report_path.read_text())


def _backend_config(cfg: StrategyConfig) -> dict:
    """One CPU per simulated client; with a GPU visible to TensorFlow, Keras clients share it (4 per GPU)."""
    gpus = 0.0
    if cfg.client == "keras":
        import tensorflow as tf

        if tf.config.list_physical_devices("GPU"):
            gpus = 0.25
    config = {"client_resources": {"num_cpus": 1, "num_gpus": gpus}}
    if gpus:
        config["init_args"] = {"num_gpus": 1}
    return config
