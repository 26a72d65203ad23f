"""Helper for test_ray_faults: one corrflow simulation on Flower's simulation engine (Ray) with a
fixed noise key (so that runs can be compared bit for bit), exiting as `corrflow simulate` does: 0
done, 1 stopped early, 130 interrupted. Saves the final model to OUT/final.npy."""

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


if __name__ == "__main__":
    out = sys.argv[1]
    try:
        simulate(
            config(out),
            backend=sys.argv[2] if len(sys.argv) > 2 else "flower",
            noise_key=KEY,
            quiet=True,
        )
    except RunInterruptedError:
        sys.exit(130)
    except RunStoppedEarlyError:
        sys.exit(1)
    from corrflow.run.checkpoint import current_checkpoint, load_arrays

    params = load_arrays(current_checkpoint(os.path.join(out, "state")), "model")
    np.save(os.path.join(out, "final.npy"), np.concatenate([p.ravel() for p in params]))
