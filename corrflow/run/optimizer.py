"""The server optimizer the workload A encodes (000 §5.3, arXiv 2211.06530): m_t = β m_{t−1} + x̂_t,
θ_{t+1} = θ_t + η·η_t·m_t.

Clients return model deltas (descent directions), so θ_t − θ_0 = η·(A x̂)_t with A =
tri·diag(η_t)·M_β — the same A the factorization was built for; a mismatch is refused at start-up.
"""

from __future__ import annotations

import numpy as np

from corrflow.errors import require
from corrflow.factorization.workloads import Workload


class MomentumServerOptimizer:
    """The workload's optimizer as a pure step: the schedule η_t and β are fixed; the momentum m is
    passed in and returned (the run's state holds it)."""

    def __init__(self, workload: Workload, rounds: int, server_lr: float):
        require(server_lr > 0, "server-lr", "a positive number", server_lr)
        self.workload = workload
        self.lr = float(server_lr)
        self.schedule = workload.learning_rates(rounds)
        self.momentum = np.float32(workload.momentum)

    def step(
        self,
        params: list[np.ndarray],
        momentum: list[np.ndarray],
        update: list[np.ndarray],
        round_index: int,
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(θ_{t+1}, m_t) from θ_t, m_{t−1} and the private update x̂_t."""
        scale = np.float32(self.lr * self.schedule[round_index])
        new_m, new_p = [], []
        for p, m, u in zip(params, momentum, update, strict=True):
            if self.momentum:
                # new arrays: the inputs stay as they were
                nm = np.multiply(m, self.momentum, dtype=np.float32)
                nm += u
            else:
                nm = np.array(u, dtype=np.float32)
            q = np.multiply(nm, scale, dtype=np.float32)
            q += p  # = p + scale·m (float32 addition commutes)
            new_m.append(nm)
            new_p.append(q)
        return new_p, new_m


def check_workload_matches(workload: Workload, momentum: float, cooldown_fraction: float) -> None:
    """Start-up check: the factorization's workload and the configured optimizer must agree.

    A factorization optimized for one workload A (momentum, cooldown) is only optimal, and its
    error figures only true, for that optimizer.
    """
    require(
        abs(workload.momentum - momentum) < 1e-12
        and abs(workload.cooldown_fraction - cooldown_fraction) < 1e-12,
        "factorization",
        f"a workload with momentum={momentum} and cooldown-fraction={cooldown_fraction}"
        " (the server optimizer's)",
        workload.to_dict(),
    )
