"""What a grammar constraint costs per decode step on CPU: xgrammar vs llguidance, batch 1 and 32.

For each library and batch size, B matchers of one JSON schema (nested objects, enums, arrays; compiled once, laid
out as the engine does: ", " and ": ", no free whitespace) decode side by side for --steps steps with SmolLM2's
tokenizer (vocab 49152). Each step:

  1. fill the batch's token bitmask ([B, ceil(V / 32)] int32) in one call for the batch, on one thread: xgrammar's
     BatchGrammarMatcher; llguidance through the engine's own code (`engine.structured`: GrammarCompiler's cached
     matchers, `fill_bitmask`);
  2. apply it to the [B, V] fp32 logits in place with the engine's `engine.structured.apply_bitmask`, for both
     (the layout is the same; llguidance's own apply is torch.compile'd, which the engine does not do at serve time);
  3. sample every row with the engine's own `Sampler` (temperature 1, seeded);
  4. advance each matcher with its sampled token (a matcher that terminates is reset).

The baseline is step 3 on the same logits unmasked, measured in the same loop. Logits are random (a random-weight
model's are, too), so the matchers walk the grammar through many states. Each (library, batch) runs --repeats
times, libraries interleaved; reported: the median over runs of the mean ms per step of fill, apply and accept,
their sum (the mask's overhead), the baseline, and overhead / baseline; plus the first compile of the schema.
torch runs on one thread, as a worker's engine does.

Usage: python bench/structured.py [--model DIR] [--steps 200] [--batches 1,32] [--repeats 3] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from pdserve_server.engine.structured import apply_bitmask  # noqa: E402 - after the path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 24},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}


class _Xgr:
    name = "xgrammar"

    def __init__(self, tok, vocab: int, schema: str, threads: int):
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        t0 = time.perf_counter()
        self.compiled = xgr.GrammarCompiler(info, max_threads=threads).compile_json_schema(
            schema, any_whitespace=False, separators=(", ", ": "))  # the engine's JSON layout
        self.compile_s = time.perf_counter() - t0
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def matchers(self, n: int):
        return [self.xgr.GrammarMatcher(self.compiled) for _ in range(n)]

    def bitmask(self, n: int, vocab: int):
        return self.xgr.allocate_token_bitmask(n, vocab)

    def fill(self, ms, bitmask):
        self.batch.batch_fill_next_token_bitmask(ms, bitmask)
        return bitmask

    def apply(self, logits, bitmask):
        apply_bitmask(logits, bitmask)

    def accept(self, m, token: int) -> bool:
        """False when the matcher is done (terminated) and must be reset."""
        assert m.accept_token(token), token
        return not m.is_terminated()

    def reset(self, m):
        m.reset()


class _Llg:
    """llguidance exactly as the engine runs it: `engine.structured` (GrammarCompiler, its batched fill)."""

    name = "llguidance"

    def __init__(self, tok, vocab: int, schema: str, threads: int):
        from pdserve_server.engine.request import StructuredOutput
        from pdserve_server.engine.structured import GrammarCompiler
        self.compiler = GrammarCompiler(Path(tok.name_or_path) / "tokenizer.json", vocab, (tok.eos_token_id,))
        self.compiler.tokenizer()  # loaded once per engine, not per schema
        self.constraint = StructuredOutput("json_schema", schema)
        t0 = time.perf_counter()
        self.compiler.matcher(self.constraint)
        self.compile_s = time.perf_counter() - t0
        self.vocab = vocab

    def matchers(self, n: int):
        return [self.compiler.matcher(self.constraint) for _ in range(n)]  # cached: copies of one template

    def bitmask(self, n: int, vocab: int):
        return None

    def fill(self, ms, bitmask):
        from pdserve_server.engine.structured import fill_bitmask
        return fill_bitmask(ms, self.vocab)

    def apply(self, logits, bitmask):
        apply_bitmask(logits, bitmask)

    def accept(self, m, token: int) -> bool:
        assert m.accept(token), m.error
        return not m.stopped

    def reset(self, m):
        m.raw.reset()


def run(lib, batch: int, vocab: int, steps: int) -> dict:
    import torch

    from pdserve_server.engine.request import Request, SamplingParams
    from pdserve_server.engine.execution.sampler import Sampler

    sampler = Sampler(vocab)
    ms = lib.matchers(batch)
    reqs = [Request(f"r{i}", [1], SamplingParams(max_tokens=10 ** 6, temperature=1.0, seed=i)) for i in range(batch)]
    bitmask = lib.bitmask(batch, vocab)
    gen = torch.Generator().manual_seed(0)
    t = {"fill": [], "apply": [], "accept": [], "baseline": []}
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=gen) * 4
        t0 = time.perf_counter()
        sampler(logits.clone(), reqs)  # the same sampling, unmasked: what the mask adds to
        t1 = time.perf_counter()
        filled = lib.fill(ms, bitmask)
        t2 = time.perf_counter()
        lib.apply(logits, filled)
        t3 = time.perf_counter()
        out = sampler(logits, reqs)
        t4 = time.perf_counter()
        for m, r in zip(ms, reqs):
            if not lib.accept(m, out.sampled[r.request_id].token_id):
                lib.reset(m)
        t5 = time.perf_counter()
        t["baseline"].append(t1 - t0)
        t["fill"].append(t2 - t1)
        t["apply"].append(t3 - t2)
        t["accept"].append(t5 - t4)
    row = {k: statistics.mean(v) * 1e3 for k, v in t.items()}
    row["overhead"] = row["fill"] + row["apply"] + row["accept"]
    row["ratio"] = row["overhead"] / row["baseline"]
    return {"library": lib.name, "batch": batch, "compile_ms": lib.compile_s * 1e3,
            "ratio": round(row.pop("ratio"), 3), **{f"{k}_ms": round(v, 4) for k, v in row.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir with tokenizer.json (default: the packaged model)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--threads", type=int, default=1, help="xgrammar's threads (the engine's llguidance fill: 1)")
    ap.add_argument("--libs", default="xgrammar,llguidance")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each (library, batch); medians reported")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    if args.model is None:
        from pdserve_server.cli.models import resolve_model
        args.model = str(resolve_model(None))
    tok = AutoTokenizer.from_pretrained(args.model)
    vocab = 49152
    schema = json.dumps(SCHEMA)
    libs = {"xgrammar": _Xgr, "llguidance": _Llg}
    made = {name: libs[name](tok, vocab, schema, args.threads) for name in args.libs.split(",")}
    runs: dict[tuple[str, int], list[dict]] = {}
    for rep in range(args.repeats):  # libraries interleaved, so a busy spell of the machine hits both alike
        for name, lib in made.items():
            for b in (int(x) for x in args.batches.split(",")):
                run(lib, b, vocab, 10)  # warm-up
                runs.setdefault((name, b), []).append(run(lib, b, vocab, args.steps))
    rows = []
    for (name, b), rs in runs.items():  # the median run of each metric
        r = {k: (statistics.median(x[k] for x in rs) if isinstance(rs[0][k], float) else rs[0][k]) for k in rs[0]}
        r["overhead_runs_ms"] = [x["overhead_ms"] for x in rs]
        rows.append(r)
        print(f"{r['library']:>10} batch {b:>2}: fill {r['fill_ms']:.3f} apply {r['apply_ms']:.3f} "
              f"accept {r['accept_ms']:.3f} = overhead {r['overhead_ms']:.3f} ms/step (runs: "
              f"{', '.join(f'{v:.2f}' for v in r['overhead_runs_ms'])}); sampling baseline {r['baseline_ms']:.3f} ms; "
              f"overhead/baseline {r['ratio']:.2f}; first compile {r['compile_ms']:.1f} ms", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"steps": args.steps, "threads": args.threads,
                                               "repeats": args.repeats, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
