"""Reports made for reading (issue 12): report.html, ope.html and the `offrl ope` page open with a summary in
words, show one row per policy with "value [low, high]" cells, explain each estimator family's warnings once,
show the seed count (and no ± for one seed), caption their plots, and fit 1280 px without scrolling sideways.

The OPE pages are built from the numbers of a real quickstart run (pendulum-medium-replay-v1, 37 logged episodes
of 200 steps, BC / TD3+BC / IQL / CQL evaluated by FQE, PDIS, WPDIS, DR and WDR), the sweep pages from run
directories in the layout `offrl sweep` writes.  Chromium renders them only in the slow test at the end.
"""

from __future__ import annotations

import html
import importlib.util
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from offrl import Dataset
from offrl.ope import OPEReport, OPEResult
from offrl.ope.report import estimator_family, logged_value
from offrl.report import results_frame, score_table, write_report

pytestmark = pytest.mark.usefixtures("one_thread")

INF = math.inf
# policy, estimator, value, ci_low, ci_high, ess (per-decision), FQE ensemble std: a real quickstart run's numbers
QUICKSTART = [
    ("BC", "FQE", -591.40, -651.44, -531.47, None, 7.46),
    ("BC", "PDIS", -6.89, -12.19, -2.33, 1.123, None),
    ("BC", "WPDIS", -313.30, -INF, INF, 1.123, None),
    ("BC", "DR", -593.28, -643.36, -543.03, 1.123, None),
    ("BC", "WDR", -626.89, -INF, INF, 1.123, None),
    ("TD3PlusBC", "FQE", -585.92, -646.73, -524.92, None, 7.82),
    ("TD3PlusBC", "PDIS", -6.54, -12.14, -1.89, 1.091, None),
    ("TD3PlusBC", "WPDIS", -308.40, -INF, INF, 1.091, None),
    ("TD3PlusBC", "DR", -586.78, -637.71, -535.78, 1.091, None),
    ("TD3PlusBC", "WDR", -612.45, -INF, INF, 1.091, None),
    ("IQL", "FQE", -313.79, -894.76, 267.21, None, 134.95),
    ("IQL", "PDIS", -2.45, -5.46, -0.26, 1.044, None),
    ("IQL", "WPDIS", -185.16, -INF, INF, 1.044, None),
    ("IQL", "DR", -314.60, -333.57, -294.19, 1.044, None),
    ("IQL", "WDR", -160.34, -INF, INF, 1.044, None),
    ("CQL", "FQE", -214.23, -438.97, 10.546, None, 51.58),
    ("CQL", "PDIS", -0.72, -1.90, -0.08, 1.033, None),
    ("CQL", "WPDIS", -260.93, -INF, INF, 1.033, None),
    ("CQL", "DR", -214.26, -249.67, -178.55, 1.033, None),
    ("CQL", "WDR", -93.96, -INF, INF, 1.033, None),
]
TRUE = {"BC": -521.1, "TD3PlusBC": -507.7, "IQL": -346.9, "CQL": -157.9}
TRUE_SE = {"BC": 31.55, "TD3PlusBC": 32.66, "IQL": 29.1, "CQL": 22.55}
WARNING = "the importance weights are dominated by a few samples (effective sample size {ess:.1f} of 37, max weight 0)"


def quickstart_report(true_values: bool = True) -> OPEReport:
    """The quickstart's OPEReport, rebuilt from its numbers with the diagnostics the estimators write."""
    results: dict[str, dict[str, OPEResult]] = {}
    fqe = {p: v for p, e, v, *_ in QUICKSTART if e == "FQE"}
    for policy, estimator, value, low, high, ess, ens in QUICKSTART:
        diag = {"interval": "bootstrap", "alpha": 0.05, "n": 37, "target_policy": "deterministic"}
        if estimator == "FQE":
            diag.update({"ensemble_std": ens, "horizon": None})
        else:
            diag.update({"ess": ess, "ess_fraction": ess / 37, "max_weight": 0.0, "log_max_weight": -800.0,
                         "behavior_policy": "logged", "horizon": 200, "unsupported_mass": 0.0,
                         "warning": WARNING.format(ess=ess)})
            if estimator in ("DR", "WDR"):
                diag["dm_value"] = fqe[policy]
            if not math.isfinite(low):
                diag["interval_note"] = "undefined: effective sample size below 2"
        se = INF if not math.isfinite(low) else (high - low) / 3.92
        results.setdefault(policy, {})[estimator] = OPEResult(value, se, low, high, estimator, diag)
    metadata = {"dataset": "pendulum-medium-replay-v1", "episodes": 37, "gamma": 0.99}
    if true_values:
        metadata.update({"true values": "20 on-policy roll-outs per policy", "true_value_std_error": dict(TRUE_SE)})
    return OPEReport(results, true_values=dict(TRUE) if true_values else None, metadata=metadata)


def visible(page: str) -> str:
    """The page as a reader sees it before opening any collapsed block: text without tags and <details>."""
    page = re.sub(r"<details>.*?</details>", "", page, flags=re.S)
    page = re.sub(r"<style>.*?</style>", "", page, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", page))


def first_table_rows(page: str) -> list[list[str]]:
    table = re.search(r"<table[^>]*>.*?</table>", page, re.S).group(0)
    body = re.search(r"<tbody>(.*?)</tbody>", table, re.S).group(1)
    rows = re.findall(r"<tr>(.*?)</tr>", body, re.S)
    return [[html.unescape(re.sub(r"<[^>]+>", "", c)).strip() for c in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", r, re.S)]
            for r in rows]


CELL = re.compile(r"^-?[\d,]+(\.\d+)? \[(-?[\d,]+(\.\d+)?|-∞), (-?[\d,]+(\.\d+)?|∞)\]$")


# ---------------------------------------------------------------------- ope.html / the `offrl ope` page
def test_ope_page_opens_with_a_summary_in_words(tmp_path):
    report = quickstart_report()
    report.to_html(tmp_path / "ope.html", title="Quickstart: off-policy evaluation")
    page = (tmp_path / "ope.html").read_text()
    # the summary is the first thing after the title
    assert re.search(r"</h1><section class='summary' id='summary'><h2>Summary</h2>", page)
    summary = visible(re.search(r"<section class='summary'.*?</section>", page, re.S).group(0))
    assert "CQL looks best of the 4 policies by FQE, the most trustworthy estimator here" in summary
    assert "CQL is estimated 377.2 above BC" in summary  # against BC
    assert "The true values (20 on-policy roll-outs per policy) confirm it: CQL -157.9 ± 22.55" in summary
    assert "Trustworthy here: FQE, because no importance weights are used" in summary
    assert re.search(r"Uninformative here: PDIS, WPDIS and WDR, because on these 200-step episodes, the effective "
                     r"sample size of the importance weights is about 1\.1 of 37", summary)
    assert "Use with care: DR" in summary and "adds no evidence of its own" in summary


def test_ope_estimates_are_one_row_per_policy_with_value_low_high_cells(tmp_path):
    report = quickstart_report()
    report.to_html(tmp_path / "ope.html")
    page = (tmp_path / "ope.html").read_text()
    rows = first_table_rows(page.split("<h2>Estimates</h2>", 1)[1])
    assert [r[0] for r in rows] == ["BC", "TD3PlusBC", "IQL", "CQL"]
    assert rows[0][1] == "-521.1 ± 31.55"  # the true value with its standard error, not a raw dict
    for row in rows:
        assert len(row) == 2 + 5
        assert all(CELL.match(cell) for cell in row[2:]), row
    assert rows[3][2] == "-214.2 [-439.0, 10.5]" and rows[0][4] == "-313.3 [-∞, ∞]"
    assert "{'" not in page and "true_value_std_error" not in visible(page)
    table = report.to_table()
    assert list(table.index) == ["BC", "TD3PlusBC", "IQL", "CQL"]
    assert list(table.columns) == ["true value", "FQE", "PDIS", "WPDIS", "DR", "WDR"]
    assert table.loc["CQL", "FQE"] == "-214.2 [-439.0, 10.5]"


def test_ope_warnings_are_grouped_per_family_and_explained_once(tmp_path):
    report = quickstart_report()
    report.to_html(tmp_path / "ope.html")
    page = (tmp_path / "ope.html").read_text()
    seen = visible(page)
    # 16 identical warnings before; now once per family that raised it (per-decision IS, doubly robust)
    assert seen.count("the importance weights are dominated by a few samples") == 2
    assert "(PDIS and WPDIS, all 4 policies)" in seen and "(DR and WDR, all 4 policies)" in seen
    # the weights' collapse is explained once, in numbers a reader can follow, and "max weight 0" is explained
    assert seen.count("Why the weights fail here") == 1
    assert "the largest is about 10^-347" in seen and "\"max weight 0\" is that largest weight rounded" in seen
    assert "PDIS does not renormalise the weights, so its estimates are pulled towards 0" in seen
    # the raw messages are still there, collapsed, each once
    raw = re.findall(r"<details><summary>The estimators' warnings as they wrote them</summary>(.*?)</details>", page, re.S)
    assert len(raw) == 1 and raw[0].count("<li>") == 2  # one per distinct message (ESS 1.1 or 1.0)
    verdicts = report.assess_estimators()
    assert dict(verdicts["verdict"]) == {"FQE": "trustworthy", "PDIS": "uninformative", "WPDIS": "uninformative",
                                         "DR": "use with care", "WDR": "uninformative"}
    assert verdicts.loc["PDIS", "family"] == "per-decision importance sampling"


def test_ope_plots_have_captions_and_the_page_fits_its_column(tmp_path):
    report = quickstart_report()
    report.to_html(tmp_path / "ope.html")
    page = (tmp_path / "ope.html").read_text()
    assert page.count("data:image/png;base64,") == 2
    assert page.count("<figcaption>Figure") == 2
    assert page.count("<caption>") == page.count("<table") - page.count("class='raw'")
    # responsive by construction: a max-width column, wrapping cells, images scaled to the column; no scripts
    assert "main{max-width:1100px" in page and "overflow-wrap:break-word" in page and "max-width:100%" in page
    assert "<script" not in page and not re.search(r"""(src|href)\s*=\s*['"]?(https?:)?//""", page)
    # the raw frame is kept, collapsed
    assert "<details><summary>All numbers: one row per policy and estimator</summary>" in page


def test_str_and_quickstart_summaries_read_as_text():
    from offrl.quickstart import _ope_section, _ope_summary

    report = quickstart_report()
    text = str(report)
    assert text.startswith("CQL looks best")
    assert "-214.2 [-439.0, 10.5]" in text
    console = _ope_summary(report)
    assert "Uninformative here: PDIS, WPDIS and WDR" in console and "true value" in console
    section = _ope_section(report)
    assert "<h3>Estimates</h3>" in section and "Which estimators to trust" in section
    assert visible(section).count("the importance weights are dominated by a few samples") == 2
    assert "{'" not in section


def test_summary_without_true_values_and_for_one_policy(tmp_path):
    report = quickstart_report(true_values=False)
    text = report.summary()
    assert "CQL looks best" in text and "true value" not in text
    single = OPEReport({"a": {"X": OPEResult(1.0, 0.1, 0.8, 1.2, "X")}})
    assert single.summary().startswith("X estimates the value of a at 1.00 [0.80, 1.20]")
    single.to_html(tmp_path / "one.html")
    assert "id='summary'" in (tmp_path / "one.html").read_text()


def test_a_disagreeing_truth_is_said_and_lowers_the_verdict():
    report = quickstart_report()
    flipped = {p: -v for p, v in TRUE.items()}  # the true order reversed: every estimator ranks wrongly
    report = OPEReport(report.results, true_values=flipped, metadata=report.metadata)
    verdicts = report.assess_estimators()
    assert verdicts.loc["FQE", "verdict"] == "use with care"
    assert "the policies are ranked poorly (Spearman -1.00)" in verdicts.loc["FQE", "reason"]
    assert "By the true values (20 on-policy roll-outs per policy) the best is BC" in report.summary()


def test_estimator_family_and_logged_value():
    assert [estimator_family(n) for n in ("FQE", "IS", "WPDIS", "WDR", "snipw", "dm")] == \
        ["model", "is", "pdis", "dr", "is", "model"]
    assert estimator_family("Mine", {"dm_value": 1.0}) == "dr"
    assert estimator_family("Mine", {"ess": 3.0}) == "is"
    ds = Dataset.from_episodes([{"observations": np.zeros((4, 1)), "actions": np.zeros((3, 1)),
                                 "rewards": np.array([1.0, 1.0, 1.0]), "truncations": [False, False, True]},
                                {"observations": np.zeros((3, 1)), "actions": np.zeros((2, 1)),
                                 "rewards": np.array([2.0, 0.0]), "truncations": [False, True]}])
    assert logged_value(ds, 0.5) == pytest.approx(((1 + 0.5 + 0.25) + 2.0) / 2)
    assert logged_value(ds, 1.0, horizon=1) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="gamma"):
        logged_value(ds, 2.0)


# ---------------------------------------------------------------------- the sweep's report.html
def fake_sweep(out: Path, seeds=(0,), scores=None, relative_dirs: bool = False) -> Path:
    """Run directories as `offrl sweep` writes them (config.json, result.json with its history), no training."""
    scores = scores or {"BC": 4.8, "TD3PlusBC": 9.2, "IQL": 35.2, "CQL": 97.7}
    dataset = "pendulum-medium-replay-v1"
    for algorithm, score in scores.items():
        for seed in seeds:
            run = out / "runs" / dataset / algorithm / f"seed{seed}"
            run.mkdir(parents=True)
            final = score + 2.0 * seed
            history = [{"step": s, "normalized_score_mean": final * s / 1000, "normalized_score_std": 1.0,
                        "return_mean": -1200 + 10 * final * s / 1000, "return_std": 100.0} for s in (250, 500, 1000)]
            stored_dir = f"elsewhere/runs/{dataset}/{algorithm}/seed{seed}" if relative_dirs else str(run)
            config = {"dataset": {"label": dataset}, "algorithm": algorithm, "label": algorithm, "variant": algorithm,
                      "params": {}, "seed": seed, "steps": 1000, "hash": "abc"}
            result = {"algorithm": algorithm, "variant": algorithm, "label": algorithm, "dataset": dataset,
                      "seed": seed, "steps": 1000, "status": "ok", "params": {}, "hash": "abc", "dir": stored_dir,
                      "final_score": final, "best_score": final + 1.0, "final_return": -1200 + 10 * final,
                      "best_return": -1190 + 10 * final, "final_return_std": 50.0, "dataset_score": -2.5,
                      "train_seconds": 1.0, "history": history}
            (run / "config.json").write_text(json.dumps(config))
            (run / "result.json").write_text(json.dumps(result))
    return out


def test_sweep_report_one_seed_has_no_plus_minus_and_says_so(tmp_path):
    out = fake_sweep(tmp_path / "sweep")
    paths = write_report(out, title="quickstart")
    page = paths["html"].read_text()
    assert re.search(r"</h1><section class='summary' id='summary'><h2>Summary</h2>", page)
    summary = visible(re.search(r"<section class='summary'.*?</section>", page, re.S).group(0))
    assert "4 training runs: 4 algorithm variants (BC, CQL, IQL and TD3PlusBC) on 1 dataset, 1 seed (0) each" in summary
    assert ("CQL scores best by the last evaluation's normalised score: 97.7 (one seed), against -2.5 for the data's "
            "own episodes, 4.8 for BC and 35.2 for the runner-up, IQL.") in summary
    assert "With one seed per algorithm each score is a single training run" in summary
    scores = page.split("<h2>Scores</h2>", 1)[1]
    rows = first_table_rows(scores)
    assert rows == [["pendulum-medium-replay-v1", "-2.5", "4.8best 5.8", "97.7best 98.7", "35.2best 36.2",
                     "9.2best 10.2"]]
    assert "±" not in visible(page) and "1 seed (0), so no spread is shown" in scores
    assert "<th scope='col'>dataset</th>" in scores and "<th></th>" not in page  # no empty 'dataset' header row
    table = score_table(results_frame(out))
    assert table.loc["pendulum-medium-replay-v1", "CQL (last)"] == "97.7"  # table.csv and the console: no "± 0.0"
    assert page.count("<figcaption>Figure 1.") == 1 and "one seed each, so no band" in page
    assert "<details><summary>All runs: one row per run (4; the same as results.csv)</summary>" in page


def test_sweep_report_several_seeds_shows_the_count_and_the_spread(tmp_path):
    out = fake_sweep(tmp_path / "sweep", seeds=(0, 1), scores={"BC": 10.0, "IQL": 50.0})
    page = write_report(out)["html"].read_text()
    summary = visible(re.search(r"<section class='summary'.*?</section>", page, re.S).group(0))
    assert "4 training runs: 2 algorithm variants (BC and IQL) on 1 dataset, 2 seeds (0 and 1) each" in summary
    assert "IQL scores best by the last evaluation's normalised score: 51.0 ± 1.0 (mean ± std over 2 seeds)" in summary
    assert "Its lead over BC is larger than the seed-to-seed spread." in summary
    assert "mean ± std over 2 seeds (0 and 1)" in page and "shaded: ± one standard deviation over seeds" in page
    assert score_table(results_frame(out)).loc["pendulum-medium-replay-v1", "IQL (last)"] == "51.0 ± 1.0"


def test_sweep_report_reads_runs_written_from_another_working_directory(tmp_path):
    """result.json keeps the run's directory as the sweep saw it (relative to where it ran): the report finds
    the run where it is now, and draws its learning curve (it raised FileNotFoundError)."""
    out = fake_sweep(tmp_path / "sweep", relative_dirs=True)
    page = write_report(out)["html"].read_text()
    assert page.count("<figure>") == 1
    assert all(Path(d).is_dir() for d in results_frame(out)["dir"])


# ---------------------------------------------------------------------- Chromium at 1280 px (optional)
def _render_module():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "render_reports.py"
    spec = importlib.util.spec_from_file_location("render_reports", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_pages_fit_1280_px_in_chromium(tmp_path):
    render = _render_module()
    binary = render.find_chromium()
    if binary is None:
        pytest.skip("no Chromium (apt-get install chromium) to render the pages")
    report = quickstart_report()
    report.to_html(tmp_path / "ope.html")
    out = fake_sweep(tmp_path / "sweep")
    from offrl.quickstart import _ope_section, _ope_summary_html

    write_report(out, extra_html=_ope_section(report), extra_summary=_ope_summary_html(report))
    rows = render.render({"ope": tmp_path / "ope.html", "report": out / "report.html"}, tmp_path / "shots", binary)
    for row in rows:
        assert not row["overflow"], row
        assert row["summaryTop"] is not None and row["summaryTop"] < 200, row
        assert Path(row["screenshot"]).stat().st_size > 10_000
