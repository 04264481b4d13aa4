"""`pdserve serve`'s topology rule (`cli.topology`): for given hardware descriptions it picks what its documented
rule says, and `serve` says which and why before it starts anything."""
import subprocess
import sys

import pytest

from pdserve_server.cli.topology import Hardware, Topology, choose_topology


@pytest.mark.parametrize("hw, kw, want", [
    # CPU: colocated, whatever the core count (the phases would share the same cores and memory bandwidth).
    (Hardware("cpu", 2), {}, Topology(True, 0, 1, (), "")),
    (Hardware("cpu", 64), {"num_decode": 2}, Topology(True, 0, 2, (), "")),
    # Forced either way; --num-prefill given means disaggregated.
    (Hardware("cpu", 2), {"forced": "disaggregated"}, Topology(False, 1, 1, (), "")),
    (Hardware("cpu", 2), {"num_prefill": 2, "num_decode": 2}, Topology(False, 2, 2, (), "")),
    (Hardware("cpu", 2), {"num_prefill": 0}, Topology(False, 0, 1, (), "")),
    (Hardware("cuda:0", 16, 8), {"forced": "colocated"}, Topology(True, 0, 1, ("cuda:0",), "")),
    # One GPU: one device is not split between the phases.
    (Hardware("cuda", 16, 1), {}, Topology(True, 0, 1, ("cuda:0",), "")),
    (Hardware("cuda:1", 16, 1), {}, Topology(True, 0, 1, ("cuda:1",), "")),  # cuda:1 of 2: one visible from it
    # A GPU for each phase: disaggregated, each worker on its own device(s).
    (Hardware("cuda", 16, 2), {}, Topology(False, 1, 1, ("cuda:0", "cuda:1"), "")),
    (Hardware("cuda:2", 16, 6), {"num_decode": 3}, Topology(False, 1, 3, ("cuda:2", "cuda:3", "cuda:4", "cuda:5"),
                                                                "")),
    (Hardware("cuda", 16, 4), {"tensor_parallel_size": 2}, Topology(False, 1, 1, ("cuda:0", "cuda:2"), "")),
    # Too few GPUs for TP 2 per worker: colocated on the first two.
    (Hardware("cuda", 16, 3), {"tensor_parallel_size": 2}, Topology(True, 0, 1, ("cuda:0",), "")),
    # Forced apart on one GPU: both workers share the device --device names.
    (Hardware("cuda", 16, 1), {"forced": "disaggregated"}, Topology(False, 1, 1, (), "")),
])
def test_the_rule_picks_what_it_documents(hw, kw, want):
    got = choose_topology(hw, **kw)
    assert (got.colocated, got.num_prefill, got.num_decode, got.devices) == (
        want.colocated, want.num_prefill, want.num_decode, want.devices)
    assert got.why  # every choice says why


def test_the_reason_names_what_decided():
    assert "CPU host (2 cores)" in choose_topology(Hardware("cpu", 2)).why
    assert choose_topology(Hardware("cpu", 2), forced="disaggregated").why == "--disaggregated"
    assert "--num-prefill 2" in choose_topology(Hardware("cpu", 2), num_prefill=2).why
    assert "2 GPUs" in choose_topology(Hardware("cuda", 8, 2)).why


def test_colocated_with_prefill_workers_is_refused():
    with pytest.raises(ValueError, match="--colocated runs no prefill workers"):
        choose_topology(Hardware("cpu", 2), forced="colocated", num_prefill=1)


def test_serve_refuses_contradictory_flags_in_one_line():
    both = subprocess.run([sys.executable, "-m", "pdserve_server.cli.main", "serve", "--colocated", "--disaggregated"],
                          capture_output=True, text=True, timeout=120)
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
    prefill = subprocess.run([sys.executable, "-m", "pdserve_server.cli.main", "serve", "--colocated",
                              "--num-prefill", "2", "--model", "/nowhere-at-all"], capture_output=True, text=True, timeout=120)
    assert prefill.returncode == 1 and prefill.stderr.strip().splitlines() == [
        "pdserve serve: --colocated runs no prefill workers; leave out --num-prefill (or use --disaggregated)"]
