"""The planner's P:D split against an exhaustive sweep in the simulator (the planner's acceptance check).

For each trace (a mix of prompt and output lengths, `bench/cluster_sim.py`'s generator), the planner
(`engine.mock.planner.best_split`, fed the trace's mean prompt and output lengths and its 99th-percentile context,
no prefix hits assumed, and the batch a decode worker's KV pool holds, `kv_batch_limit`) picks the
split of `--workers` workers with the most goodput at the objectives; then `cluster_sim.py` runs every split
(1..N-1 prefill workers, the rest decode) on the same trace and measures goodput: requests/s that met both the TTFT
and the TPOT objective, with the coordinator's local prefill off (every prompt goes to a prefill worker: the split
alone). Reports, per trace, the measured goodput of each split and the planner's choice's share of
the best.

The mock workers run slower than the profile's device (`--speedup 0.1` by default: ten times its step times), so
that a handful of workers saturates at arrival rates this machine's cores can relay and check.

    python bench/planner_check.py [--workers 4] [--duration-s 60] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import cluster_sim  # noqa: E402

# name -> cluster_sim flags: the trace's shape (its rate comes from the planner, below)
TRACES = {
    "chat": ["--prompt-median", "512", "--output-min", "16", "--output-max", "256", "--followups", "0.3"],
    "long-prompts": ["--prompt-median", "2048", "--output-min", "16", "--output-max", "64", "--followups", "0"],
    "long-outputs": ["--prompt-median", "128", "--output-min", "128", "--output-max", "512", "--followups", "0"],
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--profile", default="llama-3.1-8b-h200")
    p.add_argument("--speedup", type=float, default=0.1)
    p.add_argument("--ttft-slo-ms", type=float, default=3000.0)
    p.add_argument("--tpot-slo-ms", type=float, default=150.0)
    p.add_argument("--load", type=float, default=0.8,
                   help="offered rate as a share of the best split's predicted goodput")
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--traces", nargs="+", default=list(TRACES), choices=list(TRACES))
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)

    from pdserve_server.engine.mock.planner import Objectives, Traffic, best_split, kv_batch_limit, split_goodputs
    from pdserve_server.engine.mock.step_model import load_profile

    model = load_profile(a.profile).scaled(a.speedup)
    objectives = Objectives(a.ttft_slo_ms, a.tpot_slo_ms)
    doc = dict(args={k: str(v) for k, v in vars(a).items()}, traces={})
    for name in a.traces:
        shape = TRACES[name] + ["--duration-s", str(a.duration_s), "--profile", a.profile,
                                "--speedup", str(a.speedup), "--ttft-slo-ms", str(a.ttft_slo_ms),
                                "--tpot-slo-ms", str(a.tpot_slo_ms),
                                # the split alone: no decode worker prefills (conditional disaggregation is another
                                # rule, not modelled by the planner)
                                "--coordinator-args", "--no-local-prefill-queue --no-local-prefill-fallback"]
        probe = cluster_sim.parser().parse_args(shape + ["--rate", "1"])
        reqs = cluster_sim.build_requests(probe, 49152, frozenset())  # lengths only: the means the planner needs
        prompt = statistics.fmean(len(r[1]) for r in reqs)
        output = statistics.fmean(r[2] for r in reqs)
        longest = statistics.quantiles([len(r[1]) + r[2] for r in reqs], n=100)[98]  # p99 context
        traffic = Traffic(1.0, prompt, output, max_context=longest)
        limit = kv_batch_limit(probe.kv_tokens, traffic)  # the workers' pools: cluster_sim's --kv-tokens
        predicted = {p_: g for p_, _, g in split_goodputs(model, model, traffic, objectives, a.workers,
                                                         max_batch=limit)}
        rate = a.load * max(predicted.values())
        choice = best_split(model, model, Traffic(rate, prompt, output, max_context=longest), objectives, a.workers,
                            max_batch=limit)
        print(f"{name}: mean prompt {prompt:.0f}, output {output:.0f} tokens; predicted goodput by prefill workers "
              f"{ {k: round(v, 2) for k, v in predicted.items()} }; offered {rate:.2f} req/s; planner: "
              f"{choice[0]} prefill + {choice[1]} decode", flush=True)
        measured = {}
        for p_ in range(1, a.workers):
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cluster_sim.main(shape + ["--rate", f"{rate:.4f}", "--prefill", str(p_),
                                          "--decode", str(a.workers - p_), "--out", f.name])
                run = json.loads(Path(f.name).read_text())
            measured[p_] = run["goodput"]
            print(f"  {p_} prefill + {a.workers - p_} decode: goodput {run['goodput']:.2f} req/s "
                  f"({run['within_slo']} of {run['requests']} within both objectives; wrong {run['wrong']}, "
                  f"failed {run['failed']}, hung {run['hung']})", flush=True)
        best = max(measured.values())
        share = measured[choice[0]] / best if best else 0.0
        print(f"  planner's split: {share:.2f} of the best measured goodput", flush=True)
        doc["traces"][name] = dict(prompt=prompt, output=output, rate=rate, predicted=predicted, max_batch=limit,
                                   planner=list(choice[:2]), measured=measured, share=share)
        if a.out:
            a.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
