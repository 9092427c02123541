"""The workload model: a healthy GPU's step time as a linear function of its work, fitted robustly.

    time = a * tokens/tp + b * sumsq/tp + c

(linear layers cost per token, attention per squared sequence length, c is the fixed per-step
cost; a rank of a TP group does 1/tp of the group's work). One fit per pipeline stage, since
stages run different layers; all healthy ranks of a stage share it, so a slow GPU is judged against
what its peers need for the same work rather than against its own (possibly already slow) past.

The fit keeps the last `capacity` rows in a ring (bounded memory) and minimises the Huber loss of
the *relative* residual (y - x.theta) / y, since timing noise is multiplicative: a 3% jitter on a
long step is as normal as on a short one. Iteratively reweighted least squares, warm-started from
the previous coefficients; rows whose relative residual exceeds `huber_k` robust sigmas weigh
less, so a stalled step or a slow GPU that slipped in does not drag the fit. Columns are scaled
before solving (tokens and sumsq differ by orders of magnitude) and a tiny ridge keeps the
solution defined when the data cannot separate two terms (e.g. tokens nearly constant because the
loader packs to a budget): the prediction stays right inside the data even if a and c do not.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

_MAD_TO_SIGMA = 1.4826


class RobustFit:
    """Online robust linear fit over a ring of the last `capacity` rows."""

    def __init__(self, n_features: int, capacity: int) -> None:
        self.n_features = n_features
        self.capacity = capacity
        self._x: FloatArray = np.zeros((capacity, n_features))
        self._y: FloatArray = np.zeros(capacity)
        self._written = 0
        self._pending = 0  # rows added since the last fit
        self.theta: FloatArray | None = None
        self.sigma = float("nan")  # robust sigma of the relative residuals at the last fit

    @property
    def rows(self) -> int:
        return min(self._written, self.capacity)

    def add(self, x: FloatArray, y: FloatArray) -> None:
        """Append rows (x: k x n_features, y: k); rows with y <= 0 are ignored."""
        keep = y > 0
        x, y = x[keep], y[keep]
        k = len(y)
        if k == 0:
            return
        if k > self.capacity:
            x, y, k = x[-self.capacity :], y[-self.capacity :], self.capacity
        idx = (self._written + np.arange(k)) % self.capacity
        self._x[idx] = x
        self._y[idx] = y
        self._written += k
        self._pending += k

    def maybe_refit(self, huber_k: float) -> None:
        """Refit once rows amounting to 1/16 of the ring arrived since the last fit: the model moves
        slowly, and a full IRLS per step would cost more than all else the detector does."""
        if self.theta is None or self._pending >= max(1, self.rows // 16):
            self.refit(huber_k)

    def resize(self, capacity: int) -> None:
        if capacity == self.capacity:
            return
        n = self.rows
        order = (self._written - n + np.arange(n)) % self.capacity  # oldest first
        x, y = self._x[order], self._y[order]
        keep = min(n, capacity)
        self._x = np.zeros((capacity, self.n_features))
        self._y = np.zeros(capacity)
        self._x[:keep] = x[n - keep :]
        self._y[:keep] = y[n - keep :]
        self._written = keep
        self.capacity = capacity

    def refit(self, huber_k: float, iterations: int = 2) -> None:
        """Re-estimate theta from the ring (needs rows >= n_features)."""
        n = self.rows
        if n < self.n_features:
            return
        self._pending = 0
        x, y = self._x[:n], self._y[:n]
        a = x / y[:, None]  # relative form: minimise |1 - a.theta| per row
        scale = np.abs(a).mean(axis=0)
        scale[scale == 0] = 1.0
        a = a / scale
        ones = np.ones(n)
        ridge = 1e-6 * n
        theta_s = None if self.theta is None else self.theta * scale
        w = np.ones(n)
        for it in range(iterations + (1 if theta_s is None else 0)):
            if theta_s is not None:
                r = ones - a @ theta_s
                sigma = _MAD_TO_SIGMA * median(np.abs(r - median(r)))
                sigma = max(sigma, 1e-4)
                u = np.abs(r) / (huber_k * sigma)
                w = np.where(u <= 1.0, 1.0, 1.0 / np.maximum(u, 1e-12))
            _ = it
            aw = a * w[:, None]
            lhs = a.T @ aw + ridge * np.eye(self.n_features)
            rhs = aw.T @ ones
            theta_s = np.linalg.solve(lhs, rhs)
        assert theta_s is not None
        r = ones - a @ theta_s
        self.sigma = _MAD_TO_SIGMA * median(np.abs(r - median(r)))
        self.theta = theta_s / scale

    def predict(self, x: FloatArray) -> FloatArray:
        if self.theta is None:
            return np.full(len(x), np.nan)
        out: FloatArray = x @ self.theta
        return out


def median(a: FloatArray) -> float:
    """Median of a non-empty 1-D array without NaNs (np.median's checks cost more than this)."""
    n = len(a)
    k = n // 2
    if n % 2:
        return float(np.partition(a, k)[k])
    p = np.partition(a, (k - 1, k))
    return 0.5 * float(p[k - 1] + p[k])


def row_nanmedian(m: FloatArray) -> FloatArray:
    """Median of each row ignoring NaNs; NaN for an all-NaN row."""
    srt = np.sort(m, axis=1)  # NaNs sort last
    cnt = (~np.isnan(m)).sum(axis=1)
    rows = np.arange(len(m))
    lo = np.maximum((cnt - 1) // 2, 0)
    hi = np.maximum(cnt // 2, 0)
    out: FloatArray = 0.5 * (srt[rows, lo] + srt[rows, np.minimum(hi, m.shape[1] - 1)])
    out[cnt == 0] = np.nan
    return out


def group_median(values: FloatArray, groups: IntArray, n_groups: int) -> FloatArray:
    """Median of `values` per group index (0..n_groups-1), NaN values ignored; NaN for empty groups."""
    out = np.full(n_groups, np.nan)
    ok = ~np.isnan(values)
    v, g = values[ok], groups[ok]
    if len(v) == 0:
        return out
    order = np.lexsort((v, g))
    v, g = v[order], g[order]
    counts = np.bincount(g, minlength=n_groups)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    has = counts > 0
    lo = starts[has] + (counts[has] - 1) // 2
    hi = starts[has] + counts[has] // 2
    out[has] = 0.5 * (v[lo] + v[hi])
    return out


def group_min(values: FloatArray, groups: IntArray, n_groups: int) -> FloatArray:
    out = np.full(n_groups, np.inf)
    np.minimum.at(out, groups, values)
    out[np.isinf(out)] = np.nan
    return out
