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
    from corrflow.run.checkpoint import load_checkpoint

    out = sys.argv[1]
    if len(sys.argv) > 3 and sys.argv[2] == "replay":
        replay(out, sys.argv[3])
    else:
        run(out, sys.argv[2] if len(sys.argv) > 2 else "flower")
    params = load_checkpoint(os.path.join(out, "state")).arrays("model")
    np.save(os.path.join(out, "final.npy"), np.concatenate([p.ravel() for p in params]))


class FaultyWorker:
    """Mixed into a `corrflow.run.noise_shards.NoiseWorker` subclass by `faulty_worker`: before
    drawing round t, worker i meets the next unused fault of ``PLAN["i:t"]`` — "memory" (it fills
    its memory until Ray's memory monitor kills it: `fill_memory`), "oom" (raises Ray's
    OutOfMemoryError, as a call the memory monitor killed fails), "die" (the process exits),
    "hang" (it stops itself with SIGSTOP: an unreachable worker). Faults are counted in files
    under ``DIR``, so a restarted worker meets the next one."""

    PLAN: dict = {}
    DIR = ""

    def draw(self, t: int):
        from pathlib import Path

        faults = self.PLAN.get(f"{self._shard.index}:{t}", [])
        d = Path(self.DIR) / f"{self._shard.index}-{t}"
        met = len(list(d.glob("*"))) if d.is_dir() else 0
        if met < len(faults):
            d.mkdir(parents=True, exist_ok=True)
            (d / str(met)).touch()
            self._meet(faults[met])
        return super().draw(t)

    @staticmethod
    def _meet(fault: str) -> None:
        import signal

        import ray

        if fault == "memory":
            fill_memory()
        if fault == "oom":
            raise ray.exceptions.OutOfMemoryError("killed by the memory monitor (injected)")
        if fault == "die":
            os._exit(1)
        os.kill(os.getpid(), signal.SIGSTOP)


#: The most a "memory" fault allocates: the machine running the tests is shared.
FILL_BYTES, FILL_BLOCK = 3 << 30, 128 << 20


def fill_memory(limit: int = FILL_BYTES, hold_s: float = 20.0) -> None:
    """Allocate and touch memory in 128 MiB blocks, up to ``limit`` bytes, and hold it for
    ``hold_s`` seconds: a head started with the memory monitor's threshold below the machine's
    use plus ``limit`` kills this process on the way (Ray's monitor picks the newest
    non-retriable worker, and kills it within its refresh period of crossing the threshold).
    Still alive after that, it frees the memory and raises: the monitor did not act."""
    import time

    import numpy as np

    blocks = []
    start = time.monotonic()
    while len(blocks) * FILL_BLOCK < limit:
        blocks.append(np.ones(FILL_BLOCK // 8))  # np.ones writes every page
        time.sleep(0.05)
    time.sleep(max(0.0, hold_s - (time.monotonic() - start)))
    blocks.clear()
    raise RuntimeError(
        f"Ray's memory monitor did not kill this worker (pid {os.getpid()}) holding "
        f"{limit / 2**30:.1f} GiB for {hold_s:g} s"
    )


def faulty_worker(plan: dict[str, list[str]], directory: str):
    """A NoiseWorker class that meets ``plan``'s faults (see `FaultyWorker`), sent to Ray's
    workers by value (this module is not on their path)."""
    import ray

    from corrflow.run.noise_shards import NoiseWorker

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return type("Faulty", (FaultyWorker, NoiseWorker), {"PLAN": plan, "DIR": directory})
