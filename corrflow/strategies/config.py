"""Run configuration of the correlated-noise strategy: a dataclass, read from Flower's run config (kebab-case keys).

Unknown keys are an error naming the key (DESIGN.md); values are type-checked against the defaults' types.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields

from corrflow.errors import InvalidArgumentError, require

POLICIES = ("reject", "accept-and-account")


@dataclass(frozen=True)
class StrategyConfig:
    num_users: int = 50
    num_rounds: int = 20
    epochs: int = 2
    kind: str = "toeplitz"
    bands: int = 0                  # 0: the factorization's default (min-sep)
    noise_multiplier: float = 0.0   # 0: calibrate from target_epsilon
    target_epsilon: float = 0.0     # 0: no target (then noise_multiplier is required)
    delta: float = 1e-5
    clip_norm: float = 1.0
    zeroing_factor: float = 100.0   # 000 App. F.3: zero updates with ℓ∞ > factor·clip (0 disables)
    server_lr: float = 1.0
    momentum: float = 0.9
    cooldown_fraction: float = 0.25
    local_lr: float = 0.1
    local_steps: int = 5
    schedule_seed: int = 0          # public: the fixed order of users into groups
    policy: str = "reject"
    model_dim: int = 20
    client: str = "numpy"
    data: str = "stackoverflow"
    data_path: str = ""             # keras client: a TFF StackOverflow SQLite file ("" = generated on the fly)
    vocab_path: str = ""            # its vocabulary (corrflow data vocab)
    seq_len: int = 20               # next-word sequence length for data-path
    state_dir: str = "corrflow_state"
    non_private: bool = False       # baseline only: no noise, no privacy guarantee (ε reported as null)

    def __post_init__(self) -> None:
        require(self.num_users >= 1, "num-users", "a positive integer", self.num_users)
        require(self.num_rounds >= 1, "num-rounds", "a positive integer", self.num_rounds)
        require(self.epochs >= 1 and self.num_rounds % self.epochs == 0, "epochs",
                f"a positive divisor of num-rounds={self.num_rounds} (fixed-epoch participation)", self.epochs)
        require(self.num_users >= self.min_sep, "num-users", f"at least rounds/epochs = {self.min_sep} so every "
                "round has a cohort", self.num_users)
        require(self.non_private or self.noise_multiplier > 0 or self.target_epsilon > 0, "noise-multiplier",
                "a positive noise multiplier or a positive target-epsilon (or non-private for a baseline)")
        require(not (self.non_private and (self.noise_multiplier > 0 or self.target_epsilon > 0)), "non-private",
                "no noise-multiplier or target-epsilon with a non-private baseline")
        require(0 < self.delta < 1, "delta", "a number in (0, 1)", self.delta)
        require(self.clip_norm > 0, "clip-norm", "a positive number", self.clip_norm)
        require(self.zeroing_factor >= 0, "zeroing-factor", "≥ 0 (0 disables zeroing)", self.zeroing_factor)
        require(0 <= self.momentum < 1, "momentum", "a number in [0, 1)", self.momentum)
        require(self.policy in POLICIES, "policy", f"one of {POLICIES}", self.policy)
        require(self.client in ("numpy", "keras"), "client", "numpy or keras", self.client)
        require(not self.data_path or (self.client == "keras" and bool(self.vocab_path)), "data-path",
                "client = keras and a vocab-path when a data file is given")

    @property
    def min_sep(self) -> int:
        return self.num_rounds // self.epochs

    @classmethod
    def from_run_config(cls, run_config: dict) -> StrategyConfig:
        known = {f.name.replace("_", "-"): f for f in fields(cls)}
        values = {}
        for key, value in run_config.items():
            if key not in known:
                raise InvalidArgumentError(key, f"a known run-config key ({', '.join(sorted(known))})", value)
            f = known[key]
            default = f.default
            if isinstance(default, bool):
                if not isinstance(value, bool):
                    raise InvalidArgumentError(key, "true or false", value)
                values[f.name] = value
                continue
            try:
                values[f.name] = type(default)(value)
            except (TypeError, ValueError) as exc:
                raise InvalidArgumentError(key, f"a {type(default).__name__}", value) from exc
            if isinstance(default, int) and not isinstance(value, bool) and float(value) != values[f.name]:
                raise InvalidArgumentError(key, "an integer", value)
        return cls(**values)

    def to_dict(self) -> dict:
        return asdict(self)

    def fingerprint(self) -> str:
        """Hash of everything that fixes the mechanism and the data order (restarts must match it)."""
        d = self.to_dict()
        d.pop("state_dir")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()
