"""The scaling fits (attnzoo/analysis/scaling.py) recover known laws: exactly from exact points, within their
bootstrap intervals from noisy ones, and the iso-FLOP procedure applied to Hoffmann et al. (2022)'s parametric
loss recovers the N_opt exponent that law implies."""
import math
import re

import numpy as np
import pytest

from attnzoo.analysis.scaling import (Exponent, PowerLaw, ScalingFit, compute_multipliers, fit_exponent,
                                      fit_power_law, fit_profile, fit_scaling)

# float64 least squares: a fitted parameter is exact up to the flatness of the squared error at its minimum,
# i.e. relative ~sqrt(machine epsilon) ~ 1e-8; 1e-6 leaves room for the conditioning of the sums
EXACT = 1e-6

# a synthetic sweep: 5 budgets x the same 7 sizes (a fixed ladder, as a real sweep), profiles exactly parabolic in ln N
E, A, ALPHA, K, A_EXP, CURV = 1.8, 53.7, 0.15, 0.1, 0.5, 0.04
BUDGETS = np.array([1e11, 3e11, 1e12, 3e12, 1e13])
LADDER = np.exp(np.linspace(math.log(1e4), math.log(1e6), 7))


def synthetic(noise: float = 0.0, seed: int = 0):
    n = np.tile(LADDER, len(BUDGETS))
    c = np.repeat(BUDGETS, len(LADDER))
    loss = E + A * c ** -ALPHA + CURV * (np.log(n) - np.log(K * c ** A_EXP)) ** 2
    return n, c, loss + np.random.default_rng(seed).normal(0.0, noise, len(loss))


def test_each_fit_recovers_its_law_from_exact_points():
    p = fit_profile(1e12, LADDER, 2.5 + CURV * (np.log(LADDER) - math.log(3e5)) ** 2)
    assert p.n_opt == pytest.approx(3e5, rel=EXACT) and p.loss_opt == pytest.approx(2.5, rel=EXACT) and p.inside
    law = fit_power_law(BUDGETS, E + A * BUDGETS ** -ALPHA)
    assert (law.E, law.A, law.alpha) == pytest.approx((E, A, ALPHA), rel=EXACT)
    assert law.inverse(float(law(3e12))) == pytest.approx(3e12, rel=EXACT) and law.inverse(law.E) == math.inf
    exp = fit_exponent(BUDGETS, K * BUDGETS ** A_EXP)
    assert (exp.k, exp.a) == pytest.approx((K, A_EXP), rel=EXACT)

    fit = fit_scaling(*synthetic(), n_boot=50)
    assert [p.budget for p in fit.profiles] == BUDGETS.tolist() and all(p.usable for p in fit.profiles)
    assert [p.n_opt for p in fit.profiles] == pytest.approx((K * BUDGETS ** A_EXP).tolist(), rel=EXACT)
    assert (fit.frontier.E, fit.frontier.A, fit.frontier.alpha) == pytest.approx((E, A, ALPHA), rel=EXACT)
    assert (fit.n_opt_law.k, fit.n_opt_law.a) == pytest.approx((K, A_EXP), rel=EXACT)
    # nothing left to resample from exact points: every interval is the point itself
    assert fit.intervals["a"] == pytest.approx((A_EXP, A_EXP), rel=EXACT)


def test_a_profile_without_a_minimum_inside_its_sizes_is_left_out_of_the_laws():
    concave = fit_profile(1e12, LADDER, 3.0 - 0.01 * np.log(LADDER) ** 2)
    assert concave.n_opt is None and not concave.usable
    edge = fit_profile(1e12, LADDER, 2.5 + CURV * (np.log(LADDER) - math.log(1e3)) ** 2)  # vertex below the ladder
    assert edge.n_opt == pytest.approx(1e3, rel=EXACT) and not edge.inside
    assert fit_profile(1e12, [1e4, 1e4, 1e5], [3.0, 3.0, 2.9]) is None  # 2 distinct sizes: no parabola
    n, c, loss = synthetic()
    far = c == BUDGETS[-1]
    loss[far] = 2.5 + CURV * (np.log(n[far]) - math.log(1e7)) ** 2  # the last budget's optimum beyond the ladder
    fit = fit_scaling(n, c, loss, n_boot=0)
    assert [p.inside for p in fit.profiles] == [True, True, True, True, False]
    assert fit.n_opt_law.a == pytest.approx(A_EXP, rel=EXACT)  # from the 4 profiles with a minimum inside
    assert fit_power_law([1e11, 1e12, 1e13], [2.5, 2.6, 2.7]) is None  # a loss rising with compute has no law


# Noisy points: 0.01 loss noise (the order of a small LM's seed-to-seed spread: docs/scaling.md measured 0.024 nats
# at the CPU study's smallest budget). Over 100 noise
# draws of this design (200-300 replicates each) the 95% percentile intervals covered the true value in 92-93% of
# draws for every parameter, and the estimates of a, alpha and E had no bias beyond their standard errors (sd of
# a: 0.015, alpha: 0.017, E: 0.10). Checked here on 20 draws: an interval that covered even 90% of the time would
# cover at most 12 of 20 with probability 0.0004, and for an unbiased estimator a mean of 20 draws more than 3 of
# their standard errors from the truth has probability 0.007 (Student's t, 19 degrees of freedom).
NOISE, DRAWS, COVER_AT_LEAST = 0.01, 20, 13


def test_noisy_points_recover_the_laws_within_their_bootstrap_intervals():
    truth = {"E": E, "A": A, "alpha": ALPHA, "a": A_EXP, "k": K}
    covered = dict.fromkeys(truth, 0)
    estimates: dict[str, list[float]] = {"E": [], "alpha": [], "a": []}
    for draw in range(DRAWS):
        fit = fit_scaling(*synthetic(NOISE, seed=100 + draw), n_boot=200, seed=draw)
        assert fit.boot_dropped == 0 and len(fit.boot_frontiers) == 200
        for name, value in truth.items():
            lo, hi = fit.intervals[name]
            covered[name] += lo <= value <= hi
        estimates["E"].append(fit.frontier.E)
        estimates["alpha"].append(fit.frontier.alpha)
        estimates["a"].append(fit.n_opt_law.a)
    assert all(n >= COVER_AT_LEAST for n in covered.values()), covered
    for name, values in estimates.items():
        sem = np.std(values, ddof=1) / math.sqrt(len(values))
        assert abs(np.mean(values) - truth[name]) <= 3 * sem, (name, np.mean(values), sem)


# Hoffmann et al. (2022), approach 3: L(N, D) = E + A / N^alpha + B / D^beta, and with D = C / (6N) (the 6ND rule)
HE, HA, HB, HALPHA, HBETA = 1.69, 406.4, 410.7, 0.34, 0.28


def hoffmann(n, c):
    n = np.asarray(n, dtype=float)
    return HE + HA / n ** HALPHA + HB / (np.asarray(c, dtype=float) / (6 * n)) ** HBETA


def test_the_iso_flop_procedure_on_hoffmanns_law_recovers_its_exponents():
    """dL/dN = 0 at fixed C: alpha A N^-alpha = beta B (6N/C)^beta, so
        N_opt(C) = G (C/6)^(beta / (alpha + beta)),  G = (alpha A / (beta B))^(1 / (alpha + beta))
    and, writing N = N_opt e^u, L - E = K(C) g(u) with g(u) = e^(-alpha u) / alpha + e^(beta u) / beta and
    K(C) = alpha A N_opt^-alpha ~ C^(-alpha beta / (alpha + beta)). Every profile has the same shape in u, only
    scaled: a parabola fitted on the same u-grid puts its vertex at the same u_v at every budget, so the fitted
    exponent is beta / (alpha + beta) exactly (the prefactor is off by e^u_v), and the fitted minima give the
    frontier E + K' C^-(alpha beta / (alpha + beta)) exactly."""
    a_true = HBETA / (HALPHA + HBETA)  # 0.4516
    frontier_alpha = HALPHA * HBETA / (HALPHA + HBETA)  # 0.1535
    g_pref = (HALPHA * HA / (HBETA * HB)) ** (1 / (HALPHA + HBETA))
    budgets = np.logspace(18, 22, 5)  # Chinchilla's range: 1e18 to 1e22 FLOPs
    grid = np.linspace(-1.5, 1.5, 7)  # sizes e^-1.5 .. e^1.5 around each budget's optimum
    n = np.concatenate([g_pref * (c / 6) ** a_true * np.exp(grid) for c in budgets])
    c = np.repeat(budgets, len(grid))
    fit = fit_scaling(n, c, hoffmann(n, c), n_boot=0)
    assert fit.n_opt_law.a == pytest.approx(a_true, rel=EXACT)
    assert fit.frontier.alpha == pytest.approx(frontier_alpha, rel=EXACT) and fit.frontier.E == pytest.approx(HE, rel=EXACT)

    # A fixed ladder, as a sweep runs it: sizes 0.1 apart in ln N, the 31 nearest each budget's lowest loss.
    # The window then sits up to s/2 = 0.05 off the optimum, which moves the vertex by some du in [du-, du+]
    # (computed below from g); the exponent's error is at most that spread times sum|ln C - mean| / sum (ln C - mean)^2.
    ladder = np.exp(np.arange(math.log(1e7), math.log(1e11), 0.1))
    pts = []
    for b in budgets:
        loss = hoffmann(ladder, b)
        i = int(np.argmin(loss))
        pts += [(m, b, v) for m, v in zip(ladder[max(i - 15, 0):i + 16], loss[max(i - 15, 0):i + 16])]
    fit = fit_scaling(*zip(*pts), n_boot=0)

    def vertex(offset):
        u = offset + 0.1 * np.arange(-15, 16)
        g = np.exp(-HALPHA * u) / HALPHA + np.exp(HBETA * u) / HBETA
        return math.log(fit_profile(1.0, np.exp(u), g).n_opt)

    shifts = [vertex(o) for o in np.linspace(-0.05, 0.05, 11)]
    lc = np.log(budgets) - np.log(budgets).mean()
    bound = (max(shifts) - min(shifts)) * np.abs(lc).sum() / (lc ** 2).sum()
    assert abs(fit.n_opt_law.a - a_true) <= bound, (fit.n_opt_law.a, a_true, bound)
    assert bound < 0.01  # the bound itself says "to two decimals"


def test_compute_multiplier_is_the_inverse_frontier_ratio():
    """Two mixers on laws with the same floor and exponent: the one with A_m needs (A_m / A_b)^(1/alpha) times the
    baseline's compute at every budget; a third whose floor lies above the baseline's loss never reaches it."""
    def points(e, a_coef):
        n, c, loss = synthetic()
        return n, c, loss - (E + A * c ** -ALPHA) + (e + a_coef * c ** -ALPHA)

    fits = {"base": fit_scaling(*points(E, A), n_boot=30), "better": fit_scaling(*points(E, 0.8 * A), n_boot=30),
            "floor": fit_scaling(*points(3.5, A), n_boot=30)}
    rows = compute_multipliers(fits, "base")
    assert [r.budget for r in rows if r.mixer == "base"] == BUDGETS.tolist()
    assert all(r.value == pytest.approx(1.0, rel=EXACT) for r in rows if r.mixer == "base")
    better = [r for r in rows if r.mixer == "better"]
    assert [r.value for r in better] == pytest.approx([0.8 ** (1 / ALPHA)] * len(BUDGETS), rel=EXACT)
    assert better[0].extrapolated and not better[-1].extrapolated  # 0.23 x 1e11 is below its budgets
    assert better[0].problem.startswith("the compute it needs") and not better[-1].problem  # not a result outside
    assert all(r.value == math.inf for r in rows if r.mixer == "floor")
    assert compute_multipliers({"x": fit_scaling([1, 2], [1, 1], [3, 3])}, "x") == []
    assert PowerLaw(2.0, 1.0, 0.5).inverse(2.0) == math.inf


def test_a_fit_outside_its_physical_range_does_not_hold_and_says_why():
    """Issue 47 item 6: a fit is a result only inside its physical range; each kind of fit says why not."""
    sizes = [1e4, 3e4, 1e5]
    inside, outside = fit_profile(1e12, sizes, [3.2, 3.0, 3.3]), fit_profile(1e12, sizes, [3.0, 3.2, 3.5])
    opens_down = fit_profile(1e12, sizes, [3.0, 3.3, 3.1])
    assert inside.problem == "" and outside.n_opt < 1e4 and opens_down.n_opt is None
    assert outside.problem == f"its minimum N = {outside.n_opt:,.0f} lies outside the sizes run (10,000-100,000)"
    assert opens_down.problem == "no minimum (the parabola opens downward)"

    def fit(frontier=PowerLaw(1.8, 50.0, 0.2), law=Exponent(0.1, 0.5), **intervals):
        return ScalingFit([], frontier, law, intervals=intervals)

    assert fit(E=(1.7, 1.9), A=(40.0, 60.0), alpha=(0.15, 0.25), a=(0.4, 0.6)).frontier_problem == ""
    assert fit().n_opt_problem == ""
    assert fit(PowerLaw(-0.5, 50.0, 0.2)).frontier_problem == "E = -0.5 < 0: a loss has no negative floor"
    assert fit(PowerLaw(1.8, 50.0, 3.0)).frontier_problem.startswith("alpha = 3 is at the end of its search range")
    assert fit(E=(-446.0, 2.566)).frontier_problem == "its 95% interval [-446, 2.566] is wider than E = 1.8"
    assert fit(A=(43.0, 2.1e8)).frontier_problem == "its 95% interval [43, 2.1e+08] is wider than A = 50"
    assert fit(law=Exponent(0.1, 1.07)).n_opt_problem.startswith("a = 1.07 lies outside (0, 1)")
    assert fit(a=(0.25, 0.875)).n_opt_problem == "its 95% interval [0.25, 0.875] is wider than a = 0.5"
    assert fit(None, None).frontier_problem == fit(None, None).n_opt_problem == ""  # no fit: nothing to judge
    # the report: no value of a fit that does not hold, its status cell says why; its curve drawn dashed
    from attnzoo.analysis.report.scaling import Study, charts, tables

    good = fit_scaling(*synthetic(), n_boot=0)
    bad = ScalingFit([outside, *good.profiles[1:]], PowerLaw(-0.5, 50.0, 0.2), Exponent(0.1, 1.07))
    study = Study({"bad": bad, "good": good}, {}, "good", compute_multipliers({"bad": bad, "good": good}, "good"))
    (laws, _, head, rows), (minima, _, mhead, mrows), _ = tables(study)
    row = dict(zip(head, rows[0]))
    assert row["E"] == row["A"] == row["alpha"] == row["a (N_opt ~ C^a)"] == ("", None)
    assert row["L_opt(C) law"][0] == "does not hold: E = -0.5 < 0: a loss has no negative floor"
    assert row["N_opt(C) law"][0].startswith("does not hold: a = 1.07")
    assert dict(zip(head, rows[1]))["L_opt(C) law"] == ("holds", None)
    first = dict(zip(mhead, mrows[0]))
    assert first["N_opt"] == first["L_opt"] == ("", None) and first["minimum"][0] == f"does not hold: {outside.problem}"
    styles = {c.name: {(s.name, s.style) for p in c.panels for s in p.series if s.style in ("fit", "void")}
              for c in charts(study)}
    assert styles["frontier"] == styles["n_opt"] == {("bad", "void"), ("good", "fit")}
    assert ("C=1e12", "void") in styles["isoflop"]


# ----------------------------------------------------------------------------- the report's scaling section


def fabricated_sweep(root, laws: dict[str, float]):
    """The files attnzoo-train writes for a budget sweep (no training): per mixer (its A on the synthetic law),
    budget and ladder size, a job stopped by its FLOP budget; one more stopped by max_steps before its budget."""
    import json

    jobs = [(mixer, c, i, False) for mixer in laws for c in BUDGETS for i in range(len(LADDER))]
    jobs.append(("gqa", BUDGETS[0], 0, True))
    for k, (mixer, c, i, short) in enumerate(jobs):
        n = float(LADDER[i])
        job = root / str(k)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(
            f"- +sweeps=scaling\n- trainer.max_flops={c}\n- model.pattern=[{mixer}]\n- model.n_layers={2 * i + 2}\n")
        loss = E + laws[mixer] * c ** -ALPHA + CURV * (math.log(n) - math.log(K * c ** A_EXP)) ** 2
        length = {"max_flops": c, "flops": c / 2 if short else c * 1.001, "limit": "trainer.max_steps" if short
                  else "trainer.max_flops"}
        (job / "summary.json").write_text(json.dumps({
            "status": "ok", "metrics": {"val/loss": loss + (0.5 if short else 0), "params/non_embedding": n,
                                        "params/total": n + 5000}, "length": length,
            "model": {"mixers": [mixer]}, "config": {"optim": {"lr": 3e-3}}}))
    return root


def test_the_report_shows_the_fits_of_a_budget_sweep(tmp_path):
    from attnzoo.analysis.report import build_report
    from tests.test_report_html import plotly_figures

    d = fabricated_sweep(tmp_path / "sweep", {"gqa": A, "gdn": 0.8 * A})
    rep = build_report(d)
    study = rep["scaling"]
    assert list(study.fits) == ["gdn", "gqa"] and study.baseline == "gqa"
    assert study.left_out == [f"job {len(BUDGETS) * len(LADDER) * 2} (trainer.max_flops=1e11 model.pattern=[gqa] "
                              "model.n_layers=2): stopped by trainer.max_steps before its budget"]  # as written
    for mixer, a_coef in (("gqa", A), ("gdn", 0.8 * A)):
        fit = study.fits[mixer]
        assert (fit.frontier.E, fit.frontier.A, fit.frontier.alpha) == pytest.approx((E, a_coef, ALPHA), rel=EXACT)
        assert fit.n_opt_law.a == pytest.approx(A_EXP, rel=EXACT)
    md = (d / "report.md").read_text()
    section = md.split("## Scaling (iso-FLOP sweep)")[1].split("## All jobs")[0]
    laws = [line for line in section.splitlines() if line.startswith("| gdn |") or line.startswith("| gqa |")]
    assert len(laws) == 2 + 2 * len(BUDGETS) + 2 * len(BUDGETS)  # laws, minima, multipliers
    assert f"| gqa | {len(BUDGETS)} / {len(BUDGETS)} | {E:.4g} [" in section and f"{ALPHA:.4g} [" in section
    mult = [r for r in study.multipliers if r.mixer == "gdn"]
    assert [r.value for r in mult] == pytest.approx([0.8 ** (1 / ALPHA)] * len(BUDGETS), rel=EXACT)
    assert "| gdn | 1e13 | " in section and f"{0.8 ** (1 / ALPHA):.4g}" in section
    # the charts: points and fitted lines on log axes, as PNGs and Plotly figures; no per-job cache / tokens/s charts
    assert {"isoflop.png", "frontier.png", "n_opt.png"} <= {p.name for p in (d / "plots").iterdir()}
    assert not (d / "plots" / "acc_vs_cache.png").exists() and not (d / "plots" / "tokens_per_sec.png").exists()
    figs = plotly_figures((d / "report.html").read_text())
    iso = figs["chart-isoflop"]
    assert iso["layout"]["xaxis"]["type"] == "log" and {t["mode"] for t in iso["data"]} == {"markers", "lines"}
    assert figs["chart-n_opt"]["layout"]["yaxis"]["type"] == "log"
    # tick labels on both log axes, each in one notation: parameters SI (10k, 1M; not '60,256' beside '463.25Ki'),
    # FLOPs scientific (1e11)
    for chart, axis, notation in (("isoflop", "xaxis", r"[\d.]+[kM]"), ("n_opt", "yaxis", r"[\d.]+[kM]"),
                                  ("n_opt", "xaxis", r"[\d.]+e\d+"), ("frontier", "xaxis", r"[\d.]+e\d+")):
        texts = figs[f"chart-{chart}"]["layout"][axis]["ticktext"]
        assert len(texts) >= 2 and all(re.fullmatch(notation, t) for t in texts), (chart, axis, texts)
    fitted = [t for t in figs["chart-frontier"]["data"] if t["mode"] == "lines" and t["name"] == "gqa"]
    assert fitted and np.allclose(fitted[0]["y"], study.fits["gqa"].frontier(np.array(fitted[0]["x"])))
    assert {"table-scaling-0", "table-scaling-1", "table-scaling-2"} <= set(figs)
