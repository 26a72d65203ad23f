"""Linear recursive filtering (the Toeplitz and momentum recursions), with SciPy's ``lfilter``
imported on first use: ``scipy.signal`` takes 1–1.5 s to import, which every ``corrflow`` command
would otherwise pay."""

from __future__ import annotations

import numpy as np


def lfilter(b, a, x, axis: int = -1) -> np.ndarray:
    """y = filter(b, a, x) along ``axis`` (``scipy.signal.lfilter``): a[0]·y_n = Σ b_k x_{n−k} −
    Σ_{k≥1} a_k y_{n−k}."""
    from scipy.signal import lfilter as _lfilter

    return _lfilter(b, a, x, axis=axis)
