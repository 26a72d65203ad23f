"""Privacy accounting behind one interface: unamplified through the exact Gaussian curve (arXiv 1805.06530);
cyclic Poisson, MMCC and b-min-sep / balls-in-bins Monte Carlo (with multi-attribution) on dp-accounting;
post-hoc accounting of realised participation, the JSON privacy report, and the statistics of empirical audits with
canaries (:mod:`corrflow.accounting.audit`)."""

from corrflow.accounting.accountant import (
    ACCOUNTANTS_FOR,
    SAMPLINGS,
    Accountant,
    AccountingOptions,
    AccountingResult,
    SamplingSpec,
    TightestAccountant,
    account,
    accountant_for,
    candidate_accountants,
)
from corrflow.accounting.audit import one_run_lower_bound, one_shot_estimate
from corrflow.accounting.mechanisms import (
    CyclicPoisson,
    calibrate_log_sigma,
    calibrate_on_grid,
    epsilon_of,
    gaussian_epsilon,
    gaussian_noise_multiplier,
    unamplified_event,
)
from corrflow.accounting.montecarlo import MonteCarloAccountant, adaptive_evr, minimum_samples, overall_delta
from corrflow.accounting.posthoc import pattern_sensitivity, realized_sensitivity
from corrflow.accounting.report import hash_user_id, privacy_report, write_report

__all__ = ["ACCOUNTANTS_FOR", "SAMPLINGS", "Accountant", "AccountingOptions", "AccountingResult", "CyclicPoisson",
           "MonteCarloAccountant", "SamplingSpec", "TightestAccountant", "account", "accountant_for", "adaptive_evr",
           "calibrate_log_sigma", "calibrate_on_grid", "candidate_accountants", "epsilon_of", "gaussian_epsilon",
           "gaussian_noise_multiplier", "hash_user_id", "minimum_samples", "one_run_lower_bound", "one_shot_estimate",
           "overall_delta", "pattern_sensitivity", "privacy_report", "realized_sensitivity", "unamplified_event",
           "write_report"]
