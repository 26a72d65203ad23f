"""Helper for test_blt: a BLT run (2 buffers) on the in-process server with a fixed noise key; with
KILL_AFTER set, SIGKILL this process right after the checkpoint of that round (a crash, not a clean
exit). Saves the final model to OUT/final.npy."""

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
cfg = RunConfig(
    num_users=16,
    num_rounds=16,
    # single participation: 2 buffers beat 1 by 0.26% (at k = 2 the second would be merged)
    epochs=1,
    kind="blt",
    buffers=2,
    noise_multiplier=0.7,
    model_dim=6,
    state_dir=out,
)


def on_round_end(strategy, metrics):
    save_released(out, strategy, metrics)
    if metrics["round"] == kill_after:
        os.kill(os.getpid(), signal.SIGKILL)


s = run_server(
    InProcessGrid({"train": train}, 16),
    cfg,
    noise_key=noise_key_from_env(),
    quiet=True,
    on_round_end=on_round_end,
)
np.save(os.path.join(out, "final.npy"), np.concatenate([p.ravel() for p in s.params]))
