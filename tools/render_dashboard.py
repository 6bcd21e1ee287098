"""Renders the "kvtier overview" dashboard from real data, for docs/observability.md.

Grafana cannot be installed here, so this runs each panel's own queries against a
real Prometheus and draws them with matplotlib, laid out on the dashboard's grid.
Two steps, because matplotlib is not part of the project's venv:

    # 1. collect (project venv): a tier, vLLM (a tiny Qwen2.5-VL) with the KV and the
    #    encoder-cache connectors and Prometheus, under a few minutes of mixed text and
    #    image traffic; every panel's query_range saved as JSON
    .venv/bin/python -P tools/render_dashboard.py collect /tmp/kvtier-overview.json

    # 2. plot (any Python with matplotlib==3.10.7, e.g. a throw-away venv)
    python3 -m venv /tmp/render && /tmp/render/bin/pip install matplotlib==3.10.7
    /tmp/render/bin/python tools/render_dashboard.py plot /tmp/kvtier-overview.json docs/img/kvtier-overview.png
"""

from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RATE_INTERVAL = "30s"
STEP_S = 2.0


def collect(out: Path, seconds: float) -> None:
    from kvtier.testing.queries import concrete, dashboards
    from kvtier.testing.servers import Prometheus, VllmServer
    from kvtier.testing.tierproc import TierProcess
    from kvtier.testing.tinymodels import build_vl_model, prompt_text

    work = Path(tempfile.mkdtemp(prefix="kvtier-render-"))
    # A small RAM tier: evictions, then disk hits and promotions show up.
    tier = TierProcess.start(work / "tier", "--ram-bytes", "4MiB")
    engine = prom = None
    try:
        # A tiny Qwen2.5-VL with both connectors (KV and encoder output), so the
        # encoder-cache panel has data too.
        engine = VllmServer.start(
            build_vl_model(work / "model"), work / "vllm", tier.target, model_name="tiny-qwen2-5-vl", encoder_cache=True
        )
        prom = Prometheus.start(work / "prometheus", {"kvtier": tier.metrics_url, "vllm": engine.metrics_url})
        prom.wait_scraped("kvtier_server_serving")
        start = time.time()
        rng = random.Random(0)
        seen: list[int] = []
        images = 0
        while time.time() - start < seconds:
            if rng.random() < 0.5:
                # Text: mostly repeats of earlier prompts (hits), some new ones (misses).
                seed = rng.choice(seen) if seen and rng.random() < 0.7 else len(seen)
                if seed == len(seen):
                    seen.append(seed)
                engine.complete(prompt_text(rng.choice((300, 600, 900)), seed=seed))
            else:
                # One picture and a short question (no full KV chunk): mostly pictures
                # seen before. A repeat still in vLLM's own encoder cache is asked of the
                # tier but served from there (a lookup, not a hit); older ones load from
                # the tier (hits).
                image = rng.randrange(images) if images and rng.random() < 0.7 else images
                images = max(images, image + 1)
                engine.chat(prompt_text(rng.choice((10, 40)), seed=1000 + image), image_seed=image)
        time.sleep(3)
        end = time.time()
        panels = []
        for panel in dashboards()["kvtier-overview"]["panels"]:
            entry: dict[str, Any] = {
                k: panel[k] for k in ("title", "type", "gridPos") if k in panel
            }
            entry["unit"] = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
            entry["series"] = []
            for target in panel.get("targets", []):
                for result in prom.query_range(concrete(target["expr"], RATE_INTERVAL, "1h"), start, end, STEP_S):
                    legend = re.sub(
                        r"\{\{\s*(\w+)\s*\}\}", lambda m, r=result: r["metric"].get(m.group(1), ""), target["legendFormat"]
                    ).strip()
                    entry["series"].append(
                        {"legend": legend, "t": [float(t) - start for t, _ in result["values"]],
                         "v": [float(v) for _, v in result["values"]]}
                    )  # fmt: skip
            panels.append(entry)
        out.write_text(json.dumps({"seconds": end - start, "rate_interval": RATE_INTERVAL, "panels": panels}))
        print(f"wrote {out} ({len(panels)} panels, {end - start:.0f} s of traffic; work dir {work})")
    finally:
        for proc in (prom, engine):
            if proc is not None:
                proc.stop()
        tier.stop()


def _fmt(unit: str, value: float) -> str:
    if value != value:  # NaN
        return "n/a"
    if unit == "percentunit":
        return f"{value * 100:.1f}%"
    if unit in ("Bps", "bytes"):
        for scale, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
            if abs(value) >= scale:
                return f"{value / scale:.1f} {name}{'/s' if unit == 'Bps' else ''}"
        return f"{value:.0f} B{'/s' if unit == 'Bps' else ''}"
    if unit == "s":
        return f"{value * 1000:.1f} ms"
    return f"{value:.3g}"


def plot(data_file: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    data = json.loads(data_file.read_text())
    panels = data["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig = plt.figure(figsize=(24, rows * 0.55), facecolor="#111217")
    grid = fig.add_gridspec(rows, 24, hspace=1.6, wspace=0.9, left=0.03, right=0.99, top=0.97, bottom=0.02)
    fig.suptitle(
        f"kvtier overview - rendered from a live Prometheus ({data['seconds']:.0f} s of traffic, "
        f"rate interval {data['rate_interval']}); panels' own queries, drawn with matplotlib",
        color="white", fontsize=13,
    )  # fmt: skip
    for p in panels:
        g = p["gridPos"]
        if p["type"] == "row":
            ax = fig.add_subplot(grid[g["y"] : g["y"] + 1, :])
            ax.axis("off")
            ax.text(0, 0.2, p["title"], color="#ccccdc", fontsize=14, fontweight="bold", transform=ax.transAxes)
            continue
        ax = fig.add_subplot(grid[g["y"] + 1 : g["y"] + g["h"], g["x"] : g["x"] + g["w"]])
        ax.set_facecolor("#181b1f")
        for side in ax.spines.values():
            side.set_color("#333")
        ax.set_title(p["title"], color="#ccccdc", fontsize=10, loc="left")
        ax.tick_params(colors="#999", labelsize=7)
        if p["type"] == "stat":
            ax.set_xticks([])
            ax.set_yticks([])
            values = [s["v"][-1] for s in p["series"] if s["v"]]
            text = _fmt(p["unit"], values[0]) if values else ("0" if p["unit"] in ("none", "reqps") else "No data")
            ax.text(0.5, 0.45, text, color="#73bf69", fontsize=22, ha="center", va="center", transform=ax.transAxes)
            continue
        for s in p["series"]:
            ax.plot(s["t"], s["v"], linewidth=1.2, label=s["legend"] or "value")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _, u=p["unit"]: _fmt(u, v)))
        ax.set_xlabel("seconds", color="#999", fontsize=7)
        if p["series"]:
            ax.legend(fontsize=6, loc="upper left", facecolor="#181b1f", labelcolor="#ccccdc", framealpha=0.6)
        else:
            ax.text(0.5, 0.5, "0 (nothing happened)", color="#999", ha="center", va="center", transform=ax.transAxes)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=60, facecolor=fig.get_facecolor())
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="run a tier, vLLM and Prometheus under load; save the panels' data")
    c.add_argument("out", type=Path)
    c.add_argument("--seconds", type=float, default=180.0, help="how long to send traffic")
    p = sub.add_parser("plot", help="draw the saved data as a PNG")
    p.add_argument("data", type=Path)
    p.add_argument("out", type=Path)
    args = parser.parse_args()
    if args.cmd == "collect":
        collect(args.out, args.seconds)
    else:
        plot(args.data, args.out)


if __name__ == "__main__":
    main()
