"""What a lossy lever costs in accuracy: perplexity on a fixed text and greedy token agreement, per precision.

- Perplexity: HF transformers' LlamaForCausalLM on the packaged model, fp32 / bf16 / bf16 with int8 or int4
  weight-only linears (`engine.execution.quantization`, the same modules the engine uses), over a fixed window of
  real English text (bench/prompts.py's corpus, --ppl-tokens tokens from its start), one forward pass.
- Decode perplexity: the same text through pdserve's engine one token a step (batch-1 decode steps, teacher-forced),
  for every precision including fp32 with `--quantization gguf`, whose 8-bit rows exist only at batch 1 (HF has no
  such forward: its perplexity column is empty there).
- Prefill perplexity: the same text through pdserve's engine as one prefill (every row's logits): what
  `--quantization w8a8_int8` changes, whose int8 products take every batch but one row of the packaged model's
  GGUF weights (which its batch-1 decode computes as `--quantization gguf` does, sharing that perplexity).
- `--kv-cache-dtype bfloat16` rows: fp32 weights over a bf16 KV cache (no HF perplexity: HF has no such cache).
- Agreement: pdserve's engine, greedy, 32 tokens on each of the 8 PROMPTS (shared with
  tests/engine/test_dtype.py), against the engine in fp32 (tokens before the first divergence over the stream's
  length: greedy streams differ entirely after one token); "long", the same with the text's first 96 tokens before
  each prompt (the first prompt prefills them in one chunk, the others find that KV in the prefix cache).

Usage: python bench/quality.py [--ppl-tokens 1024] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors:", "Water boils at",
           "Once upon a time", "import numpy as np\n", "The quick brown fox", "1, 2, 3, 4,"]
# (dtype, quantization, kv_cache_dtype)
PRECISIONS = (("float32", "none", "auto"), ("float32", "none", "bfloat16"), ("float32", "gguf", "auto"),
              ("float32", "w8a8_int8", "auto"), ("float32", "w8a8_int8", "bfloat16"), ("bfloat16", "none", "auto"),
              ("bfloat16", "int8", "auto"), ("bfloat16", "int4", "auto"))
LONG_CONTEXT = 96  # text tokens before each prompt in the "long" agreement


def perplexity(model_dir: str, ids: list[int], dtype: str, quantization: str) -> float:
    """exp(mean next-token cross-entropy) of `ids` under the HF model in that precision."""
    import torch
    from transformers import AutoModelForCausalLM

    from pdserve_server.engine.execution.quantization import quantize_weight_only

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    if quantization != "none":
        quantize_weight_only(model, quantization)
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return math.exp(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).item())


def engine_runner(model_dir: str, n: int, dtype: str, quantization: str, kv_cache_dtype: str = "auto"):
    """pdserve's model runner with a KV cache for one n-token sequence, its block table and each position's slot.

    Raises:
        ValueError: the precision does not apply to the model (`build_engine`: gguf on a model that is no GGUF's).
    """
    from pdserve_server.engine.args import EngineArgs
    from pdserve_server.engine.builder import build_engine

    runner = build_engine(EngineArgs(model_dir=model_dir, dtype=dtype, quantization=quantization, kv_tokens=n + 64,
                                     max_model_len=n + 16, kv_cache_dtype=kv_cache_dtype)).runner
    bs = runner.block_size
    table = list(range(-(-n // bs)))
    return runner, table, [table[p // bs] * bs + p % bs for p in range(n)]


def decode_perplexity(runner, table: list[int], slots: list[int], ids: list[int]) -> float:
    """exp(mean next-token cross-entropy) of `ids` under `engine_runner`'s runner, fed one token a decode step (the
    first as a one-token prefill): every logit row is a batch-1 step's, as a single stream's are."""
    import torch

    from pdserve_server.engine.execution.model_runner import StepInputs

    logits = runner._forward(StepInputs(input_ids=ids[:1], positions=[0], slots=slots[:1], prefill_query_lens=[1],
                                        prefill_context_lens=[1], prefill_block_tables=[table], logit_rows=[0]), None)
    rows = []
    for p in range(1, len(ids)):
        rows.append(logits.float())
        if p < len(ids) - 1:
            logits = runner._forward(StepInputs(input_ids=[ids[p]], positions=[p], slots=[slots[p]],
                                                decode_block_tables=[table], decode_context_lens=[p + 1]), None)
    nll = torch.nn.functional.cross_entropy(torch.cat(rows), torch.tensor(ids[1:]))
    return math.exp(nll.item())


def prefill_perplexity(runner, table: list[int], slots: list[int], ids: list[int]) -> float:
    """exp(mean next-token cross-entropy) of `ids` under `engine_runner`'s runner, all of them one prefill step."""
    import torch

    from pdserve_server.engine.execution.model_runner import StepInputs

    logits = runner._forward(StepInputs(input_ids=ids, positions=list(range(len(ids))), slots=slots,
                                        prefill_query_lens=[len(ids)], prefill_context_lens=[len(ids)],
                                        prefill_block_tables=[table], logit_rows=list(range(len(ids) - 1))), None)
    return math.exp(torch.nn.functional.cross_entropy(logits.float(), torch.tensor(ids[1:])).item())


def engine_greedy(model_dir: str, prompts: list[list[int]], dtype: str, quantization: str, n: int,
                  kv_cache_dtype: str = "auto") -> list[list[int]]:
    from pdserve_server.engine.args import EngineArgs
    from pdserve_server.engine.builder import build_engine
    from pdserve_server.engine.offline import generate
    from pdserve_server.engine.request import SamplingParams

    parts = build_engine(EngineArgs(model_dir=model_dir, dtype=dtype, quantization=quantization, kv_tokens=8192,
                                    max_model_len=512, kv_cache_dtype=kv_cache_dtype))
    return generate(parts, [[p] for p in prompts], SamplingParams(max_tokens=n, temperature=0.0))


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Tokens generated before the first divergence over the longer stream's length, summed over prompts (greedy
    streams differ entirely after one; both stop at EOS). Also the measure tests/engine/test_dtype.py bounds."""
    same = sum(next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q))) for p, q in zip(a, b))
    return same / sum(max(len(p), len(q)) for p, q in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--ppl-tokens", type=int, default=1024)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import torch
    from transformers import AutoTokenizer

    from pdserve_server.cli.models import resolve_model
    from pdserve_server.engine.hardware import cpu_flags
    from prompts import corpus_text
    from hostinfo import FLAGS_SHOWN, commit, machine

    torch.set_num_threads(1)
    model_dir = args.model_dir or str(resolve_model(None))
    tok = AutoTokenizer.from_pretrained(model_dir)
    text_ids = tok(corpus_text())["input_ids"][:args.ppl_tokens]
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    long_prompts = [text_ids[:LONG_CONTEXT] + p for p in prompts]
    rows, reference, long_reference = [], None, None
    for dtype, quant, kv in PRECISIONS:
        t = time.perf_counter()
        name = f"{dtype:>9} {quant:>9}" + (f" {kv} KV" if kv != "auto" else "")
        ppl = (perplexity(model_dir, text_ids, dtype, quant) if quant not in ("gguf", "w8a8_int8") and kv == "auto"
               else None)
        try:
            runner = engine_runner(model_dir, len(text_ids), dtype, quant, kv)
        except ValueError as e:  # --quantization gguf on a model that is no GGUF's (the smoke test's tiny one)
            print(f"{name}: skipped ({e})", flush=True)
            continue
        # each pass writes every position's KV before reading it: one runner serves both
        decode_ppl = decode_perplexity(*runner, text_ids)
        prefill_ppl = prefill_perplexity(*runner, text_ids)
        del runner
        outputs = engine_greedy(model_dir, prompts + long_prompts, dtype, quant, 32, kv)  # one at a time, one engine
        greedy, long_greedy = outputs[:len(prompts)], outputs[len(prompts):]
        reference, long_reference = reference or greedy, long_reference or long_greedy
        row = {"dtype": dtype, "quantization": quant, "kv_cache_dtype": kv, "perplexity": ppl,
               "decode_perplexity": decode_ppl, "prefill_perplexity": prefill_ppl,
               "agreement_vs_fp32": agreement(greedy, reference),
               "agreement_long_vs_fp32": agreement(long_greedy, long_reference)}
        rows.append(row)
        hf = f"{ppl:.3f}" if ppl is not None else "-"
        print(f"{name}: perplexity {hf} (HF), {prefill_ppl:.3f} (engine, one prefill), "
              f"{decode_ppl:.3f} (engine, one token a step) over {len(text_ids)} tokens, greedy agreement with the "
              f"fp32 engine {row['agreement_vs_fp32']:.2f}, long {row['agreement_long_vs_fp32']:.2f} "
              f"({time.perf_counter() - t:.0f} s)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"commit": commit(), "date": time.strftime("%Y-%m-%d"),
                                              "machine": machine(), "cpu_flags": sorted(cpu_flags() & FLAGS_SHOWN),
                                              "ppl_tokens": len(text_ids), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
