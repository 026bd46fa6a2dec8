"""Seed replicates paired across recipes (the ranking protocol, docs/results.md): per recipe, its gap to the baseline
recipe in % of the baseline, the mean of the per-seed paired gaps ± s.d./√n; the share of the reference recipe's gap
it closes, the ratio of the mean paired differences ± its delta-method standard error; and its gap estimated through
the reference (the reference's gap over all its seeds plus the recipe's difference to it over the recipe's seeds),
which needs fewer seeds of the recipe where it moves with the reference seed by seed, and fewer of the baseline where
the baseline's seeds spread less (the reference's seeds without a baseline run correct its mean). Runs of the same
seed share initialisation and data order, so each difference is taken within a seed before averaging over seeds."""

from __future__ import annotations

import math
import re
import statistics

#: an arm named "<recipe>_seed<N>" is replicate N of <recipe> (the first replicate has the bare name)
_REPLICATE = re.compile(r"^(?P<recipe>.+)_seed(?P<n>[0-9]+)$")


def recipe_of(name: str) -> str:
    """The recipe an arm is a replicate of: its name without a "_seedN" suffix."""
    m = _REPLICATE.match(name)
    return m["recipe"] if m else name


def replicate_name(recipe: str, index: int) -> str:
    """The arm name of replicate ``index`` (0-based) of ``recipe``: the bare name, then "_seed2", "_seed3", ..."""
    return recipe if index == 0 else f"{recipe}_seed{index + 1}"


def final_validations(validation: dict[int, float], steps: list[int]) -> float | None:
    """The statistic of one run: the mean of its validation losses at ``steps`` (the protocol's last validations),
    None when it lacks one of them (a killed run's last validation: an earlier one would pair with other arms' later
    ones) or one is not finite."""
    if not steps or any(s not in validation for s in steps):
        return None
    value = statistics.fmean(validation[s] for s in steps)
    return value if math.isfinite(value) else None


def _gap_pct(run: dict, base: dict, seed: int) -> float:
    """A run's gap to the baseline at one seed, in % of the baseline."""
    return 100.0 * (run[seed] - base[seed]) / base[seed]


def _mean_sd_se(values: list[float]) -> tuple[float, float, float]:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan"), float("nan")
    sd = statistics.stdev(values)
    return mean, sd, sd / math.sqrt(len(values))


def paired_rows(stats: dict[str, dict[int, float]], baseline: str, reference: str = "") -> list[dict]:
    """One row per recipe but the baseline, from ``stats`` = {recipe: {seed: statistic}}:

    - ``gap_pct`` ± ``gap_se_pct`` (s.d. ``gap_sd_pct``) over the ``n`` seeds it shares with the baseline: the mean of
      100·(R_s − B_s)/B_s, with standard error s.d./√n;
    - with a ``reference`` recipe P, for the other recipes, over the ``closed_n`` seeds all three share:
      ``closed_pct`` = 100·ā/b̄ with a_s = P_s − R_s, b_s = P_s − B_s (the share of P's gap that R closes: 0 = no
      better than P, 100 = as good as the baseline), ± ``closed_se_pct`` = 100·s.d.(a_s − r·b_s)/(√n·|b̄|), the
      delta-method standard error of a ratio of paired means (NaN with fewer than two seeds or b̄ = 0);
    - with a reference, for the other recipes, ``diff_pct`` ± ``diff_se_pct`` (s.d. ``diff_sd_pct``): the mean of
      d_s = g_R,s − g_P,s, the recipe's paired difference to the reference, over the seeds all three share;
    - with a reference, for the other recipes, ``via_gap_pct`` ± ``via_se_pct``: the gap through the reference
      (``_through_reference``) over ``via_n`` of the recipe's seeds and ``via_ref_n`` of the reference's; on the
      reference's own row, when it ran seeds the baseline did not, its gap over all of them (``_reference_gap``) over
      ``via_n`` paired seeds and ``via_ref_n`` in all."""
    base = stats[baseline]
    ref = stats.get(reference, {}) if reference else {}
    ref_gap = _reference_gap(ref, base) if any(s in base for s in ref) else None
    rows = []
    for recipe, by_seed in stats.items():
        if recipe == baseline:
            continue
        seeds = sorted(s for s in by_seed if s in base)
        row: dict = {"recipe": recipe, "n": len(seeds), "seeds": seeds}
        if seeds:
            row["gap_pct"], row["gap_sd_pct"], row["gap_se_pct"] = _mean_sd_se(
                [_gap_pct(by_seed, base, s) for s in seeds])
        shared = sorted(s for s in seeds if s in ref)
        if recipe == reference and seeds and len(by_seed) > len(seeds):  # seeds without a baseline run
            row.update(via_n=ref_gap["n"], via_ref_n=ref_gap["m"], via_gap_pct=ref_gap["gap"],
                       via_se_pct=math.sqrt(ref_gap["var"]) if ref_gap["var"] == ref_gap["var"] else float("nan"))
        if reference and recipe != reference and shared:
            row.update(_through_reference(by_seed, ref_gap, base, shared))
            a = [ref[s] - by_seed[s] for s in shared]
            b = [ref[s] - base[s] for s in shared]
            b_mean = statistics.fmean(b)
            r = statistics.fmean(a) / b_mean if b_mean else float("nan")
            se = (statistics.stdev([x - r * y for x, y in zip(a, b)]) / (math.sqrt(len(shared)) * abs(b_mean))
                  if len(shared) > 1 and b_mean else float("nan"))
            row.update(closed_n=len(shared), closed_pct=100.0 * r, closed_se_pct=100.0 * se)
        rows.append(row)
    return rows


def _reference_gap(p: dict, b: dict) -> dict:
    """P's gap to B over all of P's seeds, those without a B run included: ĝ_P = ḡ + c, ḡ the mean of
    g_s = 100·(P_s − B_s)/B_s over the n seeds both ran, c = k·(P̄_E − P̄_S) with k = 100·(m − n)/(m·B̄_S) the
    correction of P's mean by its m − n extra seeds E (S: the paired ones; c = 0 when B ran every seed of P). Seeds
    are independent, so Var(ĝ_P) = s_g²/n + k²·s_P²·(1/(m − n) + 1/n) − 2k·s_gP/n (s_P over P's m seeds, s_gP over
    S), floored at k²·s_P²/(m − n), the extra seeds' share (an estimate can fall below it with few seeds). Returns
    the estimate's parts for _through_reference and the reference's own row."""
    paired = sorted(s for s in p if s in b)
    extra = sorted(s for s in p if s not in b)
    n, m = len(paired), len(paired) + len(extra)
    g = {s: _gap_pct(p, b, s) for s in paired}
    b_mean = statistics.fmean(b[s] for s in paired)
    k = 100.0 * (m - n) / (m * b_mean)
    c = k * (statistics.fmean(p[s] for s in extra) - statistics.fmean(p[s] for s in paired)) if extra else 0.0
    out = {"p": p, "g": g, "k": k, "n": n, "m": m, "gap": statistics.fmean(g.values()) + c, "var": float("nan")}
    if n >= 2:
        var = statistics.variance(g.values()) / n
        if extra:
            var_p = statistics.variance([p[s] for s in paired + extra])
            var += (k * k * var_p * (1.0 / (m - n) + 1.0 / n)
                    - 2.0 * k * statistics.covariance([g[s] for s in paired], [p[s] for s in paired]) / n)
            var = max(var, k * k * var_p / (m - n))  # at least the extra seeds' own share, which S cannot cancel
        out["var"] = var
    return out


def _through_reference(r: dict, ref: dict, b: dict, shared: list) -> dict:
    """R's gap to B through P: ĝ_R = ĝ_P (``ref``, _reference_gap: P's gap over all its seeds) + mean of
    d = g_R − g_P over R's n_R seeds shared with both (a subset of the n seeds P and B share). Seeds are independent, so
    Var(ĝ_R) = Var(ĝ_P) + Var(d)/n_R + 2·Cov(g_P, d)/n − 2k·Cov(P, d)/n (the covariances over the n_R seeds; the
    last term is the correction's, zero when B ran every seed of P), floored at Var(d)/n_R; with n_R = n = m it is
    the direct paired gap."""
    g_p, n, k, p = ref["g"], ref["n"], ref["k"], ref["p"]
    d = [_gap_pct(r, b, s) - g_p[s] for s in shared]
    n_r = len(shared)
    out = {"via_n": n_r, "via_ref_n": ref["m"], "via_gap_pct": ref["gap"] + statistics.fmean(d)}
    out["diff_pct"], out["diff_sd_pct"], out["diff_se_pct"] = _mean_sd_se(d)  # d's s.d. sets the seeds R needs
    if n_r < 2 or n < 2:
        out["via_se_pct"] = float("nan")
        return out
    var_d = statistics.variance(d)
    cov = statistics.covariance([g_p[s] for s in shared], d) / n
    if k:
        cov -= k * statistics.covariance([p[s] for s in shared], d) / n
    out["via_se_pct"] = math.sqrt(max(ref["var"] + var_d / n_r + 2.0 * cov, var_d / n_r))
    return out


#: Student's t at 0.95 (a two-sided 90% test) for 1-30 degrees of freedom (tests check them by integrating the density)
_T95 = (6.3138, 2.9200, 2.3534, 2.1318, 2.0150, 1.9432, 1.8946, 1.8595, 1.8331, 1.8125, 1.7959, 1.7823, 1.7709,
        1.7613, 1.7531, 1.7459, 1.7396, 1.7341, 1.7291, 1.7247, 1.7207, 1.7171, 1.7139, 1.7109, 1.7081, 1.7056,
        1.7033, 1.7011, 1.6991, 1.6973)


def t95(df: int) -> float:
    """The two-sided 90% critical value of Student's t with ``df`` degrees of freedom (beyond 30, its Cornish-Fisher
    expansion around the normal's 1.6449, within 10⁻⁴)."""
    if df < 1:
        raise ValueError(f"t95: degrees of freedom must be at least 1, got {df}")
    if df <= len(_T95):
        return _T95[df - 1]
    z = 1.6448536
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df * df)


def pairwise_rows(stats: dict[str, dict[int, float]], baseline: str) -> list[dict]:
    """Every two recipes but the baseline, on the ``n`` seeds both share with the baseline (at least two): the mean of
    the per-seed difference of their gaps, g_A,s − g_B,s (in points of the baseline), ± s.d./√n; ``above`` names the
    recipe with the lower loss when the difference exceeds t95(n − 1) standard errors (the protocol's decision rule:
    about twice at its 6 seeds, far more at 2, where twice would call a winner by chance one time in three)."""
    base = stats[baseline]
    recipes = [r for r in stats if r != baseline]
    rows = []
    for i, a in enumerate(recipes):
        for b in recipes[i + 1:]:
            seeds = sorted(s for s in stats[a] if s in stats[b] and s in base)
            if len(seeds) < 2:
                continue
            diff, sd, se = _mean_sd_se([_gap_pct(stats[a], base, s) - _gap_pct(stats[b], base, s) for s in seeds])
            rows.append({"a": a, "b": b, "n": len(seeds), "diff_pct": diff, "diff_sd_pct": sd, "diff_se_pct": se,
                         "above": (b if diff > 0 else a) if abs(diff) > t95(len(seeds) - 1) * se else ""})
    return rows


def pairwise_markdown(rows: list[dict], baseline: str) -> str:
    """The pairwise table of ``pairwise_rows`` ("" when no two recipes share two seeds with the baseline)."""
    if not rows:
        return ""
    head = (f"Recipe against recipe, paired by seed (gap of the first minus gap of the second, in % of {baseline}, "
            f"mean ± s.d./√n over the seeds both ran with {baseline}; a recipe ranks above the other beyond a "
            "two-sided 90% t test, 2.02 standard errors at 6 seeds):\n\n"
            "| recipes | seeds | difference, % ± s.e. | s.d., % | ranks above |\n"
            "| --- | ---: | ---: | ---: | --- |\n")
    return head + "".join(
        f"| {r['a']} − {r['b']} | {r['n']} | {r['diff_pct']:+.2f} ± {r['diff_se_pct']:.2f} | {r['diff_sd_pct']:.2f} | "
        f"{r['above'] or '–'} |\n" for r in rows)


def _pm(value: float, se: float, fmt: str, se_fmt: str) -> str:
    return f"{value:{fmt}}" + ("" if se != se else f" ± {se:{se_fmt}}")


def paired_markdown(rows: list[dict], baseline: str, reference: str, statistic: str) -> str:
    """The paired table: recipe, seeds, gap to the baseline in % ± s.e. (and its s.d.), share of the reference's gap
    closed ± s.e., the gap through the reference ± s.e. (seeds of the recipe / of the reference), and the recipe's
    difference to the reference, recipe minus reference, ± s.e. (s.d.: what sets the seeds a recipe needs)."""
    head = (f"Paired by seed against {baseline} ({statistic}; per seed the gap in % of {baseline}, then the mean ± "
            "s.d./√n over seeds" + (f"; the share of {reference}'s gap closed, paired on the same seeds; the gap "
                                    f"through {reference}: its gap over all its seeds plus the recipe's difference to "
                                    f"it over the recipe's; the difference to {reference}: the recipe's gap minus "
                                    f"{reference}'s, seed by seed" if reference else "") + "):\n\n"
            f"| recipe | seeds | gap to {baseline}, % ± s.e. | s.d. of the per-seed gaps, % |"
            + (f" share of {reference}'s gap closed, % ± s.e. | gap through {reference}, % ± s.e. (seeds) |"
               f" difference to {reference}, % ± s.e. (s.d.) |" if reference else "")
            + "\n| --- | ---: | ---: | ---: |" + (" ---: | ---: | ---: |" if reference else "") + "\n")
    body = ""
    for r in rows:
        if not r["n"]:
            gap, sd = "(no seed shared)", ""
        else:
            gap, sd = _pm(r["gap_pct"], r["gap_se_pct"], "+.2f", ".2f"), ("" if r["gap_sd_pct"] != r["gap_sd_pct"]
                                                                    else f"{r['gap_sd_pct']:.2f}")
        extra = ""
        if reference:
            closed = ("(reference)" if r["recipe"] == reference else
                      _pm(r["closed_pct"], r["closed_se_pct"], ".0f", ".0f") + (f" (n={r['closed_n']})"
                                                                          if r["closed_n"] != r["n"] else "")
                      if "closed_pct" in r else "")
            via = ("" if "via_gap_pct" not in r else _pm(r["via_gap_pct"], r["via_se_pct"], "+.2f", ".2f")
                   + f" ({r['via_n']} / {r['via_ref_n']})")
            diff = ("" if "diff_pct" not in r else _pm(r["diff_pct"], r["diff_se_pct"], "+.2f", ".2f")
                    + ("" if r["diff_sd_pct"] != r["diff_sd_pct"] else f" ({r['diff_sd_pct']:.2f})"))
            extra = f" {closed} | {via} | {diff} |"
        body += f"| {r['recipe']} | {r['n']} | {gap} | {sd} |{extra}\n"
    return head + body


def seeds_for(sd: float, target: float) -> int:
    """The seeds a mean of per-seed values spreading by ``sd`` needs for a standard error of at most ``target``:
    ⌈(sd/target)²⌉, at least 2 (one seed gives no spread)."""
    if not target > 0:
        raise ValueError(f"seeds_for: the target standard error must be positive, got {target!r}")
    return max(2, math.ceil((sd / target) ** 2 - 1e-9))


def target_markdown(rows: list[dict], target: float) -> str:
    """The line under the paired table for ``[compare] target_se``: each recipe's gap standard error (through the
    reference where the table gives one, else the direct paired gap's) against ``target``, and while above it the
    seeds its direct paired gap needs at the spread seen so far (``seeds_for``: an estimate from few seeds)."""
    parts = []
    for r in rows:
        if r["n"] < 2:
            parts.append(f"{r['recipe']} no spread yet ({r['n']} seed{'s' * (r['n'] != 1)} paired)")
            continue
        via = r.get("via_se_pct", float("nan"))
        se, how = (via, "through the reference") if via == via else (r["gap_se_pct"], "direct")
        verdict = "met" if se <= target else (f"the direct paired gap needs about {seeds_for(r['gap_sd_pct'], target)} "
                                              f"seeds at its s.d. of {r['gap_sd_pct']:.2f} (has {r['n']})")
        parts.append(f"{r['recipe']} {se:.2f} ({how}): {verdict}")
    return (f"Standard error of each gap against the target of {target:.2f} points ([compare] target_se): "
            + "; ".join(parts) + ".\n")
