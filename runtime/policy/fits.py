"""Sliding-window least-squares fits of measured stage times, for ``runtime.policy.cost_model``.

- ``LinearFit``: ``y = intercept + slope x x`` (decode steps, transfers, encodes).
- ``QuadraticFit``: ``y = intercept + slope x x + curve x x^2`` (prefill: the attention over
  the prompt grows with its square; on a small model the fixed cost dominates short prompts,
  so a straight line through long and short prompts is wrong for both).

Both start at a prior, refit from the last ``window`` observations once ``min_points`` are
held, never return a negative or non-finite coefficient, and cost O(1) per observation
(running sums, recomputed exactly every ``window`` observations so rounding never accumulates).
"""

from __future__ import annotations

import math
from collections import deque


class _WindowFit:
    """The window both fits share: validated observations, the oldest leaving as a new one
    arrives, running sums (``_add``) recomputed exactly (``_exact_sums``) every ``window``
    observations, and a refit (``_refit``) after each one."""

    __slots__ = ("min_points", "rejected", "_points", "_since_exact")

    def __init__(self, window: int, min_points: int) -> None:
        if window < 1 or min_points < 1 or min_points > window:
            raise ValueError(f"need 1 <= min_points <= window, got min_points={min_points}, window={window}")
        self.min_points = min_points
        self.rejected = 0
        self._points: deque[tuple[float, float]] = deque(maxlen=window)
        self._since_exact = 0

    @property
    def points(self) -> int:
        return len(self._points)

    @property
    def fitted(self) -> bool:
        return len(self._points) >= self.min_points

    def observe(self, x: float, y: float) -> bool:
        """Add one point; False (and counted in ``rejected``) when it is not finite and >= 0."""
        if not (math.isfinite(x) and math.isfinite(y) and x >= 0 and y >= 0):
            self.rejected += 1
            return False
        x, y = float(x), float(y)
        points = self._points
        if len(points) == points.maxlen:
            self._add(*points[0], sign=-1.0)  # the oldest point leaves the window
        points.append((x, y))
        self._since_exact += 1
        if self._since_exact >= points.maxlen or len(points) == 1:  # type: ignore[operator]
            self._exact_sums()
            self._since_exact = 0
        else:
            self._add(x, y, sign=1.0)
        self._refit()
        return True

    def _add(self, x: float, y: float, sign: float) -> None:
        raise NotImplementedError

    def _exact_sums(self) -> None:
        raise NotImplementedError

    def _refit(self) -> None:
        raise NotImplementedError


class LinearFit(_WindowFit):
    """``y = intercept + slope x x`` least-squares over the last ``window`` points.

    Until ``min_points`` observations are held, the prior is returned. With too
    little spread in x only the intercept is refit (the prior slope is kept); a
    negative slope (or a non-positive one when ``positive_slope``) also keeps the
    prior slope; a negative intercept is clamped to 0 and the slope refit through
    the origin. Each observation costs O(1): the window keeps running sums of
    shifted values (recomputed exactly every ``window`` observations, so rounding
    never accumulates).
    """

    __slots__ = ("prior_intercept", "prior_slope", "intercept", "slope", "positive_slope",
                 "_kx", "_ky", "_sx", "_sy", "_sxx", "_sxy")

    def __init__(self, intercept: float, slope: float, *, window: int, min_points: int, positive_slope: bool = False) -> None:
        super().__init__(window, min_points)
        self.prior_intercept = self.intercept = float(intercept)
        self.prior_slope = self.slope = float(slope)
        self.positive_slope = positive_slope
        self._kx = self._ky = 0.0  # shift: sums are of (x - kx), (y - ky)
        self._sx = self._sy = self._sxx = self._sxy = 0.0

    def _add(self, x: float, y: float, sign: float) -> None:
        dx, dy = x - self._kx, y - self._ky
        self._sx += sign * dx
        self._sy += sign * dy
        self._sxx += sign * dx * dx
        self._sxy += sign * dx * dy

    def _exact_sums(self) -> None:
        n = len(self._points)
        self._kx = sum(p[0] for p in self._points) / n
        self._ky = sum(p[1] for p in self._points) / n
        self._sx = self._sy = 0.0
        self._sxx = sum((p[0] - self._kx) ** 2 for p in self._points)
        self._sxy = sum((p[0] - self._kx) * (p[1] - self._ky) for p in self._points)

    def _refit(self) -> None:
        n = len(self._points)
        if n < self.min_points:
            self.intercept, self.slope = self.prior_intercept, self.prior_slope
            return
        dmx, dmy = self._sx / n, self._sy / n  # means of the shifted values
        sxx = self._sxx - n * dmx * dmx  # centered sums
        sxy = self._sxy - n * dmx * dmy
        mx, my = self._kx + dmx, self._ky + dmy
        spread_ok = sxx > 1e-12 * n * max(1.0, mx * mx)
        slope = sxy / sxx if spread_ok else self.prior_slope
        if slope < 0 or (self.positive_slope and slope <= 0):
            slope = self.prior_slope
        intercept = my - slope * mx
        if intercept < 0:
            intercept = 0.0
            sum_xx = sxx + n * mx * mx  # raw sums, for the fit through the origin
            sum_xy = sxy + n * mx * my
            if sum_xx > 0:
                through_origin = sum_xy / sum_xx
                if through_origin > 0 or (through_origin == 0 and not self.positive_slope):
                    slope = through_origin
        self.intercept, self.slope = intercept, slope

    def __call__(self, x: float) -> float:
        return self.intercept + self.slope * x


class QuadraticFit(_WindowFit):
    """``y = intercept + slope x x + curve x x^2``: least squares with every coefficient >= 0.

    The non-negative solution is exact: each subset of the three terms is solved by least
    squares, and the best (lowest squared error) whose coefficients are all >= 0 wins; ties go
    to the line ``intercept + slope x x`` first, then to fewer terms. A subset is only solved
    when the points determine it (enough distinct x), so two distinct sizes give a line, never a
    guessed curve. With no spread in x at all, or when only a flat line fits (times that fall as
    prompts grow: noise, not physics), the prior slope and curve are kept and only the intercept
    is refit (clamped at 0). Until ``min_points`` observations are held, the prior.

    x is scaled by ``X_SCALE`` inside the sums (tokens in thousands), so x^4 stays near 1.
    """

    X_SCALE = 1000.0
    # index sets into (intercept, slope, curve), in tie-break order
    _SUBSETS = ((0, 1), (0, 1, 2), (0, 2), (1, 2), (0,), (1,), (2,))

    __slots__ = ("prior", "intercept", "slope", "curve", "_m")

    def __init__(self, intercept: float, slope: float, curve: float = 0.0, *, window: int, min_points: int) -> None:
        super().__init__(window, min_points)
        self.prior = (float(intercept), float(slope), float(curve))
        self.intercept, self.slope, self.curve = self.prior
        # moments of the scaled points: n, Sx, Sx2, Sx3, Sx4, Sy, Sxy, Sx2y, Syy
        self._m = [0.0] * 9

    def _exact_sums(self) -> None:
        self._m = [0.0] * 9
        for x, y in self._points:
            self._add(x, y, sign=1.0)

    def _add(self, x: float, y: float, sign: float) -> None:
        s = x / self.X_SCALE
        s2 = s * s
        m = self._m
        m[0] += sign
        m[1] += sign * s
        m[2] += sign * s2
        m[3] += sign * s2 * s
        m[4] += sign * s2 * s2
        m[5] += sign * y
        m[6] += sign * s * y
        m[7] += sign * s2 * y
        m[8] += sign * y * y

    def _refit(self) -> None:
        if len(self._points) < self.min_points:
            self.intercept, self.slope, self.curve = self.prior
            return
        n, sx, sx2, sx3, sx4, sy, sxy, sx2y, syy = self._m
        gram = ((n, sx, sx2), (sx, sx2, sx3), (sx2, sx3, sx4))
        rhs = (sy, sxy, sx2y)
        mean = sx / n
        if sx2 / n - mean * mean <= 1e-12 * max(1.0, mean * mean):  # one size only: the level, not the shape
            self._level_only()
            return
        best, best_sse = None, math.inf
        tolerance = 1e-9 * max(syy, 1e-300)
        for subset in self._SUBSETS:
            beta = _solve([[gram[i][j] for j in subset] for i in subset], [rhs[i] for i in subset])
            if beta is None or min(beta) < 0:
                continue
            fit = sum(b * rhs[i] for b, i in zip(beta, subset))  # at the optimum, SSE = Syy - beta . X'y
            sse = syy - fit
            if sse < best_sse - tolerance:
                best, best_sse = dict(zip(subset, beta)), sse
        if best is None or set(best) == {0}:  # no growing shape fits (noise): keep the prior's, refit the level
            self._level_only()
            return
        self.intercept = best.get(0, 0.0)
        self.slope = best.get(1, 0.0) / self.X_SCALE
        self.curve = best.get(2, 0.0) / self.X_SCALE**2

    def _level_only(self) -> None:
        """The prior slope and curve, with the intercept that fits the points best (>= 0)."""
        n, sx, sx2, *_ = self._m
        _, slope, curve = self.prior
        self.intercept = max(0.0, (self._m[5] - slope * self.X_SCALE * sx - curve * self.X_SCALE**2 * sx2) / n)
        self.slope, self.curve = slope, curve

    def __call__(self, x: float) -> float:
        return self.intercept + (self.slope + self.curve * x) * x


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a z = b`` for a small symmetric positive semi-definite ``a`` (Gaussian elimination with
    partial pivoting); None when ``a`` is (numerically) singular: the points do not determine z."""
    k = len(b)
    rows = [row[:] + [rhs] for row, rhs in zip(a, b)]
    scale = max(abs(rows[i][i]) for i in range(k)) or 1.0
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) <= 1e-10 * scale:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, k):
            factor = rows[r][col] / rows[col][col]
            for c in range(col, k + 1):
                rows[r][c] -= factor * rows[col][c]
    z = [0.0] * k
    for r in range(k - 1, -1, -1):
        z[r] = (rows[r][k] - sum(rows[r][c] * z[c] for c in range(r + 1, k))) / rows[r][r]
    return z
