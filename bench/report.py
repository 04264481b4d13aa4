"""Render sweep results: a Markdown table per system and a four-panel PNG (E2E latency, ITL, output throughput and
the fraction of the machine against concurrency; one line per system), after seed 004's summary figure."""
from __future__ import annotations

from pathlib import Path

COLUMNS = [("concurrency", "conc", "{:d}"), ("completed", "done", "{:d}"), ("failed", "fail", "{:d}"),
           ("ttft_ms_p50", "TTFT p50", "{:.0f}"), ("ttft_ms_p90", "p90", "{:.0f}"), ("ttft_ms_p99", "p99", "{:.0f}"),
           ("itl_ms_p50", "ITL p50", "{:.1f}"), ("itl_ms_p90", "p90", "{:.1f}"), ("itl_ms_p99", "p99", "{:.1f}"),
           ("tpot_ms_p50", "TPOT p50", "{:.1f}"), ("tpot_ms_p90", "p90", "{:.1f}"), ("tpot_ms_p99", "p99", "{:.1f}"),
           ("e2e_ms_p50", "E2E p50", "{:.0f}"), ("e2e_ms_p99", "p99", "{:.0f}"),
           ("output_tok_s", "out tok/s", "{:.1f}"), ("req_s", "req/s", "{:.2f}"),
           ("goodput_req_s", "goodput", "{:.2f}"), ("machine_fraction", "frac", "{:.2f}"),
           ("bandwidth_fraction", "bw frac", "{:.2f}")]


def markdown(results: dict) -> str:
    """results: {"config": ..., "systems": {name: [level rows]}} -> Markdown (times in ms)."""
    cfg = results["config"]
    rounds = ("" if cfg.get("rounds", 1) == 1 else
              f" in each of {cfg['rounds']} rounds (order reversed each round; medians over them)")
    lines = [f"Model `{cfg['model']}`; workload {cfg.get('workload', 'docs')}, input {cfg['input_len']} / output "
             f"{cfg['output_len']} tokens "
             f"(range ratio {cfg['range_ratio']}); {cfg['num_requests']} requests per level{rounds}; SLO TTFT <= "
             f"{cfg['slo_ttft_ms']:.0f} ms, TPOT <= {cfg['slo_tpot_ms']:.0f} ms. Times in ms. frac: model FLOP/s over "
             f"the same-run dense GEMM rate in the system's dtype; bw frac (concurrency 1): weight bytes read per "
             f"second over the same-run copy bandwidth.", ""]
    for name, rows in results["systems"].items():
        lines += [f"**{name}**", "", "| " + " | ".join(c[1] for c in COLUMNS) + " |",
                  "|" + "---:|" * len(COLUMNS)]
        for r in rows:
            lines.append("| " + " | ".join(fmt.format(r[k]) if r.get(k) is not None and r[k] == r[k] else "-"
                                           for k, _, fmt in COLUMNS) + " |")
        lines.append("")
    for name, why in results.get("not_run", {}).items():
        lines += [f"**{name}**: not run: {why}", ""]
    versus = results.get("versus_peers", {})
    if versus.get("combined"):
        per_round = versus.get("rounds", [])
        lines.append("Against the better peer at each level (output tok/s ratio; TTFT p99 and ITL p99 ratios, below 1 "
                     "is better" + ("; each round's tok/s ratio in brackets" if per_round else "") + "):")
        lines.append("")
        for name, by_conc in versus["combined"].items():
            cells = []
            for conc, v in by_conc.items():
                per = [r[name][conc]["ratio"] for r in per_round if conc in r.get(name, {})]
                cells.append(f"c={conc}: {v['ratio']:.2f}x {v['peer']}" + (
                    " [" + ", ".join(f"{x:.2f}" for x in per) + "]" if per else "") +
                    f" (TTFT p99 {v['ttft_p99_ratio']:.2f}, ITL p99 {v['itl_p99_ratio']:.2f})")
            lines.append(f"- {name}: " + "; ".join(cells))
        lines.append("")
    ratios = results.get("ratios", {})
    if ratios:
        lines.append("Output-throughput ratio against the naive baseline at the same concurrency:")
        lines.append("")
        for name, by_conc in ratios.items():
            lines.append(f"- {name}: " + ", ".join(f"c={c}: {v:.1f}x" for c, v in by_conc.items()))
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("e2e_ms_p50", "E2E latency p50 (s)", 1e-3), ("itl_ms_p50", "ITL p50 (ms)", 1.0),
              ("output_tok_s", "output throughput (tok/s)", 1.0),
              ("machine_fraction", "fraction of the machine: o model FLOP/s / GEMM rate,\n"
                                   "x (c=1) weight bytes/s / copy bandwidth", 1.0)]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, title, scale) in zip(axes.flat, panels):
        for name, rows in results["systems"].items():
            (line,) = ax.plot([r["concurrency"] for r in rows], [r.get(key, float("nan")) * scale for r in rows],
                              marker="o", label=name)
            if key == "machine_fraction":  # the batch-1 bound, also for quantized weights (no GEMM baseline)
                bw = [(r["concurrency"], r["bandwidth_fraction"]) for r in rows if "bandwidth_fraction" in r]
                ax.plot([c for c, _ in bw], [f for _, f in bw], marker="x", markersize=9, linestyle="none",
                        color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes.flat[0].legend()
    cfg = results["config"]
    fig.suptitle(f"{cfg['model']}, in {cfg['input_len']} / out {cfg['output_len']} tokens, {cfg['machine']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
