"""Helper for test_ray_faults: one corrflow simulation on Flower's simulation engine (Ray) with a
fixed first noise key (each restart draws its own from the OS), exiting as `corrflow simulate`
does: 0 done, 1 stopped early, 130 interrupted. Saves the final model to OUT/final.npy.

``ray_fault_run.py OUT replay SOURCE``: replay SOURCE's lineage on the in-process engine — one start
per key segment recorded in SOURCE's checkpoint, each injecting that segment's key and stopping
after the round before the next segment — and save its final model to OUT/final.npy."""

import os
import sys

import numpy as np

from corrflow.config import RunConfig
from corrflow.server.simulation import RunInterruptedError, RunStoppedEarlyError, simulate

KEY = bytes(range(16))


def config(out: str) -> RunConfig:
    return RunConfig(
        num_users=24,
        num_rounds=24,
        epochs=2,
        noise_multiplier=0.7,
        model_dim=6,
        local_steps=int(os.environ.get("LOCAL_STEPS", "5")),
        state_dir=out,
    )


def replay(out: str, source: str) -> None:
    import threading

    from lineage_support import segments

    from corrflow.clients.tasks import get_task
    from corrflow.server.app import run_server
    from corrflow.server.inprocess import InProcessGrid

    cfg = config(os.path.abspath(out))
    task = get_task(cfg.client, cfg.model_dim, seed=cfg.seed)
    table = segments(source)
    for i, (_, key) in enumerate(table):
        stop = threading.Event()
        until = table[i + 1][0] if i + 1 < len(table) else None

        def round_end(strategy, metrics, stop=stop, until=until):
            if until is not None and metrics["round"] + 1 == until:
                stop.set()

        run_server(
            InProcessGrid(task.handlers, cfg.num_users),
            cfg,
            noise_key=key,
            quiet=True,
            stop_event=stop,
            on_round_end=round_end,
        )


def run(out: str, backend: str) -> None:
    try:
        simulate(config(out), backend=backend, noise_key=KEY, quiet=True)
    except RunInterruptedError:
        sys.exit(130)
    except RunStoppedEarlyError:
        sys.exit(1)


if __name__ == "__main__":
    from corrflow.run.checkpoint import current_checkpoint, load_arrays

    out = sys.argv[1]
    if len(sys.argv) > 3 and sys.argv[2] == "replay":
        replay(out, sys.argv[3])
    else:
        run(out, sys.argv[2] if len(sys.argv) > 2 else "flower")
    params = load_arrays(current_checkpoint(os.path.join(out, "state")), "model")
    np.save(os.path.join(out, "final.npy"), np.concatenate([p.ravel() for p in params]))
