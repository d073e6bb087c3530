"""Render offrl's report pages in headless Chromium at 1280 px and check that none scrolls sideways.

Makes the three pages from small real runs (a random-behaviour Pendulum-v1
dataset of 200-step episodes, a sweep of BC, TD3+BC and IQL over 2 seeds,
then off-policy evaluation of their policies against true values from
roll-outs), or takes paths to existing pages:

- ``sweep/report.html``: the sweep report, with the OPE section the
  quickstart adds (`offrl.report.write_report`);
- ``sweep/ope.html``: `OPEReport.to_html` of that evaluation (the
  quickstart's ope.html);
- ``ope-cli/report.html``: the page `offrl ope` writes.

For each page it opens every collapsed block, measures the document's
``scrollWidth`` against the 1280-px window (an injected script writes it into
the DOM; ``--dump-dom`` reads it back) and where the summary box starts, then
takes a screenshot of the page's full height.  Screenshots go to
``--out``/screenshots; a table of what was measured is printed, and the exit
status is 1 when a page scrolls sideways or has no summary at its top.

    python benchmarks/render_reports.py --out /tmp/offrl-render        # make the pages, then render
    python benchmarks/render_reports.py --pages a/report.html b/ope.html   # render existing pages

Chromium is not an offrl dependency: install Debian's package
(``apt-get install chromium``); without it the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WIDTH = 1280
MAX_HEIGHT = 16000

_MEASURE = """<script>
window.addEventListener('load', function () {
  var de = document.documentElement, body = document.body;
  var closed = Math.max(de.scrollHeight, body.scrollHeight);
  document.querySelectorAll('details').forEach(function (d) { d.open = true; });
  var box = document.getElementById('summary');
  var widest = 0, widestTag = '';
  document.querySelectorAll('body *').forEach(function (el) {
    var r = el.getBoundingClientRect();
    if (r.right > widest) { widest = r.right; widestTag = el.tagName + (el.className ? '.' + el.className : ''); }
  });
  var out = {scrollWidth: Math.max(de.scrollWidth, body.scrollWidth), clientWidth: de.clientWidth,
             heightClosed: closed, heightOpen: Math.max(de.scrollHeight, body.scrollHeight),
             summaryTop: box ? Math.round(box.getBoundingClientRect().top) : null,
             images: document.images.length, widestRight: Math.round(widest), widestElement: widestTag};
  var pre = document.createElement('pre');
  pre.id = 'offrl-measure';
  pre.textContent = 'OFFRL-MEASURE' + JSON.stringify(out) + 'OFFRL-END';
  body.appendChild(pre);
});
</script>"""


def find_chromium() -> str | None:
    """The Chromium binary (chromium, chromium-browser, google-chrome), or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _chromium(binary: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    command = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--force-device-scale-factor=1", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def measure(binary: str, page: Path, width: int = WIDTH) -> dict:
    """Lay `page` out at `width` px with every <details> open; its scroll width, heights and summary position."""
    text = page.read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.html"
        probe.write_text(text.replace("</body>", _MEASURE + "</body>") if "</body>" in text else text + _MEASURE,
                         encoding="utf-8")
        done = _chromium(binary, f"--window-size={width},900", "--virtual-time-budget=15000", "--dump-dom",
                         probe.as_uri())
    found = re.search(r"OFFRL-MEASURE(\{.*?\})OFFRL-END", done.stdout, re.S)
    if not found:
        raise RuntimeError(f"Chromium did not lay out {page} (exit {done.returncode}): {done.stderr[-600:]}")
    values = json.loads(found.group(1).replace("&quot;", '"'))
    values["overflow"] = values["scrollWidth"] > values["clientWidth"]
    return values


def screenshot(binary: str, page: Path, png: Path, height: int, width: int = WIDTH) -> Path:
    """A `width` x `height` screenshot of `page` (its collapsed blocks stay collapsed)."""
    png.parent.mkdir(parents=True, exist_ok=True)
    done = _chromium(binary, f"--window-size={width},{height}", "--virtual-time-budget=15000",
                     f"--screenshot={png}", page.resolve().as_uri())
    if not png.exists():
        raise RuntimeError(f"Chromium wrote no screenshot of {page} (exit {done.returncode}): {done.stderr[-600:]}")
    return png


# ---------------------------------------------------------------------- the pages, from small real runs
def tiny_pendulum(path: Path, n_episodes: int = 8, length: int = 200, seed: int = 0) -> Path:
    """Pendulum-v1 episodes of a uniform-random policy on [-2, 2], its log-probabilities logged, saved as .npz."""
    import gymnasium as gym

    from offrl import Dataset

    env = gym.make("Pendulum-v1")
    rng = np.random.default_rng(seed)
    episodes = []
    for i in range(n_episodes):
        obs, _ = env.reset(seed=seed + i)
        observations, actions, rewards = [obs], [], []
        for _ in range(length):
            action = rng.uniform(-2, 2, size=1).astype(np.float32)
            obs, reward, *_ = env.step(action)
            observations.append(obs)
            actions.append(action)
            rewards.append(reward)
        episodes.append({"observations": np.array(observations), "actions": np.array(actions),
                         "rewards": np.array(rewards), "truncations": [False] * (length - 1) + [True],
                         "behavior_log_probs": np.full(length, -math.log(4.0))})
    ds = Dataset.from_episodes(episodes, action_low=-2.0, action_high=2.0,
                               metadata={"name": "pendulum-random-tiny", "env_id": "Pendulum-v1",
                                         "ref_min_score": -1200.0, "ref_max_score": -150.0})
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save(path)
    return path


def make_pages(out: Path, steps: int = 600, fqe_steps: int = 1000, rollouts: int = 5) -> dict[str, Path]:
    """Train, evaluate and write the three pages under `out`; returns name -> page path."""
    import warnings

    import torch

    import offrl
    from offrl import ope
    from offrl.cli import main as cli_main
    from offrl.datasets import load
    from offrl.ope.report import logged_value
    from offrl.quickstart import _ope_section, _ope_summary_html
    from offrl.report import write_report
    from offrl.sweep import parse_config, run_sweep

    torch.set_num_threads(1)
    started = time.time()
    data = tiny_pendulum(out / "data" / "pendulum-random-tiny.npz")
    config = parse_config({"name": "render-reports", "datasets": [{"spec": str(data), "label": "pendulum-random-tiny"}],
                           "algorithms": {"BC": {}, "TD3PlusBC": {}, "IQL": {}}, "seeds": [0, 1], "steps": steps,
                           "eval": {"every": steps // 4, "episodes": 2}, "log_every": 100, "threads_per_run": 1},
                          source="render_reports.py")
    sweep_dir = out / "sweep"
    results = run_sweep(config, backend="local", workers=2, out=sweep_dir, progress=False)
    print(f"sweep: {len(results)} runs ({time.time() - started:.0f} s)", flush=True)
    seed0 = results[results["seed"] == 0]
    models = {row.variant: Path(row.dir) / "model.pt" for row in seed0.itertuples()}
    policies = {name: offrl.load(path, device="cpu") for name, path in models.items()}
    dataset = load(str(data))
    estimators = ["FQE", "PDIS", "WPDIS", "DR", "WDR"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ope.OPEWarning)
        report = ope.benchmark("Pendulum-v1", dataset, policies, gamma=0.99, n_rollouts=rollouts,
                               estimators=estimators, fqe_params={"n_steps": fqe_steps, "device": "cpu"},
                               n_bootstrap=500)
    report.metadata["data value"] = logged_value(dataset, 0.99)
    report.to_html(sweep_dir / "ope.html", title="Off-policy evaluation of the sweep's policies")
    write_report(sweep_dir, title="render-reports: BC, TD3+BC and IQL on a tiny Pendulum dataset",
                 extra_html=_ope_section(report), extra_summary=_ope_summary_html(report))
    print(f"OPE and the sweep pages ({time.time() - started:.0f} s)", flush=True)
    cli_out = out / "ope-cli"
    argv = ["ope", "--dataset", str(data), "--estimators", ",".join(estimators), "--fqe-steps", str(fqe_steps),
            "--env", "Pendulum-v1", "--true-values", "--n-rollouts", str(rollouts), "--device", "cpu",
            "--out", str(cli_out)]
    for name, path in models.items():
        argv += ["--policy", f"{name}={path}"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ope.OPEWarning)
        code = cli_main(argv)
    if code != 0:
        raise SystemExit(f"offrl ope failed (exit {code})")
    print(f"the offrl ope page ({time.time() - started:.0f} s)", flush=True)
    return {"sweep report.html": sweep_dir / "report.html", "ope.html": sweep_dir / "ope.html",
            "offrl ope report.html": cli_out / "report.html"}


def render(pages: dict[str, Path], shots: Path, binary: str) -> list[dict]:
    """Measure and screenshot every page; one dict per page."""
    rows = []
    for name, page in pages.items():
        values = measure(binary, page)
        height = int(min(max(values["heightClosed"], 600), MAX_HEIGHT))
        stem = re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")
        png = screenshot(binary, page, shots / f"{stem}.png", height)
        rows.append({"page": name, "path": str(page), "screenshot": str(png), **values})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="offrl-results/render-reports", help="folder for the runs and screenshots")
    parser.add_argument("--pages", nargs="+", default=None, help="render these existing pages instead")
    parser.add_argument("--steps", type=int, default=600, help="gradient steps per training run")
    args = parser.parse_args(argv)
    binary = find_chromium()
    if binary is None:
        print("render_reports: skipped: no Chromium found (install Debian's package: apt-get install chromium)")
        return 0
    out = Path(args.out)
    if args.pages:
        pages = {Path(p).parent.name + "/" + Path(p).name: Path(p) for p in args.pages}
        missing = [str(p) for p in pages.values() if not p.is_file()]
        if missing:
            raise SystemExit(f"no such page: {', '.join(missing)}")
    else:
        pages = make_pages(out, steps=args.steps)
    rows = render(pages, out / "screenshots", binary)
    bad = 0
    print(f"\n{'page':<24} {'scrollWidth':>11} {'window':>6} {'sideways':>8} {'summary top':>11} {'height':>7}  screenshot")
    for row in rows:
        no_summary = row["summaryTop"] is None or row["summaryTop"] > 200
        bad += int(row["overflow"] or no_summary)
        print(f"{row['page']:<24} {row['scrollWidth']:>11} {row['clientWidth']:>6} "
              f"{'YES' if row['overflow'] else 'no':>8} {str(row['summaryTop']):>11} {row['heightClosed']:>7}  "
              f"{row['screenshot']}")
        if row["overflow"]:
            print(f"    widest element: {row['widestElement']} (right edge {row['widestRight']} px)")
    with open(out / "screenshots" / "measured.json", "w") as f:
        json.dump(rows, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
