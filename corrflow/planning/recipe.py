"""The plan file (``plan.json``'s recommended recipe, written as ``recipe.json``): a complete
mechanism for a run — factorization (file + SHA-256), participation/sampler, accountant and σ — that
``corrflow simulate --plan FILE`` and ``DifferentialPrivacyCorrelatedNoise(plan=FILE)`` load
directly, refusing a run that differs from it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from corrflow.config import recipe_names
from corrflow.errors import IntegrityError, InvalidArgumentError, require
from corrflow.factorization.base import Factorization
from corrflow.fileio import copy_file, write_text
from corrflow.planning.run import participation_of, workload_for

#: The ``format`` field every recipe carries; a file with another is refused.
RECIPE_FORMAT = "corrflow.recipe/1"


@dataclass(frozen=True)
class Recipe:
    """One candidate mechanism, complete enough to run.

    ``participation`` / ``accountant`` / ``participation_rate`` are the strategy's settings
    (``RunConfig``); ``noise_multiplier`` σ multiplies the clip norm; ``rmse`` / ``max_error``
    are at that σ per unit clip norm and model coordinate (docs/explanation/conventions.md,
    "Errors"). The JSON Schema of its file is ``corrflow schema recipe``."""

    kind: str
    bands: int | None
    rounds: int
    epochs: int  # k = ⌈n/b⌉
    min_sep: int  # b = ⌊population / cohort⌋
    participation: str  # fixed-epoch | bminsep | cyclic-poisson
    participation_rate: float  # p0 per user and round for samplers (0 for fixed-epoch)
    accountant: str  # unamplified | cyclic-poisson | mmcc | monte-carlo
    noise_multiplier: float
    epsilon: float
    delta: float
    target_epsilon: float
    population: int
    cohort_size: int
    momentum: float
    cooldown_fraction: float
    factorization: str  # file name, relative to the recipe's directory
    factorization_sha256: str
    rmse: float
    max_error: float
    model_params: int
    noise_state_bytes: int
    noise_seconds_per_round: float
    format: str = RECIPE_FORMAT
    # what the plan ranked by and its inputs (candidates.score_summary); None in older recipes
    score: dict | None = None

    def to_dict(self) -> dict:
        """Returns:
        The recipe's fields as a JSON-serialisable dict (the content of ``recipe.json``).
        """
        return asdict(self)

    def strategy_settings(self) -> dict:
        """The run settings this recipe fixes.

        Every setting the ``recipe`` surface declares but the population (a default the run may
        change) and the target ε (σ is fixed, so the run has none to calibrate for). A fixed-epoch
        recipe leaves min-sep to rounds/epochs.

        Returns:
            `corrflow.config.RunConfig` field → value, with ``target_epsilon`` None, ``min_sep`` 0
            for fixed-epoch and ``bands`` 0 for the kind's default.
        """

        out = {
            setting: getattr(self, name)
            for name, setting in recipe_names().items()
            if setting not in ("num_users", "target_epsilon")
        }
        out.update(
            min_sep=0 if self.participation == "fixed-epoch" else self.min_sep,
            bands=int(self.bands or 0),
            target_epsilon=None,
        )
        return out

    def differences(self, settings: dict, names: dict[str, str] | None = None) -> list[str]:
        """The run settings that differ from this recipe's (the target ε included: σ was calibrated
        for it).

        A min-sep of 0 means rounds/epochs, as in the strategy; floats compare to 1e-12 relative;
        settings the run does not give are not compared.

        Args:
            settings: ``RunConfig`` field → value (an enum member counts by its value).
            names: field → the name the user typed, e.g. a CLI flag (default: the run-config key).

        Returns:
            One ``"name: plan X, run Y"`` per difference (empty when the run matches).
        """
        # σ was calibrated for the target ε
        mine = {**self.strategy_settings(), "target_epsilon": self.target_epsilon}
        out = []
        for key, want in mine.items():
            if key not in settings:
                continue
            # an enum member (a CLI choice) by its value
            got = getattr(settings[key], "value", settings[key])
            if key == "min_sep":
                rounds, epochs = (
                    settings.get("num_rounds", self.rounds),
                    settings.get("epochs", self.epochs),
                )
                got = got or rounds // max(epochs, 1)
                want = want or self.rounds // self.epochs
            if isinstance(want, float) and isinstance(got, int | float):
                same = abs(float(got) - want) <= 1e-12 * max(1.0, abs(want))
            else:
                same = got == want
            if not same:
                name = (names or {}).get(key, key.replace("_", "-"))
                out.append(f"{name}: plan {want!r}, run {got!r}")
        return out

    def save(self, path: Path) -> Path:
        """Write the recipe as sorted, indented JSON, atomically (its parent directory is created).

        Args:
            path: the file, conventionally ``recipe.json`` next to its factorization file.

        Returns:
            ``path``.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path


def load_recipe(path: str | Path) -> tuple[Recipe, Path]:
    """Read a plan file written by ``corrflow plan``.

    Args:
        path: ``recipe.json``, or ``plan.json`` whose ``recommended`` entry is the recipe.

    Returns:
        (recipe, path of its factorization file, verified to exist next to the plan file).

    Raises:
        InvalidArgumentError: (field ``plan``) the file is missing, not JSON, not of
            `RECIPE_FORMAT`, incomplete, has no recommended recipe, or its factorization file is
            missing.
    """
    path = Path(path)
    if not path.is_file():
        raise InvalidArgumentError(
            "plan", "an existing plan file written by `corrflow plan`", str(path)
        )
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgumentError("plan", f"a JSON plan file ({exc})", str(path)) from None
    if isinstance(obj, dict) and "recommended" in obj:
        obj = obj["recommended"]
        require(
            isinstance(obj, dict),
            "plan",
            "a plan with a recommended recipe (none fitted the budgets)",
            str(path),
        )
    require(
        isinstance(obj, dict) and obj.get("format") == RECIPE_FORMAT,
        "plan",
        f"a recipe of format {RECIPE_FORMAT}",
        str(path),
    )
    names = {f.name for f in fields(Recipe)}
    missing = sorted(names - set(obj) - {"format", "score"})
    require(not missing, "plan", "a complete recipe", f"missing {missing}")
    recipe = Recipe(**{k: v for k, v in obj.items() if k in names})
    fac_path = path.parent / recipe.factorization
    if not fac_path.is_file():
        raise InvalidArgumentError(
            "plan", f"its factorization file next to it ({recipe.factorization})", str(fac_path)
        )
    return recipe, fac_path


def load_recipe_factorization(recipe: Recipe, fac_path: Path):
    """The recipe's factorization, verified against the recorded SHA-256.

    Args:
        recipe: the recipe.
        fac_path: its factorization file (from `load_recipe`).

    Returns:
        The `Factorization`.

    Raises:
        IntegrityError: the file is corrupted or its hash is not the recipe's
            ``factorization_sha256``.
    """

    fac = Factorization.load(fac_path)
    if fac.sha256() != recipe.factorization_sha256:
        raise IntegrityError(
            f"{fac_path}: factorization hash {fac.sha256()[:16]}… is not the plan's "
            f"{recipe.factorization_sha256[:16]}…"
        )
    return fac


def install_factorization(recipe: Recipe, fac_path: Path, cfg, *, replace: bool) -> str:
    """Put the plan's factorization where the run looks for it and check that the run will use it as
    is.

    The file goes to ``factorization.npz`` in the run directory ``cfg.state_dir``; its kind,
    workload and participation must be those the strategy builds for ``cfg`` (else the run would
    rebuild another).

    Args:
        recipe: the recipe.
        fac_path: its factorization file (from `load_recipe`).
        cfg: the run's `corrflow.config.RunConfig`.
        replace: overwrite a different file there (a new run); otherwise a different file is refused
            (a resumed run keeps its own).

    Returns:
        The factorization's SHA-256.

    Raises:
        InvalidArgumentError: (field ``plan``) the factorization does not match the run's settings,
            or the run directory holds a different one and ``replace`` is False.
        IntegrityError: the plan's factorization file fails verification.
    """

    fac = load_recipe_factorization(recipe, fac_path)
    part, wl = participation_of(cfg), workload_for(cfg.momentum, cfg.cooldown_fraction)
    wrong = [
        f"{name}: plan {a}, run {b_}"
        for name, a, b_ in (
            ("kind", fac.kind, cfg.kind),
            ("workload", fac.workload.to_dict(), wl.to_dict()),
            ("participation", fac.participation.describe(), part.describe()),
        )
        if a != b_
    ]
    require(
        not wrong, "plan", "a plan whose factorization matches the run's settings", "; ".join(wrong)
    )
    out_dir = Path(cfg.state_dir)
    dest = out_dir / "factorization.npz"
    differs = not dest.exists() or _differs(dest, fac)
    if dest.exists() and differs:
        require(
            replace,
            "plan",
            f"the factorization of the run in {out_dir} (start a new run with --fresh to use "
            "the plan's)",
            f"{dest} differs from the plan's",
        )
    if differs:
        copy_file(fac_path, dest)
    return fac.sha256()


def _differs(path: Path, fac) -> bool:

    try:
        return Factorization.load(path).sha256() != fac.sha256()
    except IntegrityError:
        return True
