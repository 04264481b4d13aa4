"""The chaos suite's short form (bench/chaos.py runs it long): one round of load on a 2P+2D cluster while workers
are killed, paused and restarted, the coordinator restarts, Aborts storm, readers stall, a burst of 256 streams
arrives, garbage hits a KV port and malformed bodies hit the API. Afterwards: no leaked KV block, pools intact, no
stream left hanging, and every request that finished has the reference greedy output."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

pytestmark = pytest.mark.e2e


def test_one_chaos_round_leaks_nothing_and_hangs_nobody(tiny_model_dir):
    import chaos

    # Counted events, not seconds: one round that goes on until each of the 7 kinds of fault was injected (one
    # cycle of them) and 21 requests finished OK (bounded), however fast or busy the machine.
    report = chaos.run(str(tiny_model_dir), seconds=1, round_s=1, clients=4, fault_period_s=2, seed=1,
                       min_faults=7, min_ok=21, max_round_s=900)
    print(report)
    assert report["hung"] == 0, report
    assert report["wrong_outputs"] == 0, report
    assert report["leaked_blocks"] == [0] and report["integrity_ok"], report
    assert report["outcomes"].get("ok", 0) > 20 and len(report["faults"]) == 7, report  # every kind of fault
    allowed = {"ok", "cancelled", "aborted", "UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED",
               "malformed:INVALID_ARGUMENT", "malformed:UNAVAILABLE"}
    assert set(report["outcomes"]) <= allowed, report  # clean statuses only: no UNKNOWN, INTERNAL, "no final"
