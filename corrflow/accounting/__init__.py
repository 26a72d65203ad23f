"""Privacy accounting for correlated-noise training on dp-accounting: unamplified, cyclic-Poisson amplified,
b-min-sep / balls-in-bins Monte Carlo (with multi-attribution), MMCC for any non-negative
encoder under Poisson or cyclic-Poisson sampling, post-hoc accounting of realised participation,
and the JSON privacy report.
"""

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
from corrflow.accounting.mechanisms import CyclicPoisson, calibrate_on_grid, epsilon_of, unamplified_event
from corrflow.accounting.montecarlo import MonteCarloAccountant, adaptive_evr, minimum_samples, overall_delta
from corrflow.accounting.posthoc import pattern_sensitivity, realized_sensitivity
from corrflow.accounting.report import hash_user_id, privacy_report, write_report

__all__ = ["ACCOUNTANTS_FOR", "SAMPLINGS", "Accountant", "AccountingOptions", "AccountingResult", "CyclicPoisson",
           "MonteCarloAccountant", "SamplingSpec", "TightestAccountant", "account", "accountant_for", "adaptive_evr",
           "candidate_accountants", "calibrate_on_grid", "epsilon_of",
           "hash_user_id", "minimum_samples", "overall_delta", "pattern_sensitivity", "privacy_report",
           "realized_sensitivity", "unamplified_event", "write_report"]
