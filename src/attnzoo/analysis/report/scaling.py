"""The report's scaling section, for a sweep of compute budgets (jobs stopped by `trainer.max_flops`, e.g.
sweeps/scaling.yaml): per mixer the iso-FLOP profiles, the frontier L(C) = E + A C^-alpha and N_opt ~ C^a
(attnzoo/analysis/scaling.py), as charts of points and fitted lines on log axes and as three tables.

A point is one finished job stopped by its FLOP budget: N its non-embedding parameters (`params/non_embedding`;
`params/total` for runs that predate it), C its budget, L its final `val/loss`. A job stopped earlier (by
trainer.max_steps) trained on less than its budget and is left out, named. The mixer of a point is what the job's
swept overrides name once its budget, its size (the ladder's keys below), learning rate and seed are set aside:
`model.pattern=[gdn,attn]` is "gdn,attn". Several learning rates at one point: the best one (its mean over seeds).
The compute multipliers compare every mixer with gqa when it is in the sweep, else with the first mixer.
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from attnzoo.analysis.report.charts import Chart, Panel, Series, sort_key, tick_text
from attnzoo.analysis.report.load import finite, mean_std
from attnzoo.analysis.report.tables import Cell, _markdown, fmt
from attnzoo.analysis.scaling import Multiplier, ScalingFit, compute_multipliers, fit_scaling

BUDGET_KEY = "trainer.max_flops"
SIZE_KEYS = ("model.n_layers", "model.d_model", "model.n_heads", "model.n_kv_heads", "model.head_dim", "model.ffn.d_ff")
MIXER_KEYS = ("model.pattern", "model/mixer")
_SET_ASIDE = (BUDGET_KEY, *SIZE_KEYS, "optim.lr", "seed")
BOOTSTRAP = 1000
LEVEL = 0.95


@dataclass
class Study:
    fits: dict[str, ScalingFit]  # mixer -> its fits
    points: dict[str, list[dict]]  # mixer -> [{n, c, loss, job, lrs, seeds}]
    baseline: Optional[str]
    multipliers: list[Multiplier]
    left_out: list[str] = field(default_factory=list)  # "job 3 (overrides): why"


def _key(o: str) -> str:
    return o.split("=", 1)[0].lstrip("+~")


def mixer_label(j: dict) -> str:
    rest = [o for o in j.get("variant_overrides", []) if _key(o) not in _SET_ASIDE]
    named = [o.split("=", 1)[1].strip("[]").replace(" ", "") if _key(o) in MIXER_KEYS
             else f"{_key(o).rsplit('.', 1)[-1]}={o.split('=', 1)[1]}" for o in rest]
    return " ".join(named) or j["mixer"]


def study(jobs: list[dict], baseline: str = "gqa") -> Optional[Study]:
    """The scaling study of a sweep's jobs; None when no job had a FLOP budget. `baseline`: the mixer (label) the
    compute multipliers are measured against (the first mixer when the sweep has no such label)."""
    budgeted = [j for j in jobs if ((j["summary"].get("length") or {}).get("max_flops") is not None
                                    or any(_key(o) == BUDGET_KEY for o in j["overrides"]))]
    if not budgeted:
        return None
    grouped: dict[tuple, list[dict]] = {}
    left_out = []
    for j in budgeted:
        length, m = j["summary"].get("length") or {}, j["metrics"]
        n = m.get("params/non_embedding", m.get("params/total"))
        spent, budget = length.get("flops"), length.get("max_flops")
        why = ("not finished" if j["status"] != "ok" else "no val/loss" if not finite(m.get("val/loss"))
               else f"stopped by {length.get('limit')} before its budget" if not (finite(spent) and spent >= budget)
               else "no parameter count" if not finite(n) else "")
        if why:
            left_out.append(f"job {j['job']} ({j['label']}): {why}")
            continue
        grouped.setdefault((mixer_label(j), float(length["max_flops"]), float(n)), []).append(j)
    points: dict[str, list[dict]] = {}
    for (mixer, c, n), runs in grouped.items():
        by_lr: dict[str, list[float]] = {}
        for r in runs:
            by_lr.setdefault(str(r["lr"]), []).append(r["metrics"]["val/loss"])
        lr, losses = min(by_lr.items(), key=lambda kv: mean_std(kv[1])[0])
        best = min((r for r in runs if str(r["lr"]) == lr), key=lambda r: r["metrics"]["val/loss"])
        points.setdefault(mixer, []).append({"n": n, "c": c, "loss": mean_std(losses)[0], "job": best["job"],
                                             "lrs": len(by_lr), "seeds": len(losses)})
    mixers = sorted(points, key=sort_key)
    fits = {m: fit_scaling([p["n"] for p in points[m]], [p["c"] for p in points[m]], [p["loss"] for p in points[m]],
                           n_boot=BOOTSTRAP, level=LEVEL) for m in mixers}
    baseline = baseline if baseline in fits else (mixers[0] if mixers else None)
    multipliers = compute_multipliers(fits, baseline, LEVEL) if baseline else []
    return Study(fits, {m: points[m] for m in mixers}, baseline, multipliers, left_out)


# ----------------------------------------------------------------------------- charts


def _budget_name(c: float) -> str:
    return f"C={tick_text(c, 'sci')}"


def _span(lo: float, hi: float, pad: float = 1.25, n: int = 60) -> np.ndarray:
    return np.exp(np.linspace(math.log(lo / pad), math.log(hi * pad), n))


def _fitted(name: str, xs: np.ndarray, ys, text: str, problem: str) -> Series:
    """A fitted curve: a line, dashed when the fit does not hold (its hover says why)."""
    return Series(name, xs.tolist(), list(ys), style="void" if problem else "fit",
                  hover=[f"{text}: does not hold: {problem}" if problem else text] * len(xs))


VOID_NOTE = "; dashed: a fit that does not hold"


def charts(s: Study) -> list[Chart]:
    """iso-FLOP profiles (a panel per mixer), the frontier and N_opt(C) (a line per mixer)."""
    out = []
    panels = []
    for mixer, fit in s.fits.items():
        series = []
        for p in fit.profiles:
            name = _budget_name(p.budget)
            series.append(Series(name, list(p.n), list(p.loss), style="points", hover=[
                f"{mixer}, {name}: N={fmt(n)}, val/loss={fmt(v)}" for n, v in zip(p.n, p.loss)]))
            xs = _span(min(p.n), max(p.n), pad=1.1)
            series.append(_fitted(name, xs, p.at(xs), f"{mixer}, {name}: parabola in ln N" + (
                f", minimum N_opt={fmt(p.n_opt)}" if p.usable else ""), p.problem))
            if p.usable:
                series.append(Series(name, [p.n_opt], [p.loss_opt], style="optimum",
                                     hover=[f"{mixer}, {name}: N_opt={fmt(p.n_opt)}, L_opt={fmt(p.loss_opt)}"]))
        if series:
            panels.append(Panel(mixer, series))
    if panels:
        void = any(p.problem for f in s.fits.values() for p in f.profiles)
        out.append(Chart("isoflop", "iso-FLOP profiles: final val/loss vs parameters at each budget (circles: the "
                         "parabola's minimum" + (VOID_NOTE if void else "") + ")", "scatter", panels,
                         "non-embedding parameters N", "val/loss", "budget (training FLOPs)", xlog=10, xfmt="si"))
    frontier, n_opt = [], []
    for mixer, fit in s.fits.items():
        good = [p for p in fit.profiles if p.usable]
        if not good:
            continue
        cs = [p.budget for p in good]
        frontier.append(Series(mixer, cs, [p.loss_opt for p in good], style="points",
                               hover=[f"{mixer}: C={c:.3g}, L_opt={fmt(p.loss_opt)}" for c, p in zip(cs, good)]))
        n_opt.append(Series(mixer, cs, [p.n_opt for p in good], style="points",
                            hover=[f"{mixer}: C={c:.3g}, N_opt={fmt(p.n_opt)}" for c, p in zip(cs, good)]))
        xs = _span(min(cs), max(cs))
        if f := fit.frontier:
            frontier.append(_fitted(mixer, xs, f(xs), f"{mixer}: L = {f.E:.3f} + {f.A:.3g} C^-{f.alpha:.3f}",
                                    fit.frontier_problem))
        if e := fit.n_opt_law:
            n_opt.append(_fitted(mixer, xs, e(xs), f"{mixer}: N_opt = {e.k:.3g} C^{e.a:.3f}", fit.n_opt_problem))
    if any(len(f.x) >= 2 for f in frontier if f.style == "points"):  # a mixer with two minima or more
        void = [any(x.style == "void" for x in series) for series in (frontier, n_opt)]
        out.append(Chart("frontier", "compute frontier: the iso-FLOP minima L_opt(C) and L = E + A C^-alpha"
                         + (f" ({VOID_NOTE[2:]})" if void[0] else ""), "scatter", [Panel("all", frontier)],
                         "training FLOPs C", "val/loss at N_opt", "mixer", xlog=10, xfmt="sci"))
        out.append(Chart("n_opt", "compute-optimal size: N_opt(C) and N_opt = k C^a"
                         + (f" ({VOID_NOTE[2:]})" if void[1] else ""), "scatter", [Panel("all", n_opt)],
                         "training FLOPs C", "N_opt (non-embedding parameters)", "mixer", xlog=10, ylog=10, xfmt="sci",
                         yfmt="si"))
    return out


# ----------------------------------------------------------------------------- tables

HOLDS = "holds"


def _holds(problem: str) -> Cell:
    return (f"does not hold: {problem}" if problem else HOLDS), None


def _ci(value: Optional[float], interval: Optional[tuple[float, float]], problem: str = "") -> Cell:
    """A fitted value with its interval; blank when its fit does not hold (the fit's status cell says why)."""
    if value is None or problem:
        return "", None
    text = f"{value:.4g}" + (f" [{interval[0]:.4g}, {interval[1]:.4g}]" if interval else "")
    return text, value if finite(value) else None


def tables(s: Study) -> list[tuple[str, str, list[str], list[list[Cell]]]]:
    """(title, what it says, header, rows) of the laws, the iso-FLOP minima and the compute multipliers. A fit
    that does not hold shows no value: its status cell says "does not hold" and why (attnzoo.analysis.scaling)."""
    ci = f"{LEVEL:.0%}"
    laws = []
    for mixer, fit in s.fits.items():
        f, e, iv = fit.frontier, fit.n_opt_law, fit.intervals
        fp, ep = fit.frontier_problem, fit.n_opt_problem
        usable = sum(p.usable for p in fit.profiles)
        laws.append([(mixer, None), (f"{usable} / {len(fit.profiles)}", usable),
                     _ci(f and f.E, iv.get("E"), fp), _ci(f and f.A, iv.get("A"), fp),
                     _ci(f and f.alpha, iv.get("alpha"), fp), _holds(fp) if f else ("no frontier", None),
                     _ci(e and e.a, iv.get("a"), ep),
                     _ci(e and 1 - e.a, iv.get("a") and (1 - iv["a"][1], 1 - iv["a"][0]), ep),
                     _holds(ep) if e else ("no law", None),
                     (f"{len(fit.boot_frontiers)} / {len(fit.boot_frontiers) + fit.boot_dropped}"
                      if fit.boot_frontiers or fit.boot_dropped else "none", None)])
    minima = []
    for mixer, fit in s.fits.items():
        for p in fit.profiles:
            best = int(np.argmin(p.loss))
            minima.append([(mixer, None), (tick_text(p.budget, "sci"), p.budget), (str(len(p.n)), len(p.n)),
                           (fmt(p.n_opt), p.n_opt) if p.usable else ("", None), _ci(p.loss_opt, None, p.problem),
                           _holds(p.problem), (f"{fmt(p.n[best])}: {p.loss[best]:.4g}", p.loss[best])])
    mult = []
    for r in s.multipliers:
        note = "its fitted floor E is above this loss" if r.value == math.inf else ""
        mult.append([(r.mixer, None), (tick_text(r.budget, "sci"), r.budget), (f"{r.target_loss:.4g}", r.target_loss),
                     _ci(r.value, r.interval, r.problem), _holds(r.problem) if not note else (note, None)])
    return [
        ("Scaling laws per mixer", f"From the iso-FLOP minima inside their ladder: L_opt(C) = E + A C^-alpha and "
         f"N_opt(C) = k C^a (D_opt ~ C^(1-a) by the 6ND rule); [{ci} bootstrap intervals]; replicates: kept / drawn. "
         "A law holds when its parameters stay in their physical range: E >= 0, alpha inside its search range, "
         "0 < a < 1, and no interval wider than its value.",
         ["mixer", "budgets with a minimum", "E", "A", "alpha", "L_opt(C) law", "a (N_opt ~ C^a)", "1 - a (D_opt)",
          "N_opt(C) law", "replicates"], laws),
        ("Iso-FLOP minima", "The parabola in ln N at each budget: its minimum N_opt and L_opt when it has one inside "
         "the sizes run, and the best run observed (N: val/loss).",
         ["mixer", "budget C", "sizes", "N_opt", "L_opt", "minimum", "best run"], minima),
        (f"Compute multiplier vs {s.baseline}", f"The compute a mixer needs to reach {s.baseline}'s frontier loss at "
         f"budget C, as a multiple of C (below 1: it needs less) [{ci} bootstrap interval]; a result when that "
         "compute lies inside the mixer's budgets and the interval is narrower than the value.",
         ["mixer", "budget C", f"{s.baseline} loss", "multiplier", "multiplier holds"], mult),
    ]


def _verdicts(s: Study) -> str:
    """One line: how many fits of each kind do not hold (the tables say why)."""
    counts = [(sum(bool(p.problem) for f in s.fits.values() for p in f.profiles),
               sum(len(f.profiles) for f in s.fits.values()), "parabola minima"),
              (sum(bool(f.frontier_problem) for f in s.fits.values()), sum(bool(f.frontier) for f in s.fits.values()),
               "frontiers L_opt(C)"),
              (sum(bool(f.n_opt_problem) for f in s.fits.values()), sum(bool(f.n_opt_law) for f in s.fits.values()),
               "N_opt(C) laws"),
              (sum(bool(r.problem) for r in s.multipliers), len(s.multipliers), "compute multipliers")]
    bad = [f"{n} of {total} {what}" for n, total, what in counts if n]
    return ("Fits that do not hold (not results; the tables say why): " + ", ".join(bad) + ".") if bad else \
        "Every fit holds."


def markdown(s: Study) -> str:
    lines = ["## Scaling (iso-FLOP sweep)", "", _verdicts(s), ""]
    for title, what, head, rows in tables(s):
        lines += [f"### {title}", "", what, "", _markdown(head, [[t for t, _ in r] for r in rows]) if rows
                  else "(none: no mixer has a frontier)", ""]
    if s.left_out:
        lines += ["Left out of the fits:", ""] + [f"- {w}" for w in s.left_out] + [""]
    return "\n".join(lines) + "\n"


def html_section(s: Study, table_html) -> str:
    """The section's tables for report.html; `table_html(div_id, head, rows)` draws one (page.py)."""
    e = html.escape
    parts = ["<h2>Scaling (iso-FLOP sweep)</h2>", f"<p>{e(_verdicts(s))}</p>"]
    for i, (title, what, head, rows) in enumerate(tables(s)):
        parts += [f"<h3>{e(title)}</h3><p>{e(what)}</p>", table_html(f"table-scaling-{i}", head, rows) if rows
                  else "<p>(none: no mixer has a frontier)</p>"]
    if s.left_out:
        parts.append("<p>Left out of the fits:</p><ul>" + "".join(f"<li>{e(w)}</li>" for w in s.left_out) + "</ul>")
    return "\n".join(parts)
