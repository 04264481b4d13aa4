"""The shipped Grafana dashboard (`deploy/grafana/pdserve-dashboard.json`) against a real Prometheus: a disaggregated
cluster serves traffic while Prometheus scrapes its three processes; the dashboard's `model` variable offers the
served model, and every panel's queries, with that model and Grafana's rate interval filled in, return data
(the worker panels were once empty for the model the dashboard offered).

Needs the `prometheus` server binary (Debian's package; scripts/test.sh installs it where it can); skipped, saying
so, without it."""
import json
import math
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from helpers import free_port
from pdserve import Client, SamplingParams

pytestmark = pytest.mark.e2e
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdserve-dashboard.json"
RATE_INTERVAL = "1m"  # $__rate_interval at a 1 s scrape interval: several samples in every window


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _query(base: str, expr: str) -> list[dict]:
    """The instant vector Prometheus returns for `expr` now (its HTTP API's /api/v1/query)."""
    out = _get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert out["status"] == "success", (expr, out)
    return out["data"]["result"]


def _has_data(result: list[dict]) -> bool:
    """At least one series with a number (a quantile over no observations is NaN: Grafana shows no value)."""
    return any(not math.isnan(float(s["value"][1])) for s in result)


def _panel_targets() -> dict[str, list[str]]:
    board = json.loads(DASHBOARD.read_text())
    return {p["title"]: [t["expr"] for t in p.get("targets", [])] for p in board["panels"]}


def _model_variable_query() -> str:
    board = json.loads(DASHBOARD.read_text())
    (var,) = [v for v in board["templating"]["list"] if v["name"] == "model"]
    return var["query"]


@pytest.fixture
def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.skip("no prometheus server binary on PATH (Debian: apt-get install prometheus; scripts/test.sh tries)")
    return path


def test_every_panel_shows_data_for_the_model_it_offers(prometheus_binary, tiny_model_dir, tmp_path, launch):
    # A host-memory KV tier: its counters exist (at 0) for the KV offload panel.
    cluster = launch(tiny_model_dir, worker_args=["--dtype", "float32", "--kv-tokens", "1024", "--max-model-len",
                                                  "256", "--connector", "tcp", "--metrics-port", "0",
                                                  "--kv-offload-cpu-bytes", str(2**20)],
                     coordinator_args=["--metrics-port", "0"])
    prom = None
    try:
        targets = [urllib.parse.urlsplit(u) for u in cluster.metrics_urls.values()]
        assert len(targets) == 3  # coordinator, prefill-0, decode-0
        config = tmp_path / "prometheus.yml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "pdserve", "metrics_path": targets[0].path,
                                "static_configs": [{"targets": [t.netloc for t in targets]}]}]}))
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        prom = subprocess.Popen([prometheus_binary, f"--config.file={config}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))
        deadline = time.monotonic() + 120
        while True:  # every target scraped at least once
            try:
                if len([s for s in _query(base, "up") if s["value"][1] == "1"]) == 3:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and prom.poll() is None, (tmp_path / "prometheus.log").read_text()
            time.sleep(0.5)

        prompts = [[7, 8, 9] * 6, [7, 8, 9] * 6, [11, 12] * 10]  # a repeat: prefix-cache hits
        panels = _panel_targets()
        missing: dict[str, list[str]] = dict(panels)
        model = None
        deadline = time.monotonic() + 300
        with Client(cluster.address) as client:
            while missing:  # traffic until every panel has data (bounded), as a dashboard watched live would
                for p in prompts:
                    client.complete(p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
                with pytest.raises(Exception):  # a failure, for the Failures panel: a prompt over the context
                    client.complete([5] * 300, SamplingParams(max_tokens=4))
                if model is None:
                    var = _model_variable_query()  # label_values(METRIC, LABEL)
                    metric, label = var[len("label_values("):-1].split(", ")
                    values = _get(f"{base}/api/v1/label/{label}/values?" + urllib.parse.urlencode(
                        {"match[]": metric}))["data"]
                    model = values[0] if values else None
                if model is not None:
                    for title, exprs in list(missing.items()):
                        filled = [e.replace("$model", model).replace("$__rate_interval", RATE_INTERVAL)
                                  for e in exprs]
                        if any(_has_data(_query(base, e)) for e in filled):
                            del missing[title]
                assert time.monotonic() < deadline, f"panels without data: {sorted(missing)}"
        assert model == "tiny"  # the variable offers the served model (every process labels it alike)
        roles = {s["metric"].get("role") for s in _query(base, 'sum by (role) (pdserve:num_requests_running'
                                                                 '{model_name=~"tiny"})')}
        assert {"prefill", "decode"} <= roles  # the worker panels carry the workers' series for that model
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(30)
