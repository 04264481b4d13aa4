"""Fit a mock engine's step-time profile (`engine.mock.step_model`) on steps `bench/step_times.py` measured, and
check it on steps it was not fitted on.

    python bench/fit_step_model.py --fit FILE:MODEL:PARTS [--fit ...] --check FILE:MODEL:PARTS [--check ...] \\
        --source TEXT [--out engine/mock/profiles/NAME.json]

PARTS is `fit`, `holdout` or `fit+holdout` (the two lists step_times.py writes per model), each optionally cut to
a range of its steps (`holdout[0:384]`, `holdout[384:]`: a trace's first half to fit, its second to check).
Prints the prediction error on the fitted and the checked steps (trace time and per-step error,
`step_model.prediction_error`); with --out writes the profile, the source and the checked error beside the
coefficients.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from pdserve_server.engine.execution.cuda_graphs import capture_sizes  # noqa: E402
from pdserve_server.engine.mock.step_model import StepShape, fit, prediction_error  # noqa: E402

SHAPE_FIELDS = ("prefill_tokens", "prefill_attn", "decode_seqs", "decode_ctx", "decode_ctx_max")


def load(spec: str) -> tuple[list[StepShape], list[float], dict]:
    """FILE:MODEL:PARTS -> (shapes, times in ms, the document's args)."""
    file, model, parts = spec.split(":", 2)
    doc = json.loads(Path(file).read_text())
    steps = []
    for part in parts.split("+"):
        name, _, cut = part.partition("[")
        lo, _, hi = cut.rstrip("]").partition(":")
        steps += doc["models"][model][name][int(lo or 0):int(hi) if hi else None]
    return [StepShape(**{k: r[k] for k in SHAPE_FIELDS}) for r in steps], [r["ms"] for r in steps], doc["args"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fit", action="append", required=True, metavar="FILE:MODEL:PARTS")
    p.add_argument("--check", action="append", default=[], metavar="FILE:MODEL:PARTS")
    p.add_argument("--source", default="", help="where the steps came from, written into the profile")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    shapes, times, args = [], [], {}
    for spec in a.fit:
        s, t, args = load(spec)
        shapes += s
        times += t
    # the decode batches were padded to the sizes CUDA graphs were captured at, for --max-num-seqs
    model, dropped = fit(shapes, times, capture_sizes(int(args.get("max_num_seqs", 256))), source=a.source)
    print(f"fitted on {len(shapes)} steps ({dropped} dropped as outliers): "
          f"{json.dumps(prediction_error(model, shapes, times))}")
    errors = {}
    for spec in a.check:
        s, t, _ = load(spec)
        errors[Path(spec.split(":", 1)[0]).name + ":" + spec.split(":", 2)[2]] = err = prediction_error(model, s, t)
        print(f"checked on {spec}: {json.dumps(err)}")
    print(f"decode {[round(c, 7) for c in model.decode]}\nmixed {[round(c, 7) for c in model.mixed]}")
    if a.out:
        doc = model.to_json()
        doc.update(fitted_on=a.fit, checked_on=a.check, error=errors)
        a.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
