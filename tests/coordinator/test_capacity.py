"""The coordinator's capacity planner (`coordinator.capacity`, `--planner-profile`): the traffic of a window of
finished requests, the planner's cheapest split for it as Prometheus gauges, and served: a coordinator exporting
them for what it relayed."""
import json

import pytest
from prometheus_client import CollectorRegistry

from pdserve_server.coordinator.capacity import MIN_REQUESTS, CapacityPlanner, TrafficWindow
from pdserve_server.coordinator.record import RequestRecord
from pdserve_server.engine.mock.planner import Objectives, minimal_split
from pdserve_server.engine.mock.step_model import StepTimeModel

# test_mock_engine's hand-plannable model: a decode step 10 ms at any batch, a prefill token 0.01 ms
FLAT = StepTimeModel(decode=(10.0, 0.0, 0.0, 0.0), mixed=(0.0, 0.01, 0.0, 0.0, 0.0, 0.0, 0.0))


def record(prompt=1000, output=100, cached=0, error=""):
    return RequestRecord("r", prompt_tokens=prompt, output_tokens=output, cached_tokens=cached, error_code=error)


def test_the_window_measures_rate_lengths_and_cache_share_over_its_last_seconds():
    w = TrafficWindow(window_s=10.0)
    w.started = 0.0
    for i in range(MIN_REQUESTS - 1):
        w.add(record(), now=float(i))
    w.add(record(error="UNAVAILABLE"), now=4.5)  # failures are not traffic served
    assert w.traffic(now=5.0) is None  # too few to plan on
    w.add(record(prompt=3000, output=300, cached=1500), now=5.0)
    t = w.traffic(now=5.0)
    assert t.rate == pytest.approx(5 / 5.0)  # over the 5 s since start: shorter than the window
    assert (t.prompt_tokens, t.output_tokens) == (pytest.approx(1400), pytest.approx(140))
    assert t.prefix_hit == pytest.approx(1500 / 7000) and t.max_context == 3300
    assert w.traffic(now=12.5) is None  # the first three left the window


def test_the_planner_exports_the_cheapest_split_and_says_when_none_fits(tmp_path):
    profile = tmp_path / "flat.json"
    profile.write_text(json.dumps(FLAT.to_json()))
    registry = CollectorRegistry()
    planner = CapacityPlanner(str(profile), ttft_ms=20.0, itl_ms=12.0, max_workers=8, window_s=1.0,
                              registry=registry, model_name="m")
    gauge = lambda role: registry.get_sample_value("pdserve:planner_recommended_workers",  # noqa: E731
                                                   {"model_name": "m", "role": role})
    assert planner.plan(now=planner.window.started + 0.5) == (0, 0) and gauge("decode") == 0  # nothing seen yet
    start = planner.window.started
    for i in range(100):  # 100 requests/s of 1,000 prompt and 100 output tokens
        planner.window.add(record(), now=start + 1.0 + i / 100)
    expected = minimal_split(FLAT, FLAT, planner.window.traffic(now=start + 2.0), Objectives(20.0, 12.0), 8)
    assert planner.plan(now=start + 2.0) == (expected.prefill, expected.decode) == (2, 1)
    assert (gauge("prefill"), gauge("decode")) == (2, 1)
    assert registry.get_sample_value("pdserve:planner_arrival_rate", {"model_name": "m"}) == pytest.approx(100)
    planner.objectives = Objectives(20.0, 9.0)  # a 10 ms step never meets 9 ms: no split does
    assert planner.plan(now=start + 2.0) == (-1, -1) and gauge("prefill") == -1
    with pytest.raises(ValueError, match="profile"):
        CapacityPlanner("no-such-profile", 20.0, 12.0, 8, 1.0, CollectorRegistry(), "m")


@pytest.mark.e2e
def test_a_served_coordinator_exports_the_split_for_the_traffic_it_relays(tiny_model_dir, launch):
    from helpers import greedy, scrape_when, total
    from pdserve import Client

    c = launch(tiny_model_dir, worker_args=["--dtype", "float32"],
               coordinator_args=["--metrics-port", "0", "--planner-profile", "llama-3.1-8b-h200",
                                 "--planner-window-s", "20", "--planner-ttft-ms", "2000", "--planner-itl-ms", "50"])
    with Client(c.address) as client:
        for i in range(MIN_REQUESTS + 1):
            client.complete([5, 6, 7, 8 + i], greedy(3))
    url = c.metrics_urls["coordinator"]
    samples = scrape_when(url, "pdserve:planner_recommended_workers", 2, timeout_s=60)  # re-planned every 5 s
    # a few short requests a second: one prefill and one decode worker of the 8B-on-H200 profile carry them
    assert total(samples, "pdserve:planner_recommended_workers", role="prefill") == 1
    assert total(samples, "pdserve:planner_recommended_workers", role="decode") == 1
    assert total(samples, "pdserve:planner_arrival_rate") > 0
