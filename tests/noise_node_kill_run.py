"""Helper for test_noise_node: run the in-process server with secure aggregation and a noise node
(a child process, directory ``OUT.noise-node``); with KILL_AT_UNMASK=t set, SIGKILL this process
when round t's unmask stage is sent — the noise node has sent round t's row, the server has not
released it. Exits 1 when the run stopped early."""

import os
import signal
import sys

from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

from corrflow.clients.numpy_client import train
from corrflow.config import RunConfig
from corrflow.server.app import run_server
from corrflow.server.noise_node_sim import noise_node_grid, running_noise_node


def main(out: str, kill_round: int) -> int:
    """Run the server (the noise node a spawned child: hence the main guard below)."""
    cfg = RunConfig(
        num_users=12,
        num_rounds=4,
        epochs=2,
        noise_multiplier=0.7,
        model_dim=6,
        identity="partition-id",
        state_dir=out,
        secure_aggregation=True,
        noise_node=True,
    )
    with running_noise_node(cfg) as node:
        grid = noise_node_grid(cfg, train, node)
        push, unmasks = grid.push_messages, [0]

        def push_messages(messages):
            messages = list(messages)
            if any(
                RECORD_KEY_CONFIGS in m.content.config_records
                and m.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE] == Stage.UNMASK
                for m in messages
            ):
                unmasks[0] += 1
                if unmasks[0] == kill_round:
                    os.kill(os.getpid(), signal.SIGKILL)
            return push(messages)

        grid.push_messages = push_messages
        strategy = run_server(grid, cfg, noise_key=node.link(), quiet=True)
    return 1 if strategy.stopped_reason else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(os.environ.get("KILL_AT_UNMASK", "0"))))
