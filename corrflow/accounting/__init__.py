"""Privacy accounting behind one interface (`Accountant`, chosen by `accountant_for`).

* unamplified: the exact Gaussian curve of Balle & Wang, "Improving the Gaussian Mechanism for
  Differential Privacy", arXiv 1805.06530, Thm. 8, at the factorization's sensitivity (000:
  Choquette-Choo, McMahan, Rush, Thakurta, "Multi-Epoch Matrix Factorization Mechanisms for Private
  Machine Learning", arXiv 2211.06530, App. D.2);
* cyclic Poisson sampling of a banded encoder (001: McKenna, "Scaling up the Banded Matrix
  Factorization Mechanism for Differentially Private ML", arXiv 2405.15913, Alg. 2 and Prop. 2.1)
  and MMCC for Poisson and cyclic Poisson sampling (002: Choquette-Choo, Ganesh, Steinke, Thakurta,
  "Privacy Amplification for Matrix Mechanisms", arXiv 2310.15526), on dp-accounting;
* Monte Carlo accounting of b-min-sep and balls-in-bins sampling, with multi-attribution, and of
  Poisson sampling of banded encoders, verified by Estimate-Verify-Release (004: Dong & Ganesh,
  "Privacy Amplification for BandMF via b-Min-Sep Subsampling", arXiv 2602.09338);
* with no accountant named, the tightest verified bound among those that apply
  (`TightestAccountant`);
* post-hoc accounting of the realised participation, the JSON privacy report (``corrflow schema
  privacy-report``), and the statistics of empirical audits with canaries
  (`corrflow.accounting.audit`).

What each bound assumes: docs/explanation/accounting.md.
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
from corrflow.accounting.montecarlo import (
    MonteCarloAccountant,
    adaptive_evr,
    minimum_samples,
    overall_delta,
)
from corrflow.accounting.posthoc import pattern_sensitivity, realized_sensitivity
from corrflow.accounting.report import hash_user_id, privacy_report, write_report

__all__ = [
    "ACCOUNTANTS_FOR",
    "SAMPLINGS",
    "Accountant",
    "AccountingOptions",
    "AccountingResult",
    "CyclicPoisson",
    "MonteCarloAccountant",
    "SamplingSpec",
    "TightestAccountant",
    "account",
    "accountant_for",
    "adaptive_evr",
    "calibrate_log_sigma",
    "calibrate_on_grid",
    "candidate_accountants",
    "epsilon_of",
    "gaussian_epsilon",
    "gaussian_noise_multiplier",
    "hash_user_id",
    "minimum_samples",
    "one_run_lower_bound",
    "one_shot_estimate",
    "overall_delta",
    "pattern_sensitivity",
    "privacy_report",
    "realized_sensitivity",
    "unamplified_event",
    "write_report",
]
