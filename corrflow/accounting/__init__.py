"""Privacy accounting for correlated-noise training on dp-accounting: unamplified, cyclic-Poisson amplified,
b-min-sep / balls-in-bins Monte Carlo (with multi-attribution), MMCC for any non-negative
encoder under Poisson or cyclic-Poisson sampling, post-hoc accounting of realised participation,
the JSON privacy report, and the statistics of empirical audits with canaries (:mod:`corrflow.accounting.audit`).
"""

from corrflow.accounting.accountant import (
    ACCOUNTANTS_FOR,
    SAMPLINGS,
    Accountant,
    AccountingOptions,
    AccountingResult,
    SamplingSpec,
    account,
    accountant_for,
)
from corrflow.accounting.audit import gaussian_epsilon, one_run_lower_bound, one_shot_estimate
from corrflow.accounting.mechanisms import CyclicPoisson, calibrate_on_grid, epsilon_of, unamplified_event
from corrflow.accounting.montecarlo import MonteCarloAccountant, minimum_samples, overall_delta
from corrflow.accounting.posthoc import pattern_sensitivity, realized_sensitivity
from corrflow.accounting.report import hash_user_id, privacy_report, write_report

__all__ = ["ACCOUNTANTS_FOR", "SAMPLINGS", "Accountant", "AccountingOptions", "AccountingResult", "CyclicPoisson",
           "MonteCarloAccountant", "SamplingSpec", "account", "accountant_for", "calibrate_on_grid", "epsilon_of",
           "gaussian_epsilon", "hash_user_id", "minimum_samples", "one_run_lower_bound", "one_shot_estimate",
           "overall_delta", "pattern_sensitivity", "privacy_report", "realized_sensitivity", "unamplified_event",
           "write_report"]
