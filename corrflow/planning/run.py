"""Flower-free planning of a run, shared by the ServerApp, ``corrflow simulate`` and the Flower
wrapper: the factorization (built once and cached in the run's directory), the cohort planner over
items and the users behind them (with contribution bounding), and σ with the planned ε from the
chosen accountant."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from corrflow.accounting import account
from corrflow.accounting.accountant import GAUSSIAN_NAME, SamplingSpec
from corrflow.accounting.tracking import PrivacyPlan
from corrflow.config import RunConfig
from corrflow.data.arxiv import ArxivReader, arxiv_attribution
from corrflow.data.federated import TextSource, data_format
from corrflow.data.partition import load_manifest
from corrflow.data.vocab import read_provenance
from corrflow.errors import require
from corrflow.factorization import Factorization, Workload, factorize, participation_for
from corrflow.participation.attribution import (
    AttributionGraph,
    bound_contributions,
    load_attribution,
)
from corrflow.participation.planner import CohortPlanner

log = logging.getLogger("corrflow")


def workload_for(momentum: float, cooldown_fraction: float) -> Workload:
    """The workload A of the server optimizer (000 §5: Choquette-Choo et al., "Multi-Epoch Matrix
    Factorization Mechanisms for Private Machine Learning", arXiv 2211.06530).

    Args:
        momentum: β in [0, 1) (0: plain SGD).
        cooldown_fraction: the fraction of the rounds over which the learning rate falls linearly.

    Returns:
        SGD with momentum and a linear cooldown when β > 0, else the prefix sum with that cooldown.
    """
    return (
        Workload.sgd_momentum(momentum, cooldown_fraction)
        if momentum > 0
        else Workload("prefix", 0.0, cooldown_fraction)
    )


def participation_of(cfg: RunConfig):
    """The participation the run's factorization is built for.

    Args:
        cfg: the run's settings.

    Returns:
        (k, n/k) fixed-epoch participation, or any b-separated pattern with at most
        ``max_participations`` participations (min-sep).
    """
    if cfg.participation == "fixed-epoch":
        return participation_for(cfg.num_rounds, cfg.epochs)
    return participation_for(cfg.num_rounds, cfg.max_participations, cfg.b, kind="min-sep")


def load_or_build_factorization(cfg: RunConfig, out_dir: Path) -> Factorization:
    """The run's factorization, built once and kept in the run's directory.

    Args:
        cfg: the run's settings (kind, bands, taper, buffers, workload and participation).
        out_dir: the run directory.

    Returns:
        ``out_dir/factorization.npz`` when it matches the settings, else a new factorization, saved
        there.

    Raises:
        IntegrityError: the stored file is corrupted.
    """
    workload = workload_for(cfg.momentum, cfg.cooldown_fraction)
    path = out_dir / "factorization.npz"
    part = participation_of(cfg)
    if path.exists():
        fac = Factorization.load(path)
        if (
            fac.kind == cfg.kind
            and fac.workload == workload
            and fac.participation == part
            and fac.metadata.get("taper_lower_min_sep") == (cfg.taper or None)
            and cfg.buffers in (0, getattr(fac.encoder, "buffers", 0))
        ):
            return fac
    fac = build_factorization(cfg)
    fac.save(path)
    return fac


def build_factorization(cfg: RunConfig, **options) -> Factorization:
    """The factorization a run with ``cfg`` trains with (``corrflow factorize`` builds the same).

    Args:
        cfg: the run's settings: kind, bands, taper, buffers; the workload of the server optimizer
            (momentum, cooldown, `workload_for`) and the participation
            (`participation_of`).
        options: `corrflow.factorization.factorize`'s other keywords (stamps, gamma, tol,
            callback, ...); a run uses their defaults.

    Returns:
        The factorization (not saved).
    """
    return factorize(
        cfg.kind,
        participation_of(cfg),
        workload_for(cfg.momentum, cfg.cooldown_fraction),
        bands=cfg.bands or None,
        taper=cfg.taper or None,
        buffers=cfg.buffers or None,
        **options,
    )


def mechanism_notes(cfg: RunConfig, fac: Factorization) -> list[str]:
    """What was built where it differs from what the settings name: `--epochs` that a sampler's
    min-sep overrides; a correlated kind whose participation leaves it one band (its default is
    min-sep b bands) is DP-SGD — C = I/√k, independent noise in every round; bands cut to the
    sampler's min-sep.

    Args:
        cfg: the run's settings.
        fac: the factorization built for them.

    Returns:
        Notes for the console and the report (empty when the mechanism is what the settings name).
    """
    notes = _epochs_note(cfg)
    if cfg.kind != "dpsgd" and fac.encoder.structure in ("toeplitz", "banded") and fac.bands == 1:
        return [
            *notes,
            f"kind {cfg.kind} with min-sep {cfg.b} has one band: C = I/√k, which is DP-SGD "
            "(independent noise in every round); give bands above 1 (--bands, corrflow.bands) to "
            "correlate the noise across rounds",
        ]
    if (
        cfg.participation != "fixed-epoch"
        and not cfg.bands
        and fac.bands is not None
        and fac.bands == cfg.b
        and fac.bands < cfg.num_rounds
    ):
        notes.append(
            f"kind {cfg.kind}: {fac.bands} bands, cut to the sampler's min-sep b = {cfg.b} "
            "(participations b apart touch disjoint rows, which the amplified accountants need); "
            "--bands sets it"
        )
    return notes


def _epochs_note(cfg: RunConfig) -> list[str]:
    """A sampler with an explicit min-sep b may take a user every b rounds, so k = ⌈n/b⌉ (000
    App. D.2), whatever ``epochs`` says; say so when the two differ (epochs sets b only when
    min-sep is not given)."""
    k = cfg.max_participations
    if cfg.participation == "fixed-epoch" or not cfg.min_sep or cfg.epochs in (1, k):
        return []
    return [
        f"epochs {cfg.epochs} is not used: participation {cfg.participation} with min-sep "
        f"b = {cfg.b} may take a user every {cfg.b} rounds, so the factorization and the "
        f"accounting allow k = ⌈{cfg.num_rounds}/{cfg.b}⌉ = {k} participations (without "
        f"--min-sep, b = rounds/epochs = {cfg.num_rounds // cfg.epochs})"
    ]


def load_graph(path: str) -> AttributionGraph:
    """Read an attribution graph (items and the users behind them; 004 §6, multi-attribution).

    Args:
        path: an attribution file (CSV ``item,user`` or JSON lines ``{"item", "users"}``), or arXiv
            metadata JSON lines (items = paper ids, users = normalised authors).

    Returns:
        The `AttributionGraph`.
    """
    p = Path(path)
    if p.suffix == ".jsonl":
        with open(p, encoding="utf-8", errors="replace") as f:  # the reader names a bad byte
            first = next((line for line in f if line.strip()), "")
        try:
            is_arxiv = "item" not in json.loads(first)
        except (json.JSONDecodeError, TypeError):
            is_arxiv = False
        if is_arxiv:
            return arxiv_attribution(ArxivReader(p))
    return load_attribution(p)


def _items_of(cfg: RunConfig, identities: list[str]) -> tuple[list[str], dict[str, str] | None]:
    """The items a run samples, sorted: its node identities, or (cross-silo) the examples of the
    manifest, each with the silo that holds it."""
    if cfg.mode != "cross-silo":
        return sorted(identities), None
    manifest = load_manifest(cfg.manifest_path)
    item_home = {
        str(item): f"partition-{part['partition_id']}"
        for part in manifest["partitions"]
        for item in part.get("items", part.get("users", []))
    }
    missing = sorted({h for h in item_home.values()} - set(identities))
    require(
        not missing,
        "manifest-path",
        "a silo (partition) online for every manifest partition",
        missing[:5],
    )
    return sorted(item_home), item_home


def _graph_of(cfg: RunConfig, items: list[str]) -> AttributionGraph:
    """The users behind ``items``: the attribution file's, an arXiv data file's authors, or one
    user per item."""
    graph = None
    if cfg.attribution_path:
        graph = load_graph(cfg.attribution_path)
    elif (
        cfg.data_path and cfg.mode == "cross-device" and data_format(cfg.data_path) == "arxiv-jsonl"
    ):
        require(
            cfg.participation == "multi-attribution",
            "participation",
            "multi-attribution with an arXiv data file (a paper belongs to all its authors, "
            "004 §6)",
            cfg.participation,
        )
        # items: partition-<i>
        graph = TextSource(cfg.data_path, cfg.vocab_path or "-").attribution()
    if graph is None:
        return AttributionGraph(items, items, [[i] for i in range(len(items))])
    index = {item: i for i, item in enumerate(graph.item_ids)}
    unknown = [i for i in items if i not in index]
    require(
        not unknown,
        "attribution-path",
        "every item (node identity or example id) in the graph",
        unknown[:5],
    )
    return AttributionGraph(items, graph.user_ids, [graph.item_users[index[i]] for i in items])


def build_planner(
    cfg: RunConfig, identities: list[str]
) -> tuple[CohortPlanner, dict[str, str] | None, dict]:
    """The cohort planner of a run: its items, the users behind them and user-level contribution
    bounding (k_u).

    Args:
        cfg: the run's settings (mode, participation, manifest, attribution, data, bounding, seed).
        identities: the node identities online (SuperNodes, or the silos of a cross-silo run).

    Returns:
        (planner, item → silo identity (None unless cross-silo), bounding info ``{"items", "users",
        ...}``).

    Raises:
        InvalidArgumentError: a manifest partition without its silo online, an item missing from the
            attribution graph, or an arXiv data file without multi-attribution participation (the
            error names the setting).
    """
    items, item_home = _items_of(cfg, identities)
    graph = _graph_of(cfg, items)
    info = {"items": graph.num_items, "users": graph.num_users}
    if cfg.max_items_per_user:
        bound = bound_contributions(graph, cfg.max_items_per_user, seed=cfg.schedule_seed)
        info.update(bound.to_dict(), max_items_per_user=cfg.max_items_per_user)
        kept = [graph.item_ids[i] for i in bound.kept]
        graph = AttributionGraph(kept, graph.user_ids, [graph.item_users[i] for i in bound.kept])
    planner = CohortPlanner(
        cfg.participation,
        graph.item_ids,
        graph.item_users,
        graph.user_ids,
        cfg.num_rounds,
        cfg.b,
        rate=cfg.participation_rate,
        seed=cfg.schedule_seed,
    )
    return planner, item_home, info


@dataclass(frozen=True)
class TrainingBudget:
    """The run's (ε, δ) left for training once the vocabulary's share is taken out (basic
    composition: a DP vocabulary (ε_v, δ_v) and training (ε_t, δ_t) together are (ε_v + ε_t, δ_v +
    δ_t)-DP — Dwork, Roth 2014, "The Algorithmic Foundations of Differential Privacy", Thm 3.16 — so
    training gets ε_t = ε* − ε_v, δ_t = δ − δ_v and the total stays within the target)."""

    epsilon: float | None  # training's target ε (None: no target)
    delta: float
    vocabulary: dict | None  # the report's ``vocabulary`` section (None: no dataset file)


def vocabulary_section(vocab_path: str) -> dict:
    """How the run's vocabulary was built, for the report's ``vocabulary`` section.

    Args:
        vocab_path: the vocabulary file (its provenance is recorded with it).

    Returns:
        ``{"source", "epsilon", "delta", "inside_guarantee", "note", "words", "sha256"}`` plus the
        DP method's parameters when recorded; ε and δ are None unless the source is ``dp``.
    """

    prov = read_provenance(vocab_path)
    inside = prov["source"] in ("dp", "public")
    why = {
        "dp": "differentially private (corrflow data vocab); its (ε, δ) is composed into the total",
        "public": "a public word list (supplied by the user, or counted from data marked --public)",
        "non-private": (
            "counted from the private data WITHOUT privacy (--no-privacy): outside the guarantee"
        ),
        "unrecorded": "the file does not record how it was built: treated as outside the guarantee",
    }
    return {
        "source": prov["source"],
        "epsilon": prov.get("epsilon") if prov["source"] == "dp" else None,
        "delta": prov.get("delta") if prov["source"] == "dp" else None,
        "inside_guarantee": inside,
        "note": why[prov["source"]],
        "words": prov["words"],
        "sha256": prov["sha256"],
        **(
            {
                k: prov[k]
                for k in ("method", "max_words_per_user", "max_items_per_user", "threshold")
                if k in prov
            }
        ),
    }


def training_budget(cfg: RunConfig) -> TrainingBudget:
    """The training's (ε, δ): the run's target less a DP vocabulary's spend (see
    `TrainingBudget`).

    Args:
        cfg: the run's settings.

    Returns:
        The `TrainingBudget` (the run's (ε, δ) when there is no DP vocabulary).

    Raises:
        InvalidArgumentError: (``delta`` or ``target-epsilon``) the vocabulary spends the whole
            budget.
    """
    if not cfg.data_path or not cfg.vocab_path:
        return TrainingBudget(cfg.target_epsilon, cfg.delta, None)
    vocab = vocabulary_section(cfg.vocab_path)
    if vocab["source"] != "dp":
        return TrainingBudget(cfg.target_epsilon, cfg.delta, vocab)
    eps_v, delta_v = float(vocab["epsilon"]), float(vocab["delta"])
    require(
        delta_v < cfg.delta,
        "delta",
        f"a δ above the vocabulary's δ = {delta_v:g} (the run's δ is the total; "
        "the vocabulary's share is taken out of it)",
        cfg.delta,
    )
    eps = cfg.target_epsilon
    if eps is not None and not cfg.non_private:
        require(
            eps_v < eps,
            "target-epsilon",
            f"an ε above the vocabulary's ε = {eps_v:g} (the run's ε is the "
            "total; the vocabulary's share is taken out of it)",
            eps,
        )
        eps = eps - eps_v
    return TrainingBudget(eps, cfg.delta - delta_v, vocab)


def total_privacy(
    training_epsilon: float | None, training_delta: float, vocabulary: dict | None
) -> dict:
    """The report's ``total``: training composed with the vocabulary (basic composition,
    `TrainingBudget`).

    Args:
        training_epsilon: the training's ε (None: none).
        training_delta: the training's δ.
        vocabulary: the report's ``vocabulary`` section (`vocabulary_section`), or None.

    Returns:
        ``{"epsilon", "delta", "composition"}`` (plus ``includes_vocabulary`` for a non-public
        vocabulary).
    """
    if vocabulary is None or vocabulary["source"] == "public":
        return {
            "epsilon": training_epsilon,
            "delta": training_delta,
            "composition": "training only"
            + (" (a public vocabulary spends nothing)" if vocabulary else ""),
        }
    if vocabulary["source"] != "dp":
        return {
            "epsilon": training_epsilon,
            "delta": training_delta,
            "includes_vocabulary": False,
            "composition": f"training only; the vocabulary is {vocabulary['note']}",
        }
    eps = None if training_epsilon is None else training_epsilon + float(vocabulary["epsilon"])
    return {
        "epsilon": eps,
        "delta": training_delta + float(vocabulary["delta"]),
        "includes_vocabulary": True,
        "composition": (
            "basic composition: (ε, δ) = (ε_vocabulary + ε_training, δ_vocabulary + δ_training) "
            "(Dwork & Roth 2014, Thm 3.16)"
        ),
    }


def plan_privacy(cfg: RunConfig, fac: Factorization, planner: CohortPlanner) -> PrivacyPlan:
    """σ and the planned ε of a run: `plan_training_privacy` at the training's share of the
    budget (`training_budget`).

    Args:
        cfg: the run's settings.
        fac: the run's factorization.
        planner: the run's cohort planner (`build_planner`).

    Returns:
        The `PrivacyPlan`, carrying the training's δ and target ε and the vocabulary section.

    Raises:
        InvalidArgumentError: the vocabulary spends the whole budget, or the accountant cannot
            analyse this run.
    """
    budget = training_budget(cfg)
    if budget.vocabulary is not None and not budget.vocabulary["inside_guarantee"]:
        log.warning("corrflow: the vocabulary %s is %s", cfg.vocab_path, budget.vocabulary["note"])
    if budget.vocabulary is not None and budget.vocabulary["source"] == "dp":
        log.info(
            "corrflow: the vocabulary spent (ε, δ) = (%g, %g); training is calibrated to the rest "
            "of the budget: ε = %s, δ = %g",
            budget.vocabulary["epsilon"],
            budget.vocabulary["delta"],
            "n/a" if budget.epsilon is None else f"{budget.epsilon:g}",
            budget.delta,
        )
    inner = (
        cfg
        if (budget.epsilon, budget.delta) == (cfg.target_epsilon, cfg.delta)
        else cfg.model_copy(update={"target_epsilon": budget.epsilon, "delta": budget.delta})
    )
    plan = plan_training_privacy(inner, fac, planner)
    return replace(
        plan,
        delta=budget.delta,
        target_epsilon=None if cfg.non_private else budget.epsilon,
        vocabulary=budget.vocabulary,
    )


def plan_training_privacy(
    cfg: RunConfig, fac: Factorization, planner: CohortPlanner
) -> PrivacyPlan:
    """σ and planned ε. Unamplified: one Gaussian with sensitivity k_u (a user's ≤ k_u items each
    follow the factorization's pattern, so their sum has sensitivity ≤ k_u by the triangle
    inequality). Monte Carlo: the planner's own sampler — warm b-min-sep (004 Alg. 2) or
    multi-attribution with k_u (Alg. 3, Thm 6.1) — at its Poisson probability p, verified at the
    target δ (the accountant dict's ``delta`` is the δ its samples verified). MMCC (poisson /
    cyclic-poisson participation): 002 Alg. 1 / Alg. 3 at the sampler's probability.

    With no accountant named (``cfg.accountant`` None) a fixed-epoch run is accounted unamplified,
    and an amplified participation (bminsep, multi-attribution, poisson, cyclic-poisson) goes
    through `TightestAccountant`, as ``corrflow account``
    does: every bound that applies is computed
    (`candidate_accountants`) and the tightest verified at the
    target δ is used; the report's ``accountant`` section names it (``selected``) and lists the
    others (``bounds``, ``skipped``). When the bound used is the sampler's unamplified one (the
    exact Gaussian curve of its worst pattern, or Monte Carlo's fallback to it), the run is planned
    unamplified: public cohorts from ``schedule-seed`` and post-hoc accounting of the realised
    pattern, as with ``--accountant unamplified``. Where no amplified bound can analyse the run (a
    user holding several items without multi-attribution sampling) it is accounted unamplified, and
    the section says why.

    Args:
        cfg: the run's settings (their target ε and δ are the training's).
        fac: the run's factorization.
        planner: the run's cohort planner.

    Returns:
        The `PrivacyPlan` (σ 0 and ε None for a non-private baseline).

    Raises:
        InvalidArgumentError: several items per user without multi-attribution participation, or a
            setting the accountant refuses.
    """
    if cfg.non_private:
        log.warning("non-private baseline: no noise is added and there is no privacy guarantee")
        return PrivacyPlan(0.0, None, {"name": "none", "sampling": "none", "slack": 0.0})
    target = (
        {"noise_multiplier": cfg.noise_multiplier}
        if cfg.noise_multiplier is not None
        else {"target_epsilon": cfg.target_epsilon}
    )
    accountant, skipped = _run_accountant(cfg, planner)
    # the sampler's own accountant (004, 002), or the tightest of them (None)
    if accountant != "unamplified":
        return _amplified_plan(cfg, fac, planner, accountant, target)
    return _unamplified_plan(cfg, fac, planner, target, skipped)


def _amplified_plan(
    cfg: RunConfig,
    fac: Factorization,
    planner: CohortPlanner,
    accountant: str | None,
    target: dict,
) -> PrivacyPlan:
    """The plan under the sampler's own accountant, or (``accountant`` None) the tightest verified
    bound that applies; planned unamplified when that bound is the sampler's unamplified one."""
    k_u = planner.items_per_user
    require(
        k_u == 1 or planner.kind == "multi-attribution",
        "accountant",
        "participation multi-attribution when a user holds several items (k_u > 1)",
        k_u,
    )
    spec = SamplingSpec(
        planner.kind,
        planner.summary().items,
        planner.expected,
        items_per_user=k_u,
        sampling_probability=planner.p,
        accountant=accountant,
    )
    if accountant is None:
        log.info(
            "corrflow: no accountant named: computing every bound that applies to %s sampling "
            "and using the tightest verified at δ = %g (Monte Carlo at a small δ can take "
            "minutes; --accountant picks one)",
            planner.kind,
            cfg.delta,
        )
    res = account(
        fac,
        delta=cfg.delta,
        sampling=spec,
        mc_samples=cfg.mc_samples,
        seed=cfg.schedule_seed,
        **target,
    )
    acc = res["accountant"]
    if accountant is None:
        log.info("corrflow: %s", selection_line(acc))
    # The regime follows what the bound used analysed (tracking module): the sampler's
    # unamplified worst-case pattern (the exact Gaussian curve) needs no secret cohorts, and its
    # realised pattern is accounted post hoc.
    amplified = accountant is not None or acc["name"] != GAUSSIAN_NAME
    if not amplified:
        acc = {
            **acc,
            "sampling": f"none ({planner.kind}, unamplified: the tightest verified bound)",
            "items_per_user": k_u,
        }
    return PrivacyPlan(
        res["noise_multiplier"], res["epsilon"], acc, amplified=amplified, items_per_user=k_u
    )


def _unamplified_plan(
    cfg: RunConfig, fac: Factorization, planner: CohortPlanner, target: dict, skipped: list[dict]
) -> PrivacyPlan:
    """The plan under one Gaussian with sensitivity k_u (σ scaled by k_u), listing the amplified
    bounds ``skipped`` and why."""
    k_u = planner.items_per_user
    if "noise_multiplier" in target:
        res = account(fac, delta=cfg.delta, noise_multiplier=cfg.noise_multiplier / k_u)
        sigma = cfg.noise_multiplier
    else:
        res = account(fac, delta=cfg.delta, target_epsilon=cfg.target_epsilon)
        sigma = res["noise_multiplier"] * k_u
    acc = {
        **res["accountant"],
        "sampling": f"none ({planner.kind}, unamplified)",
        "items_per_user": k_u,
        "normalisation": f"sensitivity {k_u} = k_u × 1 under the planned participation",
        **({"selection": "the only bound that applies", "skipped": skipped} if skipped else {}),
    }
    return PrivacyPlan(sigma, res["epsilon"], acc, amplified=False, items_per_user=k_u)


def _run_accountant(cfg: RunConfig, planner: CohortPlanner) -> tuple[str | None, list[dict]]:
    """The accountant a run asks `accountant_for` for: the one
    its settings name; with none named, ``unamplified`` for a fixed-epoch pattern and None (the
    tightest that applies) for a sampler — unless a user holds several items outside
    multi-attribution sampling, which only the unamplified bound (sensitivity k_u) analyses, except
    under Poisson sampling, which has no unamplified bound (the amplified path then refuses, naming
    the setting). Returns (the accountant, the amplified bounds not computed and why)."""
    if cfg.accountant is not None:
        return str(cfg.accountant), []
    if planner.kind == "fixed-epoch":
        return "unamplified", []
    k_u = planner.items_per_user
    if k_u > 1 and planner.kind not in ("multi-attribution", "poisson"):
        return "unamplified", [
            {
                "accountant": "amplified (monte-carlo, mmcc, cyclic-poisson)",
                "reason": (
                    f"a user holds up to {k_u} items: only multi-attribution sampling (004 §6) "
                    "analyses several items per user"
                ),
            }
        ]
    return None, []


def selection_line(acc: dict) -> str:
    """One line naming the bound a run uses and the others, from the report's ``accountant``
    section.

    Args:
        acc: the ``accountant`` section (with ``selected`` and ``bounds`` when the tightest was
            selected).

    Returns:
        e.g. ``"accountant monte-carlo: the tightest bound verified at the target δ (ε 2.221, σ 1);
        others: unamplified ε 4.377, σ 1"``; just the accountant's name when nothing was selected
        among several.
    """
    if "bounds" not in acc:
        return f"accountant {acc.get('name', 'none')}"
    used = next((b for b in acc["bounds"] if b["accountant"] == acc["selected"]), None)

    def values(b: dict) -> str:
        return f"ε {b['epsilon']:.4g}, σ {b['noise_multiplier']:.4g}"

    others = [
        f"{b['accountant']} {values(b)}" + ("" if b["verified"] else " (not verified)")
        for b in acc["bounds"]
        if b is not used
    ]
    others += [f"{s['accountant']} not computed ({s['reason']})" for s in acc.get("skipped", [])]
    # Monte Carlo verified nothing better: its fallback bound stands
    fallback = acc.get("released") == "fallback"
    return (
        f"accountant {acc['selected']}"
        + (f" (released its fallback, {acc['name']})" if fallback else "")
        + ": the tightest bound verified at the target δ"
        + ("" if used is None else f" ({values(used)})")
        + (f"; others: {', '.join(others)}" if others else "")
    )
