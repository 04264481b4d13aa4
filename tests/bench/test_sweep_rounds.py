"""The sweep's rounds (bench/interleave.py): the order reversed each round, medians over rounds, and each pdserve
system against the better peer per level. Pure functions on made-up rows: no process starts."""
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from interleave import combine, head_to_head, round_order  # noqa: E402


def row(conc, tok_s, ttft_p99=100.0, itl_p99=10.0, **extra):
    return {"concurrency": conc, "completed": 4, "failed": 0, "output_tokens": 40, "duration_s": 40 / tok_s,
            "output_tok_s": tok_s, "ttft_ms_p99": ttft_p99, "itl_ms_p99": itl_p99, **extra}


def test_each_round_reverses_the_order_so_every_system_has_the_same_mean_position():
    order = round_order(["a", "b", "c"], 4)
    assert [x for _, x in order] == list("abccbaabccba")
    assert [r for r, _ in order] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    positions = {x: [i % 3 for i, (_, y) in enumerate(order) if y == x] for x in "abc"}
    assert len({sum(p) for p in positions.values()}) == 1
    assert round_order(["a", "b"], 1) == [(0, "a"), (0, "b")]  # one round: the plan as given
    with pytest.raises(ValueError, match="at least 1"):
        round_order(["a"], 0)


def test_rounds_combine_into_medians_with_counts_summed():
    rounds = [[row(1, 10.0, itl_p99=8.0), row(16, 100.0)],
              [row(1, 14.0, itl_p99=12.0, errors=["timeout"]), row(16, 90.0)],
              [row(1, 11.0, itl_p99=9.0)]]  # the third round did not reach c=16
    one, sixteen = combine(rounds)
    assert (one["concurrency"], one["rounds"], one["output_tok_s"], one["itl_ms_p99"]) == (1, 3, 11.0, 9.0)
    assert (one["completed"], one["output_tokens"]) == (12, 120) and one["errors"] == ["timeout"]
    assert (sixteen["rounds"], sixteen["output_tok_s"], sixteen["completed"]) == (2, 95.0, 8)
    assert "errors" not in sixteen
    nan_rows = [[{**row(1, 5.0), "ttft_ms_p99": float("nan")}]]  # a level whose requests all failed has NaNs
    assert math.isnan(combine(nan_rows)[0]["ttft_ms_p99"])


def test_head_to_head_takes_the_better_peer_per_level_and_leaves_out_the_naive_floor():
    systems = {"llamacpp": [row(1, 50.0, ttft_p99=200.0), row(64, 100.0)],
               "vllm": [row(1, 40.0), row(64, 160.0, itl_p99=20.0)],
               "naive": [row(1, 500.0)],  # a baseline never counts as the peer to beat
               "serve": [row(1, 55.0, ttft_p99=100.0), row(64, 120.0, itl_p99=30.0), row(4, 30.0)]}
    out = head_to_head(systems, lambda name: name == "serve")
    assert set(out) == {"serve"} and set(out["serve"]) == {1, 64}  # c=4: no peer ran it
    assert out["serve"][1]["peer"] == "llamacpp" and out["serve"][1]["ratio"] == pytest.approx(1.1)
    assert out["serve"][1]["ttft_p99_ratio"] == pytest.approx(0.5)
    assert out["serve"][64]["peer"] == "vllm" and out["serve"][64]["ratio"] == pytest.approx(0.75)
    assert out["serve"][64]["itl_p99_ratio"] == pytest.approx(1.5)
    failed_peer = {"vllm": [{**row(1, 90.0), "completed": 0}], "serve": [row(1, 10.0)]}
    assert head_to_head(failed_peer, lambda name: name == "serve") == {}  # a peer with nothing completed is no peer


def test_the_report_names_the_rounds_and_each_rounds_ratio():
    from report import markdown

    per_round = [{"llamacpp": [row(1, 50.0)], "serve": [row(1, 60.0)]},
                 {"llamacpp": [row(1, 50.0)], "serve": [row(1, 50.0)]}]
    systems = {name: combine([r[name] for r in per_round]) for name in ("llamacpp", "serve")}
    ours = "serve".__eq__
    results = {"config": {"model": "m", "input_len": 100, "output_len": 75, "range_ratio": 0.0, "num_requests": 16,
                          "slo_ttft_ms": 2000.0, "slo_tpot_ms": 150.0, "rounds": 2},
               "systems": systems, "versus_peers": {"combined": head_to_head(systems, ours),
                                                    "rounds": [head_to_head(r, ours) for r in per_round]}}
    text = markdown(results)
    assert "in each of 2 rounds (order reversed each round" in text
    assert "- serve: c=1: 1.10x llamacpp [1.20, 1.00]" in text
