"""Error metrics of a factorization (docs "Conventions", Errors; 000 Eq. 4; 001 App. D).

With per-query error e_i = ‖B[i, :]‖² (B = A C⁻¹) and sensitivity s: total squared error L = s²·Σ
e_i, RMSE = √(L/n), max error = s·max √e_i, per-iterate variance = s²·e. All at unit noise
multiplier and unit clip norm, per model coordinate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class ErrorReport:
    """The errors of a mechanism (000 Eq. 4): total squared error sens²·‖B‖²_F, RMSE = √(total/n)
    and max error sens·maxᵢ‖Bᵢ‖."""

    total_squared_error: float
    rmse: float
    max_error: float

    def to_dict(self) -> dict:
        return asdict(self)


def error_report(per_query_error: np.ndarray, sensitivity: float) -> ErrorReport:
    """Aggregate per-query errors at a sensitivity (000 Eq. 4, arXiv 2211.06530).

    Args:
        per_query_error: squared row norms of the decoder B, shape (n,).
        sensitivity: sens.

    Returns:
        Total squared error sens²·Σ e, RMSE = √(total/n) and max error sens·√max e.
    """
    e = np.asarray(per_query_error, dtype=np.float64)
    total = float(sensitivity**2 * e.sum())
    return ErrorReport(total, float(np.sqrt(total / len(e))), float(sensitivity * np.sqrt(e.max())))
