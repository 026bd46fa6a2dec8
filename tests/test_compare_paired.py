"""Seed replicates in the comparison runner (an arm's ``seeds``) and its paired table, against a hand computation in
numpy float64; the ranking spec's table from the kept 386M logs, which docs/results.md shows; tools/seed_spread."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from titan_nvfp4 import compare
from titan_nvfp4.compare.paired import (final_validations, pairwise_markdown, pairwise_rows, paired_markdown,
                                        paired_rows, recipe_of, seeds_for, t95, target_markdown)
from titan_nvfp4.tools import seed_spread

REPO = Path(__file__).resolve().parents[1]
KEPT = REPO / "docs/results/pysources_2b"
BF16_JOB = REPO / "train_configs/llama3_2b_pysources_bf16.toml"  # [debug] seed = 42
NVFP4_JOB = REPO / "train_configs/llama3_2b_pysources_nvfp4.toml"

# the statistic (last validation) of each recipe at seeds 42, 43, 44, 45
STATS = {"bf16": [1.470, 1.465, 1.474, 1.468], "nvfp4": [1.487, 1.507, 1.521, 1.495],
         "better": [1.480, 1.490, 1.500, 1.483]}
SEEDS = [42, 43, 44, 45]


def _hand(r, base, ref):
    r, base, ref = (np.asarray(x, dtype=np.float64) for x in (r, base, ref))
    g = 100 * (r - base) / base
    a, b = ref - r, ref - base
    share = a.mean() / b.mean()
    se = np.std(a - share * b, ddof=1) / (np.sqrt(len(a)) * abs(b.mean()))
    return g.mean(), np.std(g, ddof=1), np.std(g, ddof=1) / np.sqrt(len(g)), 100 * share, 100 * se


def test_paired_rows_match_a_hand_computation():
    stats = {k: dict(zip(SEEDS, v)) for k, v in STATS.items()}
    rows = {r["recipe"]: r for r in paired_rows(stats, "bf16", "nvfp4")}
    mean, sd, se, share, share_se = _hand(STATS["better"], STATS["bf16"], STATS["nvfp4"])
    row = rows["better"]
    assert row["n"] == 4 and row["closed_n"] == 4
    assert row["gap_pct"] == pytest.approx(mean, rel=1e-12) and row["gap_sd_pct"] == pytest.approx(sd, rel=1e-12)
    assert row["gap_se_pct"] == pytest.approx(se, rel=1e-12)
    assert row["closed_pct"] == pytest.approx(share, rel=1e-12)
    assert row["closed_se_pct"] == pytest.approx(share_se, rel=1e-12)
    assert "closed_pct" not in rows["nvfp4"]  # the reference closes none of its own gap by definition
    # seeds are paired by value: a recipe missing seed 43 is compared on the other three only
    del stats["better"][43]
    row = {r["recipe"]: r for r in paired_rows(stats, "bf16", "nvfp4")}["better"]
    keep = [0, 2, 3]
    mean, sd, se, share, share_se = _hand(*([STATS[k][i] for i in keep] for k in ("better", "bf16", "nvfp4")))
    assert row["seeds"] == [42, 44, 45] and row["gap_pct"] == pytest.approx(mean, rel=1e-12)
    assert row["closed_se_pct"] == pytest.approx(share_se, rel=1e-12)


def test_the_gap_through_the_reference_matches_a_hand_computation_and_the_direct_gap_on_equal_seeds():
    stats = {k: dict(zip(SEEDS, v)) for k, v in STATS.items()}
    row = {r["recipe"]: r for r in paired_rows(stats, "bf16", "nvfp4")}["better"]
    assert row["via_n"] == row["via_ref_n"] == 4  # every seed: the same number as the direct paired gap
    assert row["via_gap_pct"] == pytest.approx(row["gap_pct"], rel=1e-12)
    assert row["via_se_pct"] == pytest.approx(row["gap_se_pct"], rel=1e-12)
    del stats["better"][44], stats["better"][45]  # the recipe on two of the reference's four seeds
    row = {r["recipe"]: r for r in paired_rows(stats, "bf16", "nvfp4")}["better"]
    b, p, r = (np.asarray(STATS[k], dtype=np.float64) for k in ("bf16", "nvfp4", "better"))
    g_p = 100 * (p - b) / b
    d = (100 * (r - b) / b - g_p)[:2]
    var = np.var(g_p, ddof=1) / 4 + np.var(d, ddof=1) / 2 + 2 * np.cov(g_p[:2], d, ddof=1)[0, 1] / 4
    assert (row["via_n"], row["via_ref_n"]) == (2, 4)
    assert row["via_gap_pct"] == pytest.approx(g_p.mean() + d.mean(), rel=1e-12)
    assert row["via_se_pct"] == pytest.approx(np.sqrt(max(var, np.var(d, ddof=1) / 2)), rel=1e-12)


def test_the_difference_to_the_reference_and_recipe_against_recipe_match_a_hand_computation():
    """The paired table's difference to the reference, d_s = g_R,s − g_P,s (its s.d. decides how many seeds a recipe
    needs), and the pairwise table behind the decision rule, against numpy float64; a pair ranks only beyond 2 s.e."""
    stats = {k: dict(zip(SEEDS, v)) for k, v in STATS.items()}
    b, p, r = (np.asarray(STATS[k], dtype=np.float64) for k in ("bf16", "nvfp4", "better"))
    g_p, g_r = 100 * (p - b) / b, 100 * (r - b) / b
    d = g_r - g_p
    row = {x["recipe"]: x for x in paired_rows(stats, "bf16", "nvfp4")}["better"]
    assert row["diff_pct"] == pytest.approx(d.mean(), rel=1e-12)
    assert row["diff_sd_pct"] == pytest.approx(np.std(d, ddof=1), rel=1e-12)
    assert row["diff_se_pct"] == pytest.approx(np.std(d, ddof=1) / 2, rel=1e-12)
    pair = pairwise_rows(stats, "bf16")
    assert [(x["a"], x["b"], x["n"]) for x in pair] == [("nvfp4", "better", 4)]
    assert pair[0]["diff_pct"] == pytest.approx(-d.mean(), rel=1e-12)
    assert pair[0]["diff_sd_pct"] == pytest.approx(np.std(d, ddof=1), rel=1e-12)
    assert pair[0]["diff_se_pct"] == pytest.approx(np.std(d, ddof=1) / 2, rel=1e-12)
    assert abs(d.mean()) > t95(3) * np.std(d, ddof=1) / 2 and pair[0]["above"] == "better"  # the lower loss
    # the other order names the first recipe; within the noise, neither
    flipped = pairwise_rows({"bf16": stats["bf16"], "better": stats["better"], "nvfp4": stats["nvfp4"]}, "bf16")
    assert (flipped[0]["a"], flipped[0]["above"]) == ("better", "better")
    assert flipped[0]["diff_pct"] == pytest.approx(d.mean(), rel=1e-12)
    for text in (pairwise_markdown(pair, "bf16"), paired_markdown(paired_rows(stats, "bf16", "nvfp4"), "bf16", "nvfp4",
                                                                  "the last validation loss")):
        lines = [line for line in text.splitlines() if line.startswith("|")]
        assert len({line.count("|") for line in lines}) == 1, lines  # every row has the header's columns
    assert "| nvfp4 − better | 4 |" in pairwise_markdown(pair, "bf16") and "| better |" in pairwise_markdown(pair, "bf16")
    stats["better"] = {s: stats["nvfp4"][s] + (0.001 if s % 2 else -0.001) for s in SEEDS}  # within the noise
    assert pairwise_rows(stats, "bf16")[0]["above"] == ""
    del stats["better"][43], stats["better"][44], stats["better"][45]  # one seed shared: no pair
    assert pairwise_rows(stats, "bf16") == [] and pairwise_markdown([], "bf16") == ""


def test_t95_is_the_two_sided_90_percent_point_of_students_t():
    """Against the t density integrated in float64 (no table involved): P(|T| > t95(df)) = 0.10 within 2·10⁻⁵."""
    import math

    for df in [*range(1, 41), 60, 120]:
        t = t95(df)
        x = np.linspace(0.0, t, 200_001)
        c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
        density = c * (1 + x * x / df) ** (-(df + 1) / 2)
        tail = 1.0 - 2.0 * float(np.sum((density[1:] + density[:-1]) / 2 * np.diff(x)))
        assert tail == pytest.approx(0.10, abs=2e-5), (df, t, tail)
    with pytest.raises(ValueError, match="at least 1"):
        t95(0)


def test_the_gap_through_the_reference_is_unbiased_and_its_standard_error_calibrated():
    """Simulated rankings with the kept runs' spread (per-seed gap s.d. 1.2 points) and a recipe that moves with the
    reference seed by seed (difference s.d. 0.3, correlated −0.3 with the reference's gap): over 4,000 rankings of 20
    reference seeds and 6 recipe seeds, the estimate's mean is the true gap within 4 Monte Carlo s.e., and its spread
    matches the mean reported standard error within 10%; the direct gap over the recipe's 6 seeds spreads 1.7 times
    as much (why the protocol uses it)."""
    rng = np.random.default_rng(0)
    n_p, n_r, sims, gap_p, diff = 20, 6, 4000, 2.3, -1.0
    cov = np.array([[1.2 ** 2, -0.3 * 1.2 * 0.3], [-0.3 * 1.2 * 0.3, 0.3 ** 2]])
    est, se, direct = [], [], []
    for _ in range(sims):
        b = 1.47 + 0.005 * rng.standard_normal(n_p)
        g, dd = (rng.multivariate_normal([gap_p, diff], cov, n_p)).T
        p, r = b * (1 + g / 100), b * (1 + (g + dd) / 100)
        seeds = list(range(42, 42 + n_p))
        stats = {"bf16": dict(zip(seeds, b)), "nvfp4": dict(zip(seeds, p)), "r": dict(zip(seeds[:n_r], r[:n_r]))}
        row = {x["recipe"]: x for x in paired_rows(stats, "bf16", "nvfp4")}["r"]
        est.append(row["via_gap_pct"]); se.append(row["via_se_pct"]); direct.append(row["gap_pct"])
    est, se = np.asarray(est), np.asarray(se)
    assert abs(est.mean() - (gap_p + diff)) < 4 * est.std() / np.sqrt(sims)
    assert np.sqrt(np.mean(se ** 2)) == pytest.approx(est.std(), rel=0.10)
    assert np.std(direct) > 1.5 * est.std()  # 0.47 against 0.28 in theory


def test_the_references_extra_seeds_correct_its_gap_as_a_hand_computation_gives():
    """The reference on six seeds, the baseline on four of them, the recipe on three of those: the reference's gap is
    its paired gap plus k·(mean of its two extra seeds − mean of its paired ones), and the recipe's goes through it;
    both against numpy float64."""
    b4, p6 = [1.470, 1.465, 1.474, 1.468], [1.487, 1.507, 1.521, 1.495, 1.512, 1.490]
    r3 = [1.480, 1.490, 1.500]
    seeds = list(range(42, 48))
    stats = {"bf16": dict(zip(seeds, b4)), "nvfp4": dict(zip(seeds, p6)), "better": dict(zip(seeds, r3))}
    rows = {r["recipe"]: r for r in paired_rows(stats, "bf16", "nvfp4")}
    b, p, r = (np.asarray(x, dtype=np.float64) for x in (b4, p6, r3))
    g = 100 * (p[:4] - b) / b
    k = 100 * 2 / (6 * b.mean())
    gap_p = g.mean() + k * (p[4:].mean() - p[:4].mean())
    var_p = max(np.var(g, ddof=1) / 4 + k * k * np.var(p, ddof=1) * (1 / 2 + 1 / 4)
                - 2 * k * np.cov(g, p[:4], ddof=1)[0, 1] / 4, k * k * np.var(p, ddof=1) / 2)
    ref = rows["nvfp4"]
    assert (ref["n"], ref["via_n"], ref["via_ref_n"]) == (4, 4, 6)
    assert ref["gap_pct"] == pytest.approx(g.mean(), rel=1e-12)  # the direct paired gap stays
    assert ref["via_gap_pct"] == pytest.approx(gap_p, rel=1e-12)
    assert ref["via_se_pct"] == pytest.approx(np.sqrt(var_p), rel=1e-12)
    d = 100 * (r - b[:3]) / b[:3] - g[:3]
    var_r = (var_p + np.var(d, ddof=1) / 3 + 2 * np.cov(g[:3], d, ddof=1)[0, 1] / 4
             - 2 * k * np.cov(p[:3], d, ddof=1)[0, 1] / 4)
    row = rows["better"]
    assert (row["via_n"], row["via_ref_n"]) == (3, 6)
    assert row["via_gap_pct"] == pytest.approx(gap_p + d.mean(), rel=1e-12)
    assert row["via_se_pct"] == pytest.approx(np.sqrt(max(var_r, np.var(d, ddof=1) / 3)), rel=1e-12)
    # with the baseline on every seed of the reference there is no correction: no "via" on the reference's row
    stats["bf16"].update({46: 1.471, 47: 1.466})
    assert "via_gap_pct" not in {r["recipe"]: r for r in paired_rows(stats, "bf16", "nvfp4")}["nvfp4"]


def test_fewer_baseline_seeds_still_give_unbiased_calibrated_gaps():
    """The protocol's design (docs/results.md): the baseline on 8 seeds, the reference on 20, a recipe on 6 of the
    baseline's, with the kept runs' spreads at step 3000 (baseline s.d. 0.005, the reference's per-seed gap s.d.
    1.2 points, uncorrelated with the baseline; the recipe's difference s.d. 0.3). Over 4,000 rankings the
    reference's and the recipe's estimates are the true gaps within 4 Monte Carlo s.e., and their spreads match the
    mean reported standard errors within 10%."""
    rng = np.random.default_rng(1)
    n_b, n_p, n_r, sims, gap_p, diff = 8, 20, 6, 4000, 2.3, -1.0
    est = {"nvfp4": [], "r": []}
    se = {"nvfp4": [], "r": []}
    seeds = list(range(42, 42 + n_p))
    for _ in range(sims):
        b = 1.47 + 0.005 * rng.standard_normal(n_p)
        g = gap_p + 1.2 * rng.standard_normal(n_p)
        p = b * (1 + g / 100)
        r = b * (1 + (g + diff + 0.3 * rng.standard_normal(n_p)) / 100)
        stats = {"bf16": dict(zip(seeds[:n_b], b[:n_b])), "nvfp4": dict(zip(seeds, p)),
                 "r": dict(zip(seeds[:n_r], r[:n_r]))}
        rows = {x["recipe"]: x for x in paired_rows(stats, "bf16", "nvfp4")}
        for name in est:
            est[name].append(rows[name]["via_gap_pct"])
            se[name].append(rows[name]["via_se_pct"])
    for name, truth in (("nvfp4", gap_p), ("r", gap_p + diff)):
        e, s = np.asarray(est[name]), np.asarray(se[name])
        assert abs(e.mean() - truth) < 4 * e.std() / np.sqrt(sims), name
        assert np.sqrt(np.mean(s ** 2)) == pytest.approx(e.std(), rel=0.10), name


def test_final_validations_and_replicate_names():
    assert final_validations({250: 2.0, 500: 1.5, 750: 1.0}, [500, 750]) == pytest.approx(1.25)
    assert final_validations({250: 2.0}, [500, 750]) is None
    assert final_validations({250: 2.0, 500: 1.5}, [500, 750]) is None  # a killed run's earlier one does not stand in
    assert final_validations({500: 1.5, 750: float("nan")}, [500, 750]) is None
    assert [recipe_of(n) for n in ("bf16", "bf16_seed2", "nvfp4_fwd_bf16_0.18_seed17", "seedless")] == \
        ["bf16", "bf16", "nvfp4_fwd_bf16_0.18", "seedless"]


def _log(path: Path, val: dict[int, float], offset: float) -> None:
    """A TorchTitan-like log: training steps every 10 steps up to 100, and validation lines."""
    lines = [f"step: {s}  loss: {3.0 - s / 100 + offset:.4f}  grad_norm: 1.0000  memory: 1.00GiB(1.00%)  tps: 1,000"
             for s in range(10, 101, 10)]
    lines += [f"validate step: {s}  loss: {v:.4f}" for s, v in val.items()]
    path.write_text("\n".join(lines) + "\n")


def _spec(tmp_path: Path, extra: str = "", arm_extra: str = "") -> Path:
    p = tmp_path / "spec.toml"
    p.write_text(f"""
[compare]
base = "{NVFP4_JOB}"
steps = 100
out = "{tmp_path / 'out'}"
baseline = "bf16"
reference = "nvfp4"
{extra}
[[arm]]
name = "bf16"
base = "{BF16_JOB}"
seeds = {SEEDS}
[[arm]]
name = "nvfp4"
seeds = {SEEDS}
[[arm]]
name = "better"
overrides = ["--quantize.linear.nvfp4.bf16_last_blocks", "1"]
seeds = {SEEDS}
{arm_extra}""")
    return p


def test_seeds_expand_into_paired_arms_and_the_table_pairs_them(tmp_path):
    spec = compare.load_spec(_spec(tmp_path, "paired_validations = 2"))
    assert [a.name for a in spec.arms[:4]] == ["bf16", "bf16_seed2", "bf16_seed3", "bf16_seed4"]
    assert [spec.seed(a) for a in spec.arms] == SEEDS * 3
    assert spec.arms[0].overrides == []  # seed 42 is the job file's own: the plain arm's command
    assert spec.arms[10].overrides == ["--quantize.linear.nvfp4.bf16_last_blocks", "1", "--debug.seed", "44"]
    assert spec.command(spec.arms[5])[-2:] == ["--debug.seed", "43"]
    (tmp_path / "out").mkdir()
    earlier = {"bf16": 1.60, "nvfp4": 1.63, "better": 1.61}  # validation at step 50; the statistic averages 50, 100
    for recipe, values in STATS.items():
        for i, v in enumerate(values):
            _log(tmp_path / "out" / f"{recipe}{'' if i == 0 else f'_seed{i + 1}'}.log",
                 {50: earlier[recipe] + 0.001 * i, 100: v}, 0.01 * i)
    table = compare.report(spec)
    stat = {k: [(earlier[k] + 0.001 * i + v) / 2 for i, v in enumerate(vals)] for k, vals in STATS.items()}
    mean, sd, se, share, share_se = _hand(stat["better"], stat["bf16"], stat["nvfp4"])
    assert "the mean of the last 2 validation losses" in table
    assert f"| better | 4 | {mean:+.2f} ± {se:.2f} | {sd:.2f} | {share:.0f} ± {share_se:.0f} |" in table, table
    n_mean, n_sd, n_se, *_ = _hand(stat["nvfp4"], stat["bf16"], stat["nvfp4"])
    assert f"| nvfp4 | 4 | {n_mean:+.2f} ± {n_se:.2f} | {n_sd:.2f} | (reference) |" in table
    assert "Recipe against recipe" in table and "| nvfp4 − better | 4 |" in table  # the decision rule's table
    per_run = table.split("\n\n")[0].splitlines()
    assert "gap to nvfp4 closed" in per_run[0]
    gap = {line.split("|")[1].strip(): line.split("|")[6].strip() for line in per_run[2:]}
    # only another recipe's arm on the pair's seed closes a gap: not a replicate of either, not another seed
    assert {n for n, v in gap.items() if v != "–"} == {"better"} and gap["better"].endswith("%"), gap


def test_the_target_standard_error_line_says_which_gaps_meet_it_and_the_seeds_the_others_need(tmp_path):
    """[compare] target_se: each gap's standard error against the target and, above it, ⌈(s.d./target)²⌉ seeds for
    the direct paired gap; the first paired row of the 386M ranking (2026-12-06): s.d. 0.88 points, 9 seeds."""
    assert seeds_for(0.8769, 0.3) == 9 and seeds_for(0.3, 0.3) == 2 and seeds_for(0.6, 0.3) == 4
    assert seeds_for(0.0, 0.3) == 2 and seeds_for(1.22, 0.3) == 17  # the protocol's fallback
    with pytest.raises(ValueError, match="must be positive"):
        seeds_for(1.0, 0.0)
    ranking = {"bf16": {42: 1.4967, 43: 1.4884}, "nvfp4": {42: 1.5071, 43: 1.5172}, "once": {42: 1.50}}
    line = target_markdown(paired_rows(ranking, "bf16", "nvfp4"), 0.3)
    g = 100 * (np.array([1.5071, 1.5172]) / np.array([1.4967, 1.4884]) - 1)
    se, sd = np.std(g, ddof=1) / np.sqrt(2), np.std(g, ddof=1)
    assert line == ("Standard error of each gap against the target of 0.30 points ([compare] target_se): nvfp4 "
                    f"{se:.2f} (direct): the direct paired gap needs about {int(np.ceil((sd / 0.3) ** 2))} seeds at its "
                    f"s.d. of {sd:.2f} (has 2); once no spread yet (1 seed paired).\n"), line
    stats = {k: dict(zip(SEEDS, v)) for k, v in STATS.items()}
    rows = paired_rows(stats, "bf16", "nvfp4")
    line = target_markdown(rows, 5.0)  # a loose target: every gap meets it, "better" through the reference
    assert "nvfp4 " in line and ": met; better " in line and "(through the reference): met." in line, line

    spec = compare.load_spec(_spec(tmp_path, "target_se = 0.3"))
    assert spec.target_se == 0.3
    (tmp_path / "out").mkdir()
    for recipe, values in STATS.items():
        for i, v in enumerate(values):
            _log(tmp_path / "out" / f"{recipe}{'' if i == 0 else f'_seed{i + 1}'}.log", {100: v}, 0.0)
    assert target_markdown(rows, 0.3) in compare.report(spec)
    for bad in ("-0.1", '"0.3"', "true"):
        with pytest.raises(ValueError, match=r"\[compare\] target_se must be a non-negative number"):
            compare.load_spec(_spec(tmp_path, f"target_se = {bad}"))


def test_a_partial_replicate_waits_out_of_the_paired_table(tmp_path):
    spec = compare.load_spec(_spec(tmp_path))
    (tmp_path / "out").mkdir()
    for recipe, values in STATS.items():
        for i, v in enumerate(values):
            _log(tmp_path / "out" / f"{recipe}{'' if i == 0 else f'_seed{i + 1}'}.log", {100: v}, 0.0)
    log = tmp_path / "out/better_seed4.log"
    log.write_text("\n".join(line for line in log.read_text().splitlines() if "step: 100 " not in line) + "\n")
    table = compare.report(spec)
    assert "| better | 3 |" in table and "Partial (below step 100): better_seed4 at step 90" in table


def test_a_common_seed_beside_seeds_lists_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"\[compare\] common sets --debug.seed, which would override the seed of "
                                         r"arm 'bf16'"):
        compare.load_spec(_spec(tmp_path, 'common = ["--debug.seed", "7"]'))


@pytest.mark.parametrize("arm_extra,needles", [
    ('[[arm]]\nname = "x"\nseeds = []', ["arm 'x' seeds", "non-empty list"]),
    ('[[arm]]\nname = "x"\nseeds = [1, 1]', ["arm 'x' seeds", "distinct"]),
    ('[[arm]]\nname = "x"\nseeds = [1, "2"]', ["arm 'x' seeds", "integers"]),
    ('[[arm]]\nname = "x_seed2"\nseeds = [1, 2]', ["'x_seed2'", "may not end in _seedN"]),
    ('[[arm]]\nname = "bf16_seed3"', ["'bf16_seed3'", "unique"]),
    ('[[arm]]\nname = "nvfp4_fwd"\n[[arm]]\nname = "nvfp4_fwd_seed2"\nseeds = [5]', ["may not end in _seedN"]),
    ('[[arm]]\nname = "nvfp4_seed9"\noverrides = ["--debug.seed", "43"]',
     ["arms 'nvfp4_seed2' and 'nvfp4_seed9' are both replicates of 'nvfp4' on seed 43", "would keep one"]),
], ids=["empty", "duplicate", "not_int", "suffix", "taken_name", "suffix_plain", "same_seed"])
def test_bad_seeds_are_refused_by_arm(tmp_path, arm_extra, needles):
    with pytest.raises(ValueError) as e:
        compare.load_spec(_spec(tmp_path, arm_extra=arm_extra))
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_ranking_spec_tables_the_kept_386m_logs_as_the_results_page_shows(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    spec = compare.load_spec(REPO / "configs/compare/recipe_ranking_386m.toml")
    names = [a.name for a in spec.arms]
    assert len(names) == 49 and names[:3] == ["bf16", "bf16_seed2", "bf16_seed3"] and "tetrajet2_seed6" in names
    for recipe in ("bf16", "nvfp4"):  # the same 10 seeds: the direct paired gap (the revised protocol)
        assert [spec.seed(a) for a in spec.arms if re.fullmatch(rf"{recipe}(_seed\d+)?", a.name)] == list(range(42, 52))
    assert [spec.seed(a) for a in spec.arms if re.fullmatch(r"quartet2(_seed\d+)?", a.name)] == list(range(42, 48))
    best = [a for a in spec.arms if a.name.startswith("quartet2_fwd")]  # the best combination, branched
    assert [spec.seed(a) for a in best] == list(range(43, 48)) and [a.branch_from for a in best] == \
        [f"quartet2_seed{i}" for i in range(2, 7)]
    spec.out = tmp_path / "kept"
    spec.out.mkdir()
    for name in ("bf16", "bf16_seed2", "bf16_seed3", "nvfp4", "nvfp4_seed2", "nvfp4_seed3"):
        shutil.copy(KEPT / f"{name}.log", spec.out)
    row = "| nvfp4 | 3 | +2.34 ± 0.71 | 1.22 | (reference) |  |"
    assert row in compare.table.paired_table(spec, *_kept_runs(spec))
    page = (REPO / "docs/results.md").read_text()
    assert row in page
    # the page's table with the variants (one seed each) comes from the 386M section's own spec over the kept logs
    spec = compare.load_spec(REPO / "configs/compare/llama3_2b_pysources.toml")
    spec.out = KEPT
    rows = [line for line in compare.table.paired_table(spec, *_kept_runs(spec)).splitlines() if line.startswith("| ")]
    assert len(rows) == 6 and all(line in page for line in rows)  # header, rule, nvfp4 and the three variants


def test_the_ranking_table_is_what_its_kept_logs_give(tmp_path, monkeypatch):
    """docs/results/recipe_ranking_386m/compare.md, as kept, is the runner's report over the logs kept beside it
    (the results page's command): an arm's log brought in without its table, or a table edited by hand, fails."""
    from titan_nvfp4.compare.cli import main

    kept = REPO / "docs/results/recipe_ranking_386m"
    for log in kept.glob("*.log"):
        shutil.copy(log, tmp_path)
    monkeypatch.chdir(REPO)
    assert main(["configs/compare/recipe_ranking_386m.toml", "--report-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "compare.md").read_text() == (kept / "compare.md").read_text()


def _kept_runs(spec):
    from titan_nvfp4.tools.loss_log import read_run

    runs, val = {}, {}
    for arm in spec.arms:
        if spec.log(arm).is_file():
            runs[arm.name], val[arm.name] = read_run(spec.log(arm))
    return runs, val


def test_seed_spread_on_the_kept_logs_gives_the_results_pages_numbers(capsys):
    logs = [str(KEPT / f"{n}.log") for n in ("bf16", "bf16_seed2", "bf16_seed3", "nvfp4", "nvfp4_seed2", "nvfp4_seed3")]
    seed_spread.main([*logs, "--baseline", "bf16", "--recipe", "nvfp4"])
    out = capsys.readouterr().out
    page = (REPO / "docs/results.md").read_text()
    for line in ("| validation loss at step 3000 | 0.0049 | 0.0173 | +2.34 ± 0.71 | 1.22 | 17 |",
                 "| 1250 | 0.0888 | 0.1695 | +2.82 | 11.94 | -0.99 | -7.36, -0.14, +15.96 |",
                 "| 1251–1500 | -6.33 | +0.27 | +13.52 | 10.11 |"):
        assert line in out and line in page, line


def test_seed_spread_finds_an_injected_spike_and_needs_two_seeds(tmp_path, capsys):
    rng = np.random.default_rng(0)
    batch = rng.normal(0, 0.05, 200)  # every run's batch difficulty, shared
    for name, shift in (("a", 0.0), ("a_seed2", 0.01), ("b", 0.02), ("b_seed2", 0.03)):
        loss = 3 - np.arange(200) / 100 + batch + shift + rng.normal(0, 0.002, 200)
        if name == "b_seed2":
            loss[120] += 0.1
        lines = [f"step: {10 * (i + 1)}  loss: {x:.5f}  grad_norm: 1.0  memory: 1.00GiB(1%)  tps: 1,000"
                 for i, x in enumerate(loss)]
        (tmp_path / f"{name}.log").write_text("\n".join(lines + ["validate step: 2000  loss: 1.5"]) + "\n")
    logs = [str(tmp_path / f"{n}.log") for n in ("a", "a_seed2", "b", "b_seed2")]
    found = seed_spread.spikes({Path(p).stem: seed_spread.read_runs("t", [Path(p)])[0][Path(p).stem] for p in logs}, 5)
    assert [t for t, _ in found["b_seed2"]] == [1210] and found["a"] == []
    with pytest.raises(SystemExit):
        seed_spread.main([*logs[:3], "--baseline", "a", "--recipe", "b"])
    assert "needs at least two seeds" in capsys.readouterr().err


def test_the_ranking_crosses_two_initialisations_with_four_rounding_streams(tmp_path, monkeypatch):
    """Issue 68's first question, in the ranking spec: nvidia_paper at sr_seed 1-3 at --debug.seed 42 and 44, beside
    its own nvfp4 arms there (sr_seed 0, the job file's), every run under the spec's corpus pin."""
    monkeypatch.chdir(REPO)
    spec = compare.load_spec(REPO / "configs/compare/recipe_ranking_386m.toml")

    def sr_seed(arm):
        o = list(arm.overrides)
        return int(o[o.index("--quantize.linear.nvfp4.sr_seed") + 1]) if "--quantize.linear.nvfp4.sr_seed" in o else 0
    streams = {}
    for a in spec.arms:
        if a.name == "nvfp4" or a.name.startswith(("nvfp4_seed", "nvfp4_sr")):
            streams.setdefault(spec.seed(a), set()).add(sr_seed(a))
    assert streams[42] == streams[44] == {0, 1, 2, 3}
    assert all(streams[s] == {0} for s in streams if s not in (42, 44))
    assert all(spec.env(a)["TITAN_NVFP4_CORPUS"] == "3adb9d1c9f2d" for a in spec.arms)


def test_a_cut_or_nan_last_validation_leaves_the_run_out_of_the_paired_rows_by_name(tmp_path, capsys):
    """A kill mid-line leaves "validate step: 100  loss:  1.4" at the log's end: no value (it read as 1.4 before);
    a run without the protocol's last validation is not paired through an earlier one, and a NaN one does not crash
    the table (nor seed_spread): each is named under the paired rows."""
    spec = compare.load_spec(_spec(tmp_path))
    out = tmp_path / "out"
    out.mkdir()
    for recipe, values in STATS.items():
        for i, v in enumerate(values):
            _log(out / f"{recipe}{'' if i == 0 else f'_seed{i + 1}'}.log", {50: v + 0.2, 100: v}, 0.0)
    cut = out / "better_seed4.log"
    text = cut.read_text()
    cut.write_text(text[:text.rindex("loss: ") + len("loss: 1.4")])
    from titan_nvfp4.tools.loss_log import parse_validation

    assert parse_validation(cut.read_text()) == {50: pytest.approx(STATS["better"][3] + 0.2)}
    diverged = out / "nvfp4_seed3.log"
    diverged.write_text(diverged.read_text().replace(f"validate step: 100  loss: {STATS['nvfp4'][2]:.4f}",
                                                     "validate step: 100  loss: nan"))
    table = compare.report(spec)
    assert "| nvfp4 | 3 |" in table and "| better | 3 |" in table
    assert ("Left out of the paired rows, without a finite validation loss at step 100: nvfp4_seed3, better_seed4"
            in table)
    logs = [str(out / f"{n}.log") for n in ("bf16", "bf16_seed2", "bf16_seed3", "nvfp4", "nvfp4_seed2", "nvfp4_seed3")]
    seed_spread.main([*logs, "--baseline", "bf16", "--recipe", "nvfp4"])
    assert "| validation loss at step 100 |" in capsys.readouterr().out
