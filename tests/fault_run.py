"""Helper for the fault-tolerance tests: run the in-process server on OUT (argv[1]) in this process.
ROUND_DELAY (seconds) slows every training reply, and while the file HOLD names exists every reply
waits, so that another process can act while the run is going."""

import os
import sys
import time

from strategy_support import HANDLERS, KEY

from corrflow.config import RunConfig
from corrflow.server.app import run_server
from corrflow.server.inprocess import InProcessGrid

out = sys.argv[1]
delay = float(os.environ.get("ROUND_DELAY", "0"))
hold = os.environ.get("HOLD", "")


def slow_train(msg, ctx):
    time.sleep(delay)
    while hold and os.path.exists(hold):
        time.sleep(0.05)
    return HANDLERS["train"](msg, ctx)


cfg = RunConfig(
    num_users=12, num_rounds=8, epochs=2, noise_multiplier=0.7, model_dim=6, state_dir=out
)
run_server(InProcessGrid({**HANDLERS, "train": slow_train}, 12), cfg, noise_key=KEY, quiet=True)
