"""Compute-optimal scaling fits from an iso-FLOP sweep (Hoffmann et al. 2022, "Training Compute-Optimal Large
Language Models", approach 2), per mixer: pure numpy, no optimiser library.

Input: one point per finished run, (N parameters, C its training-FLOP budget, L its final validation loss).

  iso-FLOP profile   at each budget C, L against x = ln N is fitted with a parabola L = c0 + c1 x + c2 x^2 (least
                     squares); its vertex gives N_opt(C) = exp(-c1 / 2 c2) and L_opt(C). A profile with c2 <= 0 has
                     no minimum; one whose vertex lies outside its sizes is extrapolated (`inside` False). Only
                     profiles with a minimum inside their sizes feed the two laws below.
  frontier           L_opt(C) = E + A C^-alpha: for a fixed alpha the law is linear in (E, A), solved exactly by
                     least squares, so the fit is a one-dimensional search over alpha (a log grid, then
                     zooms onto its best point). A must come out positive: a loss that does not fall with
                     compute has no law.
  N_opt law          N_opt(C) = k C^a: a straight line in (ln C, ln N_opt). D_opt = C / (6 N_opt) then grows as
                     C^(1 - a) under the 6ND rule; this package counts C by each model's own FLOPs instead.
  intervals          a residual bootstrap of the whole procedure: the parabolas' residuals, pooled over a mixer's
                     budgets and scaled by sqrt(n / (n - p)) for the fitted parameters, are resampled onto the fitted
                     values; every replicate refits the profiles, the frontier and the N_opt law. Intervals are the
                     replicates' percentiles (2.5 / 97.5 by default); a replicate whose profiles leave too few minima
                     is dropped and counted. With 3 sizes per budget the parabolas interpolate and there is nothing
                     to resample: no intervals.
  compute multiplier the compute a mixer needs to reach the baseline's frontier loss at budget C, over C:
                     L_m^-1(L_b(C)) / C (1: equal; 2: needs twice the compute; inf: its fitted floor E is above
                     that loss). Its interval pairs the two mixers' bootstrap replicates.
  does it hold       a fit whose parameters leave their physical range is not a result, and each says why
                     (`Profile.problem`, `ScalingFit.frontier_problem` / `n_opt_problem`, `Multiplier.problem`;
                     "" when it holds): a parabola without a minimum, or with it outside the sizes run; a frontier
                     with a negative floor E (a loss has none), alpha at the end of its search range, or a parameter
                     whose interval is wider than its value; an N_opt law with a outside (0, 1) (N_opt and D_opt =
                     C / 6 N_opt must both grow with compute) or a wider than its interval; a multiplier outside the
                     mixer's budgets, or wider than its interval.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

ALPHA_RANGE = (1e-3, 3.0)  # the frontier exponent's search interval


@dataclass(frozen=True)
class Profile:
    """The iso-FLOP profile at one budget: the points and the parabola in ln N through them."""
    budget: float
    n: tuple[float, ...]
    loss: tuple[float, ...]
    coef: tuple[float, float, float]  # (c2, c1, c0) of L = c2 x^2 + c1 x + c0, x = ln N
    n_opt: Optional[float]  # exp(vertex); None without a minimum (c2 <= 0)
    loss_opt: Optional[float]
    inside: bool  # the vertex lies within the profile's sizes

    def at(self, n) -> np.ndarray:
        return np.polyval(self.coef, np.log(np.asarray(n, dtype=float)))

    @property
    def usable(self) -> bool:
        return self.n_opt is not None and self.inside

    @property
    def problem(self) -> str:
        """Why its minimum is not a result ('' when it is)."""
        if self.n_opt is None:
            return "no minimum (the parabola opens downward)"
        if not self.inside:
            n = f"{self.n_opt:,.0f}" if self.n_opt >= 100 else f"{self.n_opt:.3g}"
            return f"its minimum N = {n} lies outside the sizes run ({min(self.n):,.0f}-{max(self.n):,.0f})"
        return ""


@dataclass(frozen=True)
class PowerLaw:
    """L(C) = E + A C^-alpha."""
    E: float
    A: float
    alpha: float

    def __call__(self, c) -> np.ndarray:
        return self.E + self.A * np.asarray(c, dtype=float) ** -self.alpha

    def inverse(self, loss: float) -> float:
        """The compute at which the law reaches `loss` (inf at or below its floor E)."""
        return math.inf if loss <= self.E else (self.A / (loss - self.E)) ** (1.0 / self.alpha)


@dataclass(frozen=True)
class Exponent:
    """N_opt(C) = k C^a."""
    k: float
    a: float

    def __call__(self, c) -> np.ndarray:
        return self.k * np.asarray(c, dtype=float) ** self.a


@dataclass
class ScalingFit:
    """One mixer's fits, their bootstrap replicates and percentile intervals (None where not computable)."""
    profiles: list[Profile]
    frontier: Optional[PowerLaw]
    n_opt_law: Optional[Exponent]
    boot_frontiers: list[PowerLaw] = field(default_factory=list)
    boot_n_opt: list[Exponent] = field(default_factory=list)
    boot_dropped: int = 0  # replicates without enough minima for the laws
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)  # E, A, alpha, a, k
    level: float = 0.95  # the intervals' coverage

    @property
    def budgets(self) -> list[float]:
        return [p.budget for p in self.profiles]

    @property
    def frontier_problem(self) -> str:
        """Why L = E + A C^-alpha does not hold ('' when it does, or when there is no frontier)."""
        f = self.frontier
        if f is None:
            return ""
        if f.E < 0:
            return f"E = {f.E:.3g} < 0: a loss has no negative floor"
        if not ALPHA_RANGE[0] * 1.001 < f.alpha < ALPHA_RANGE[1] / 1.001:
            return f"alpha = {f.alpha:.3g} is at the end of its search range {list(ALPHA_RANGE)}"
        return self._wider_than_interval((("E", f.E), ("A", f.A), ("alpha", f.alpha)))

    @property
    def n_opt_problem(self) -> str:
        """Why N_opt = k C^a does not hold ('' when it does, or when there is no law)."""
        e = self.n_opt_law
        if e is None:
            return ""
        if not 0 < e.a < 1:
            return f"a = {e.a:.3g} lies outside (0, 1): N_opt and D_opt ~ C^(1 - a) must both grow with compute"
        return self._wider_than_interval((("a", e.a),))

    def _wider_than_interval(self, values) -> str:
        for name, v in values:
            lo, hi = self.intervals.get(name, (v, v))
            if hi - lo > abs(v):
                return f"its {self.level:.0%} interval [{lo:.4g}, {hi:.4g}] is wider than {name} = {v:.4g}"
        return ""


# ----------------------------------------------------------------------------- the three fits


def fit_profile(budget: float, n: Sequence[float], loss: Sequence[float]) -> Optional[Profile]:
    """The parabola in ln N through one budget's points (None with fewer than 3 distinct sizes)."""
    n, loss = np.asarray(n, dtype=float), np.asarray(loss, dtype=float)
    if len(set(n.tolist())) < 3:
        return None
    x = np.log(n)
    mid = x.mean()  # centred for conditioning, then expanded back to powers of x
    b2, b1, b0 = np.polyfit(x - mid, loss, 2)
    coef = (float(b2), float(b1 - 2 * b2 * mid), float(b0 - b1 * mid + b2 * mid * mid))
    order = np.argsort(n)
    n_t, l_t = tuple(n[order].tolist()), tuple(loss[order].tolist())
    if b2 <= 0:
        return Profile(budget, n_t, l_t, coef, None, None, False)
    vertex = mid - b1 / (2 * b2)
    return Profile(budget, n_t, l_t, coef, float(math.exp(vertex)), float(b0 - b1 * b1 / (4 * b2)),
                   bool(x.min() <= vertex <= x.max()))


def fit_power_law(c: Sequence[float], loss: Sequence[float]) -> Optional[PowerLaw]:
    """L = E + A C^-alpha by least squares (None with fewer than 3 points, or a loss that does not fall with C)."""
    c, loss = np.asarray(c, dtype=float), np.asarray(loss, dtype=float)
    if len(set(c.tolist())) < 3:
        return None
    ref = float(np.exp(np.log(c).mean()))  # C / ref near 1: the columns of the linear solve are well scaled
    u = np.log(c / ref)

    def solve(alphas: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(SSE, E, A') of the best (E, A') at each alpha: the least squares of L on [1, (C/ref)^-alpha]."""
        z = np.exp(-np.outer(alphas, u))  # (alphas, points)
        zc, lc = z - z.mean(axis=1, keepdims=True), loss - loss.mean()
        var = np.maximum((zc * zc).sum(axis=1), 1e-300)
        slope = (zc * lc).sum(axis=1) / var
        sse = ((lc - slope[:, None] * zc) ** 2).sum(axis=1)
        return sse, loss.mean() - slope * z.mean(axis=1), slope

    lo, hi = np.log(ALPHA_RANGE)
    grid = np.linspace(lo, hi, 241)
    for _ in range(14):  # a log grid, then 13 zooms onto the best point's neighbours (20x narrower each)
        i = int(np.argmin(solve(np.exp(grid))[0]))
        step = grid[1] - grid[0]
        grid = np.linspace(max(grid[i] - step, lo), min(grid[i] + step, hi), 41)
    alpha = float(np.exp(grid[int(np.argmin(solve(np.exp(grid))[0]))]))
    _, e, a = (float(v[0]) for v in solve(np.array([alpha])))
    if a <= 0:
        return None
    return PowerLaw(e, a * ref ** alpha, alpha)  # A' (C/ref)^-alpha = A' ref^alpha C^-alpha


def fit_exponent(c: Sequence[float], n: Sequence[float]) -> Optional[Exponent]:
    """N = k C^a: least squares on (ln C, ln N) (None with fewer than 2 budgets)."""
    c, n = np.asarray(c, dtype=float), np.asarray(n, dtype=float)
    if len(set(c.tolist())) < 2:
        return None
    a, ln_k = np.polyfit(np.log(c), np.log(n), 1)
    return Exponent(float(math.exp(ln_k)), float(a))


# ----------------------------------------------------------------------------- one mixer's procedure


def _laws(profiles: list[Profile]) -> tuple[Optional[PowerLaw], Optional[Exponent]]:
    good = [p for p in profiles if p.usable]
    c = [p.budget for p in good]
    return (fit_power_law(c, [p.loss_opt for p in good]),
            fit_exponent(c, [p.n_opt for p in good]))


def _group(n, c, loss) -> dict[float, tuple[list[float], list[float]]]:
    by_budget: dict[float, tuple[list[float], list[float]]] = {}
    for ni, ci, li in zip(n, c, loss):
        by_budget.setdefault(float(ci), ([], []))
        by_budget[float(ci)][0].append(float(ni))
        by_budget[float(ci)][1].append(float(li))
    return dict(sorted(by_budget.items()))


def fit_scaling(n: Sequence[float], c: Sequence[float], loss: Sequence[float], n_boot: int = 1000, seed: int = 0,
                level: float = 0.95) -> ScalingFit:
    """The iso-FLOP profiles, the frontier and the N_opt law of one mixer's points (N_i, C_i, L_i), with a
    residual bootstrap of `n_boot` replicates for `level` percentile intervals."""
    groups = _group(n, c, loss)
    profiles = [p for b, (ns, ls) in groups.items() if (p := fit_profile(b, ns, ls)) is not None]
    frontier, law = _laws(profiles)
    fit = ScalingFit(profiles, frontier, law, level=level)
    resid = np.concatenate([np.asarray(p.loss) - p.at(p.n) for p in profiles]) if profiles else np.zeros(0)
    dof = len(resid) - 3 * len(profiles)
    if n_boot <= 0 or dof <= 0 or frontier is None and law is None:
        return fit
    resid = resid * math.sqrt(len(resid) / dof)  # least-squares residuals are smaller than the noise by this much
    rng = np.random.default_rng(seed)
    for _ in range(n_boot):
        replicate = []
        for p in profiles:
            noisy = p.at(p.n) + rng.choice(resid, size=len(p.n), replace=True)
            if (q := fit_profile(p.budget, p.n, noisy)) is not None:
                replicate.append(q)
        f, e = _laws(replicate)
        if (frontier is not None and f is None) or (law is not None and e is None):
            fit.boot_dropped += 1
            continue
        if f is not None:
            fit.boot_frontiers.append(f)
        if e is not None:
            fit.boot_n_opt.append(e)
    tails = (100 * (1 - level) / 2, 100 * (1 + level) / 2)
    for name, values in (("E", [f.E for f in fit.boot_frontiers]), ("A", [f.A for f in fit.boot_frontiers]),
                         ("alpha", [f.alpha for f in fit.boot_frontiers]), ("a", [e.a for e in fit.boot_n_opt]),
                         ("k", [e.k for e in fit.boot_n_opt])):
        if values:
            lo, hi = np.percentile(values, tails)
            fit.intervals[name] = (float(lo), float(hi))
    return fit


# ----------------------------------------------------------------------------- across mixers


def _sci(x: float) -> str:
    """2.24e12, as FLOPs are written (not 2.24e+12)."""
    mantissa, _, exp = f"{x:.3g}".partition("e")
    return mantissa + (f"e{int(exp)}" if exp else "")


@dataclass(frozen=True)
class Multiplier:
    """The compute `mixer` needs to reach the baseline's frontier loss at `budget`, as a multiple of it."""
    mixer: str
    budget: float
    target_loss: float  # the baseline's frontier at the budget
    value: float  # L_m^-1(target) / budget (inf: below the mixer's fitted floor)
    interval: Optional[tuple[float, float]]
    extrapolated: bool  # the compute it needs lies outside the mixer's own budgets
    problem: str = ""  # why it is not a result ('' when it is)


def compute_multipliers(fits: dict[str, ScalingFit], baseline: str, level: float = 0.95) -> list[Multiplier]:
    """For every mixer with a frontier (the baseline included: 1 by definition) at each of the baseline's budgets."""
    base = fits[baseline]
    if base.frontier is None:
        return []
    tails = (100 * (1 - level) / 2, 100 * (1 + level) / 2)
    out = []
    for name, fit in fits.items():
        if fit.frontier is None:
            continue
        lo_c, hi_c = min(fit.budgets), max(fit.budgets)
        for budget in base.budgets:
            target = float(base.frontier(budget))
            value = fit.frontier.inverse(target) / budget
            pairs = list(zip(fit.boot_frontiers, base.boot_frontiers))
            interval = None
            if pairs and name != baseline:
                draws = [f.inverse(float(b(budget))) / budget for f, b in pairs]  # inf: a replicate's floor above
                interval = (float(np.percentile(draws, tails[0], method="lower")),
                            float(np.percentile(draws, tails[1], method="higher")))
            needed = value * budget  # within float rounding of the budgets run: not an extrapolation
            outside = name != baseline and not lo_c * (1 - 1e-9) <= needed <= hi_c * (1 + 1e-9)
            problem = ("" if value == math.inf else  # a floor above the target: a result (it never gets there)
                       f"the compute it needs ({_sci(needed)}) lies outside its budgets ({_sci(lo_c)}-{_sci(hi_c)})"
                       if outside else f"its {level:.0%} interval [{interval[0]:.4g}, {interval[1]:.4g}] is wider "
                       f"than the value" if interval and interval[1] - interval[0] > value else "")
            out.append(Multiplier(name, budget, target, value, interval, outside, problem))
    return out
