"""Run configuration of the correlated-noise strategy: a dataclass, read from Flower's run config (kebab-case keys).

Unknown keys are an error naming the key (DESIGN.md); values are type-checked against the defaults' types.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields

from corrflow.errors import InvalidArgumentError, require

POLICIES = ("reject", "accept-and-account")
PARTICIPATIONS = ("fixed-epoch", "bminsep", "multi-attribution")


@dataclass(frozen=True)
class StrategyConfig:
    num_users: int = 50
    num_rounds: int = 20
    epochs: int = 2
    kind: str = "toeplitz"
    bands: int = 0                  # 0: the factorization's default (min-sep)
    taper: int = 0                  # toeplitz: b₀ of the 001 App. H taper when min-sep is uncertain; 0 = none
    noise_multiplier: float = 0.0   # 0: calibrate from target_epsilon
    target_epsilon: float = 0.0     # 0: no target (then noise_multiplier is required)
    delta: float = 1e-5
    clip_norm: float = 1.0
    zeroing_factor: float = 100.0   # 000 App. F.3: zero updates with ℓ∞ > factor·clip (0 disables)
    server_lr: float = 0.5          # numpy-client defaults; see corrflow.clients.tasks.TRAINING_DEFAULTS
    momentum: float = 0.5
    cooldown_fraction: float = 0.25
    local_lr: float = 0.1
    local_steps: int = 5
    schedule_seed: int = 0          # public: the fixed order of users into groups
    seed: int = 0                   # the task's data and model initialisation (never the noise key)
    policy: str = "reject"
    model_dim: int = 20
    client: str = "numpy"
    data: str = "stackoverflow"
    data_path: str = ""             # keras client: a TFF StackOverflow SQLite file ("" = generated on the fly)
    vocab_path: str = ""            # its vocabulary (corrflow data vocab)
    seq_len: int = 20               # next-word sequence length for data-path
    state_dir: str = "corrflow_state"
    non_private: bool = False       # baseline only: no noise, no privacy guarantee (ε reported as null)
    # Participation control (004): who trains when, at the level of users (persons) behind items.
    participation: str = "fixed-epoch"   # fixed-epoch | bminsep | multi-attribution
    min_sep: int = 0                # b; 0: num-rounds / epochs
    participation_rate: float = 0.0  # p0 per item and round for bminsep / multi-attribution; 0: 1/(2b)
    accountant: str = "unamplified"  # unamplified | monte-carlo (bminsep / multi-attribution, 004 Eq. 1, Thm 6.1)
    mc_samples: int = 100_000
    mode: str = "cross-device"      # cross-device (item = a SuperNode) | cross-silo (item = an example in a silo)
    attribution_path: str = ""      # items → users (CSV / JSON lines / arXiv metadata); "" = each item its own user
    manifest_path: str = ""         # cross-silo: partition manifest (corrflow data partition) item → silo
    max_items_per_user: int = 0     # k_u: greedy contribution bounding (004 §6); 0 = no bounding

    def __post_init__(self) -> None:
        require(self.num_users >= 1, "num-users", "a positive integer", self.num_users)
        require(self.num_rounds >= 1, "num-rounds", "a positive integer", self.num_rounds)
        require(self.participation in PARTICIPATIONS, "participation", f"one of {PARTICIPATIONS}",
                self.participation)
        if self.participation == "fixed-epoch":
            require(self.epochs >= 1 and self.num_rounds % self.epochs == 0, "epochs",
                    f"a positive divisor of num-rounds={self.num_rounds} (fixed-epoch participation)", self.epochs)
            require(self.min_sep in (0, self.num_rounds // self.epochs), "min-sep",
                    "0 or num-rounds/epochs for fixed-epoch participation", self.min_sep)
            require(self.mode == "cross-silo" or self.num_users >= self.b, "num-users",
                    f"at least rounds/epochs = {self.b} so every round has a cohort", self.num_users)
        else:
            require(self.epochs >= 1, "epochs", "a positive integer", self.epochs)
            require(1 <= self.b <= self.num_rounds, "min-sep", f"in [1, num-rounds = {self.num_rounds}]", self.b)
            require(0 <= self.participation_rate <= 1.0 / self.b, "participation-rate",
                    f"in (0, 1/min-sep = {1 / self.b:g}] (0: 1/(2·min-sep))", self.participation_rate)
        require(self.taper == 0 or (self.kind == "toeplitz" and 1 <= self.taper < (self.bands or self.b)),
                "taper", "0, or with kind toeplitz a lower min-sep b₀ below the bands", self.taper)
        require(self.accountant in ("unamplified", "monte-carlo"), "accountant", "unamplified or monte-carlo",
                self.accountant)
        require(self.accountant == "unamplified" or self.participation != "fixed-epoch", "accountant",
                "unamplified for fixed-epoch participation (Monte Carlo needs a sampler: bminsep or "
                "multi-attribution, 004)")
        require(self.mode in ("cross-device", "cross-silo"), "mode", "cross-device or cross-silo", self.mode)
        require(self.mode == "cross-device" or bool(self.manifest_path), "manifest-path",
                "a partition manifest (corrflow data partition) in cross-silo mode")
        require(self.max_items_per_user >= 0, "max-items-per-user", "≥ 0 (0: no bounding)", self.max_items_per_user)
        require(self.mc_samples >= 1000, "mc-samples", "at least 1000", self.mc_samples)
        require(self.non_private or self.noise_multiplier > 0 or self.target_epsilon > 0, "noise-multiplier",
                "a positive noise multiplier or a positive target-epsilon (or non-private for a baseline)")
        require(not (self.non_private and (self.noise_multiplier > 0 or self.target_epsilon > 0)), "non-private",
                "no noise-multiplier or target-epsilon with a non-private baseline")
        require(0 < self.delta < 1, "delta", "a number in (0, 1)", self.delta)
        require(self.clip_norm > 0, "clip-norm", "a positive number", self.clip_norm)
        require(self.zeroing_factor >= 0, "zeroing-factor", "≥ 0 (0 disables zeroing)", self.zeroing_factor)
        require(0 <= self.momentum < 1, "momentum", "a number in [0, 1)", self.momentum)
        require(self.policy in POLICIES, "policy", f"one of {POLICIES}", self.policy)
        require(self.client in ("numpy", "nextword", "keras"), "client", "numpy, nextword or keras", self.client)
        require(not self.data_path or (self.client == "keras" and bool(self.vocab_path)), "data-path",
                "client = keras and a vocab-path when a data file is given")

    @property
    def b(self) -> int:
        """The design min-sep: ``min-sep`` when set, else num-rounds / epochs."""
        return self.min_sep or self.num_rounds // self.epochs

    @property
    def max_participations(self) -> int:
        """k: the most distinct rounds one user may contribute to."""
        if self.participation == "fixed-epoch":
            return self.epochs
        return -(-self.num_rounds // self.b)

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
