"""Render the Grafana dashboard's panels from a real run, and one real trace as a waterfall.

Starts a disaggregated cluster with /metrics on every process and traces exported to an in-process OTLP sink,
scrapes it with a real Prometheus (Debian's `prometheus` package: apt-get install prometheus), drives a load that
ramps concurrency (with shared prompt prefixes, so the prefix cache has hits), then evaluates every query of
deploy/grafana/pdserve-dashboard.json against Prometheus' HTTP API and plots the panels with matplotlib (Grafana is
not installable here), and draws one request's spans across the three processes.

    .venv/bin/python bench/observability_demo.py [--out docs/observability] [--seconds 120]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from observe import OtlpSink  # noqa: E402

TRACE_ID, CLIENT_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_prometheus(targets: dict[str, str], workdir: Path) -> tuple[subprocess.Popen, str]:
    """Prometheus scraping each 'name -> http://host:port/metrics' every 2 s; returns (process, API base URL)."""
    port = free_port()
    jobs = [{"job_name": name, "scrape_interval": "2s",
             "static_configs": [{"targets": [urllib.parse.urlparse(url).netloc], "labels": {"process": name}}]}
            for name, url in targets.items()]
    config = workdir / "prometheus.yml"
    config.write_text(json.dumps({"global": {"scrape_interval": "2s"}, "scrape_configs": jobs}))  # YAML ⊃ JSON
    proc = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=open(workdir / "prometheus.log", "w"))
    base = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(f"{base}/-/ready", timeout=1)
            return proc, base
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("prometheus did not start; see its log in " + str(workdir))


async def drive_load(address: str, seconds: float) -> int:
    """Concurrency ramps 1 -> 4 -> 12 -> 4 over `seconds`; half the prompts share a 64-token prefix."""
    from pdserve import AsyncClient, SamplingParams

    rng = random.Random(0)
    prefix = [rng.randrange(100, 40000) for _ in range(64)]
    done = 0
    deadline = time.monotonic() + seconds
    phases = [1, 4, 12, 4]

    async def one(client) -> None:
        nonlocal done
        body = [rng.randrange(100, 40000) for _ in range(rng.randint(16, 96))]
        prompt = prefix + body if rng.random() < 0.5 else body
        await client.complete(prompt, SamplingParams(max_tokens=rng.randint(8, 48), temperature=0, ignore_eos=True))
        done += 1

    async with AsyncClient(address) as client:
        await client.complete([5, 6, 7], SamplingParams(max_tokens=4, temperature=0), request_id="traced",
                              metadata=[("traceparent", f"00-{TRACE_ID}-{CLIENT_SPAN}-01")])
        for i, conc in enumerate(phases):
            phase_end = time.monotonic() + seconds / len(phases)

            async def worker():
                while time.monotonic() < min(phase_end, deadline):
                    await one(client)
            await asyncio.gather(*(worker() for _ in range(conc)))
    return done


def query_range(base: str, expr: str, start: float, end: float) -> list[tuple[str, list, list]]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": 2})
    data = json.loads(urllib.request.urlopen(f"{base}/api/v1/query_range?{params}", timeout=30).read())["data"]
    return [(json.dumps(r["metric"]), [float(t) - start for t, _ in r["values"]],
             [float(v) for _, v in r["values"]]) for r in data["result"]]


def legend(template: str, labels: dict) -> str:
    for k, v in labels.items():
        template = template.replace("{{" + k + "}}", v)
    return template


def plot_dashboard(base: str, start: float, end: float, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dashboard = json.loads((ROOT / "deploy" / "grafana" / "pdserve-dashboard.json").read_text())
    panels = dashboard["panels"]
    fig, axes = plt.subplots((len(panels) + 1) // 2, 2, figsize=(14, 3.2 * ((len(panels) + 1) // 2)))
    for ax, panel in zip(axes.flat, panels):
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "20s").replace('model_name=~"$model"',
                                                                             'model_name=~".*"')
            for metric, xs, ys in query_range(base, expr, start, end):
                ax.plot(xs, ys, label=legend(target["legendFormat"], json.loads(metric)))
        ax.set_title(f"{panel['title']} ({panel['fieldConfig']['defaults']['unit']})", fontsize=10)
        ax.set_xlabel("seconds into the run", fontsize=8)
        ax.tick_params(labelsize=8)
        if ax.lines:
            ax.legend(fontsize=7, loc="upper right")
    fig.suptitle("pdserve dashboard panels (deploy/grafana/pdserve-dashboard.json) from Prometheus, real run")
    fig.tight_layout()
    fig.savefig(out, dpi=80)


def plot_trace(spans: list, out: Path) -> list[dict]:
    """A waterfall of one trace's spans (one row per span, colored by process); returns them as rows."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [(svc, s) for svc, s in spans if s.trace_id.hex() == TRACE_ID]
    t0 = min(s.start_time_unix_nano for _, s in mine)
    rows = sorted(({"service": svc, "name": s.name, "start_ms": (s.start_time_unix_nano - t0) / 1e6,
                    "duration_ms": (s.end_time_unix_nano - s.start_time_unix_nano) / 1e6,
                    "span": s.span_id.hex(), "parent": s.parent_span_id.hex()} for svc, s in mine),
                  key=lambda r: (r["start_ms"], -r["duration_ms"]))
    colors = {"pdserve-coordinator": "tab:blue", "pdserve-prefill": "tab:orange", "pdserve-decode": "tab:green"}
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.2))
    for i, r in enumerate(rows):
        ax.barh(i, max(r["duration_ms"], 0.3), left=r["start_ms"], color=colors.get(r["service"], "gray"))
        ax.text(r["start_ms"] + r["duration_ms"] + 1, i, f"{r['name']}  {r['duration_ms']:.1f} ms",
                va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [r["service"].removeprefix("pdserve-") for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the trace's first span")
    ax.set_title(f"one Generate request, trace {TRACE_ID}")
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "observability"))
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--model-dir", default=None)
    args = p.parse_args()
    if shutil.which("prometheus") is None:
        print("needs prometheus on PATH (apt-get install prometheus)", file=sys.stderr)
        return 2
    from pdserve_server.cli.launcher import ServeConfig, start_cluster
    from pdserve_server.cli.models import resolve_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-obs-"))
    sink = OtlpSink()
    cluster = start_cluster(args.model_dir or str(resolve_model(None)), "SmolLM2-135M-Instruct",
                            ServeConfig(log_dir=str(workdir / "logs")), env=sink.env(OTEL_BSP_SCHEDULE_DELAY="500"),
                            worker_args=["--metrics-port", "0", "--threads", "1", "--kv-tokens", "4096"],
                            coordinator_args=["--metrics-port", "0"])
    prometheus, base = start_prometheus(cluster.metrics_urls, workdir)
    try:
        time.sleep(4)
        start = time.time()
        done = asyncio.run(drive_load(cluster.address, args.seconds))
        time.sleep(6)  # a last scrape and the last span exports
        end = time.time()
        plot_dashboard(base, start, end, out / "dashboard.png")
        rows = plot_trace(sink.spans, out / "trace.png")
    finally:
        prometheus.terminate()
        cluster.stop()
        sink.stop()
    (out / "trace.json").write_text(json.dumps(rows, indent=1))
    print(f"{done} requests in {end - start:.0f} s; {len(sink.spans)} spans; wrote {out}/dashboard.png, trace.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
