"""Helper for test_strategy: run the in-process server; with KILL_AFTER set, SIGKILL this process
right after the checkpoint of that round (a crash, not a clean exit); with KILL_IN_RING set, SIGKILL
it halfway through writing that round's row of the banded noise ring (a torn row, before the round's
checkpoint is published)."""

import os
import signal
import sys

import numpy as np
from lineage_support import noise_key_from_env, save_released

from corrflow.clients.numpy_client import train
from corrflow.config import RunConfig
from corrflow.server.app import run_server
from corrflow.server.inprocess import InProcessGrid

out = sys.argv[1]
kill_after = int(os.environ.get("KILL_AFTER", "-1"))
kill_in_ring = int(os.environ.get("KILL_IN_RING", "-1"))
if kill_in_ring >= 0:
    real_pwrite, rows_written = os.pwrite, [0]

    # one ring row per round: the round's row is write number `round`
    def torn_pwrite(fd, data, offset):
        if rows_written[0] == kill_in_ring:
            real_pwrite(fd, bytes(data)[: len(data) // 2], offset)
            os.kill(os.getpid(), signal.SIGKILL)
        rows_written[0] += 1
        return real_pwrite(fd, data, offset)

    os.pwrite = torn_pwrite
cfg = RunConfig(
    num_users=12, num_rounds=8, epochs=2, noise_multiplier=0.7, model_dim=6, state_dir=out
)


def on_round_end(strategy, metrics):
    save_released(out, strategy, metrics)
    if metrics["round"] == kill_after:
        os.kill(os.getpid(), signal.SIGKILL)


s = run_server(
    InProcessGrid({"train": train}, 12),
    cfg,
    noise_key=noise_key_from_env(),
    quiet=True,
    on_round_end=on_round_end,
)
np.save(os.path.join(out, "final.npy"), np.concatenate([p.ravel() for p in s.params]))
