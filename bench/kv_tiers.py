"""KV offload tiers (`engine.offload`) on returning multi-turn conversations whose combined context exceeds the KV pool
several times: TTFT of a returning turn and the prefill tokens it computes, tiers off against a host-memory tier and a
disk tier, and a restarted engine served from the disk tier.

    .venv/bin/python bench/kv_tiers.py [--conversations 12] [--turns 3] [--first 768] [--kv-tokens 2048]
    .venv/bin/python bench/kv_tiers.py --cluster [--conversations 8]    # 2 prefill workers, one shared disk tier
    python bench/kv_tiers.py --device cuda --model llama-3.1-8b=builtin  # on a GPU, random weights

Engine-level (`engine.builder.build_engine`, no gRPC), the packaged SmolLM2-135M-Instruct (or `--model NAME=DIR` with
random weights from DIR's config.json, `NAME=builtin` for `step_times.BUILTIN`'s configs: what a GPU machine without the
packaged model runs), one request at a time so TTFT is the engine's own. Conversation c's first turn is a
`--first`-token window of real prose (`prompts.py`'s corpus, a different window each; seeded random token ids when the
model directory has no tokenizer); every later turn appends the previous answer (`--out` tokens, greedy) and `--turn`
new tokens. Turns go round-robin (every conversation's turn 1, then every turn 2, ...), so by the time a conversation
returns the pool has been filled by the others. Each system runs the same turns on a fresh engine after an untimed
warm-up; greedy outputs must be equal in every system. The tiers load by the cost rule (`--kv-offload-load cost`: a
block whose tier loads it slower than its measured prefill is recomputed); `disk-tier-always` loads every block a tier
holds, to show what the rule saves where it matters (a fast GPU over a slow disk). `pool-holds-all` is the control for
exactness: a pool large enough to keep every conversation, tiers off, so its returning turns hit the same prefix blocks
and compute the same suffix chunks as a tier that loads them all; a tier's outputs must equal it bit for bit (equality
with tiers off holds on a CPU; on an H200 a random-weight Llama-3.1-8B's outputs parted from tiers off, believed to be
bf16 GEMMs rounding a 900-token chunk differently from a 96-token one: this control tells). Prints one JSON line per
system and the ratios against tiers off (same run).

`--busy`: the tiers' loads under running requests. The same turns arrive one at a time while another request
decodes (a "neighbour", replaced when it ends), each added while a step runs, as a served engine sees an arrival: a
returning turn's loads then run in the step that schedules it, on the engine thread, and the neighbour's inter-token
latency carries them. Systems: tiers off, the disk tier reading a queued request's blocks ahead
(`--kv-offload-prefetch-bytes`, the default), the disk tier without read-ahead, and both on a local Redis server when
`redis-server` is on PATH (`--redis-url`: a server elsewhere). Reports the returning turns' TTFT, the neighbour's ITL
p50 / p99 / max and in the steps that prefill a returning turn (where its loads land without read-ahead), and each
tier's load time on the engine thread and blocks read ahead.

`--cluster`: prefixes computed once per cluster. A served cluster (coordinator, 2 prefill workers, 1 decode worker,
one thread each; decode workers never prefill) answers questions about one `--document`: one question alone (its
prefill worker computes the document), then `--questions` at once (prefix-aware routing sends them to the worker
that holds the document until its queue makes the other cheaper: that one computes the document again, or loads it),
then as many again. Prompt tokens computed cluster-wide (the prefill workers' prefix-cache queries less hits) with
tiers off, with one disk directory both prefill workers share, and with one Redis server they share (the tier that
spans hosts; started on a free port when `redis-server` is on PATH), each storing every block as it is computed
(`--kv-offload-store computed`); the ideal is one cache for the whole cluster that keeps every prompt block
(computed from the token ids: each prompt less its leading blocks an earlier wave computed).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pdserve_server.cli.models import resolve_model  # noqa: E402
from pdserve_server.engine.args import EngineArgs  # noqa: E402
from pdserve_server.engine.builder import build_engine  # noqa: E402
from pdserve_server.engine.offline import run_until_idle  # noqa: E402
from pdserve_server.engine.request import Request, RequestStatus, SamplingParams  # noqa: E402
from hostinfo import commit, machine  # noqa: E402
from prompts import corpus_ids as _corpus_ids  # noqa: E402


def corpus_ids(model_dir: Path) -> list[int]:
    """The bench corpus tokenized by the model's own tokenizer (`prompts.corpus_ids`); without a tokenizer (a config
    alone, random weights), 200k seeded random token ids from the middle of the vocabulary."""
    if not (model_dir / "tokenizer.json").is_file():
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        rng = random.Random(1)
        return [rng.randrange(1000, vocab - 1000) for _ in range(200_000)]
    from transformers import AutoTokenizer

    return _corpus_ids(AutoTokenizer.from_pretrained(str(model_dir)))


def conversations(model_dir: Path, args) -> list[list[list[int]]]:
    """For each conversation, the new tokens of each turn (the first turn's prompt, then each later turn's user
    text): windows of the tokenized corpus at distinct offsets."""
    ids = corpus_ids(model_dir)
    need = args.first + (args.turns - 1) * args.turn
    if len(ids) < need + args.conversations:
        raise SystemExit(f"the corpus has {len(ids)} tokens, fewer than one conversation needs ({need})")
    rng = random.Random(0)
    out = []
    for _ in range(args.conversations):
        start = rng.randrange(0, len(ids) - need)
        window = ids[start:start + need]
        out.append([window[:args.first]] + [window[args.first + t * args.turn:args.first + (t + 1) * args.turn]
                                            for t in range(args.turns - 1)])
    return out


def engine(model_dir: Path, args, kv_tokens: int | None = None, **offload):
    return build_engine(EngineArgs(model_dir=str(model_dir), dtype=args.dtype, kv_tokens=kv_tokens or args.kv_tokens,
                                   max_model_len=args.first + args.turns * (args.turn + args.out) + 16,
                                   threads=args.threads, device=args.device, random_weights=args.random_weights,
                                   max_num_seqs=8, **offload))


def turn(parts, rid: str, prompt: list[int], out: int) -> Request:
    req = Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True),
                  eos_token_ids=parts.model_config.eos_token_ids)
    run_until_idle(parts, [req])
    return req


class Turns:
    """The conversations' turns in round-robin order (every conversation's turn 1, then every turn 2, ...), each
    one's context so far, and what was measured: every turn's output, and the returning turns' TTFT (ms) and prompt
    tokens computed."""

    def __init__(self, convs, turns: int):
        self.convs, self.turns = convs, turns
        self.contexts: list[list[int]] = [[] for _ in convs]
        self.outputs: list[list[int]] = []
        self.ttft: list[float] = []
        self.computed: list[int] = []

    def __iter__(self):
        """(turn, conversation, the prompt: its context with this turn's new tokens)."""
        for t in range(self.turns):
            for c, conv in enumerate(self.convs):
                self.contexts[c] += conv[t]
                yield t, c, list(self.contexts[c])

    def done(self, t: int, c: int, req: Request) -> None:
        self.contexts[c] += req.output_token_ids
        self.outputs.append(req.output_token_ids)
        if t:
            self.ttft.append((req.first_token_time - req.arrival_time) * 1e3)
            self.computed.append(req.num_prompt_tokens - req.num_cached_tokens)


def run(model_dir: Path, convs, args, name: str, kv_tokens: int | None = None,
        **offload) -> tuple[dict, list[list[int]]]:
    """Every turn of every conversation, round-robin, on a fresh engine; figures of the returning turns."""
    parts = engine(model_dir, args, kv_tokens, **offload)
    turn(parts, "warm-up", list(range(1000, 1000 + args.turn)), 2)
    turns = Turns(convs, args.turns)
    start = time.perf_counter()
    for t, c, prompt in turns:
        turns.done(t, c, turn(parts, f"c{c}-t{t}", prompt, args.out))
    wall = time.perf_counter() - start
    contexts, outputs, ttft, computed = turns.contexts, turns.outputs, turns.ttft, turns.computed
    stats = parts.scheduler.make_stats(0)
    parts.scheduler.kv.close()
    figures = {
        "system": name, "returning_turns": len(ttft),
        "ttft_ms_p50": round(statistics.median(ttft), 1), "ttft_ms_p90": round(statistics.quantiles(ttft, n=10)[-1], 1),
        "prefill_tokens_per_returning_turn": round(statistics.mean(computed), 1),
        "mean_context_tokens": round(statistics.mean(len(c) for c in contexts), 1),
        "wall_s": round(wall, 2), "output_tok_s": round(len(outputs) * args.out / wall, 2),
        "prefill_tok_s": round(sum(computed) / sum(ttft) * 1e3, 1),
        "tiers": {s.tier: {"hits": s.hits, "loaded_MiB": round(s.loaded_bytes / 2**20, 1),
                           "stored_MiB": round(s.stored_bytes / 2**20, 1), "load_s": round(s.load_seconds, 3),
                           "load_GB_s": round(s.loaded_bytes / s.load_seconds / 1e9, 2) if s.load_seconds else None,
                           "declined": s.declined, "evictions": s.evictions, "dropped": s.dropped}
                  for s in stats.kv_offload},
    }
    return figures, outputs


def run_busy(model_dir: Path, convs, args, name: str, **offload) -> tuple[dict, list[list[int]]]:
    """`--busy`: every turn, round-robin, added mid-step while a neighbour decodes; figures of the returning turns
    and of the neighbour's steps."""
    parts = engine(model_dir, args, **offload)
    sched, runner = parts.scheduler, parts.runner
    turn(parts, "warm-up", list(range(1000, 1000 + args.turn)), 2)
    neighbours = 0

    def neighbour() -> Request:
        nonlocal neighbours
        neighbours += 1
        req = Request(f"neighbour-{neighbours}", list(range(2000, 2000 + args.turn)),
                      SamplingParams(temperature=0.0, max_tokens=args.first, ignore_eos=True),  # within max_model_len
                      eos_token_ids=parts.model_config.eos_token_ids)
        assert sched.add_request(req) is None
        return req

    current = neighbour()
    itl: list[float] = []  # the neighbour's gaps between tokens, ms (each a whole iteration: schedule and loads too)
    last_token = None

    def step(arrival: Request | None = None) -> None:
        nonlocal current, last_token
        out = sched.schedule()
        if arrival is not None:  # arrives while this step computes, as in a served engine
            arrival.arrival_time = time.time()
            assert sched.add_request(arrival) is None
        start = time.perf_counter()
        sched.update(out, runner.execute(out))
        sched.observe_step(out, (time.perf_counter() - start) * 1e3)
        if len(current.output_token_ids) > 1 and last_token is not None:
            itl.append((time.perf_counter() - last_token) * 1e3)
        last_token = time.perf_counter()
        if current.status is RequestStatus.FINISHED:
            current, last_token = neighbour(), None

    turns = Turns(convs, args.turns)
    joins: list[float] = []  # the neighbour's gap in each step that prefilled a returning turn, ms
    start = time.perf_counter()
    for t, c, prompt in turns:
        req = Request(f"c{c}-t{t}", prompt, SamplingParams(temperature=0.0, max_tokens=args.out, ignore_eos=True),
                      eos_token_ids=parts.model_config.eos_token_ids)
        step(arrival=req)
        while req.status is not RequestStatus.FINISHED:
            before, first = len(itl), req.first_token_time
            step()
            if t and first is None and req.first_token_time is not None and len(itl) > before:
                joins.append(itl[-1])  # the neighbour's gap in the step that prefilled the returning turn
        turns.done(t, c, req)
    wall = time.perf_counter() - start
    outputs, ttft, computed = turns.outputs, turns.ttft, turns.computed
    stats = sched.make_stats(0)
    sched.kv.close()
    itl.sort()
    return {
        "system": name, "returning_turns": len(ttft),
        "ttft_ms_p50": round(statistics.median(ttft), 1), "ttft_ms_p90": round(statistics.quantiles(ttft, n=10)[-1], 1),
        "prefill_tokens_per_returning_turn": round(statistics.mean(computed), 1),
        "neighbour_itl_ms_p50": round(itl[len(itl) // 2], 1), "neighbour_itl_ms_p99": round(itl[int(len(itl) * .99)], 1),
        "neighbour_itl_ms_max": round(itl[-1], 1), "neighbour_tokens": len(itl), "wall_s": round(wall, 2),
        "neighbour_itl_ms_as_a_returning_turn_joins_p50": round(statistics.median(joins), 1) if joins else None,
        "neighbour_itl_ms_as_a_returning_turn_joins_max": round(max(joins), 1) if joins else None,
        "tiers": {s.tier: {"hits": s.hits, "prefetched": s.prefetched, "engine_load_s": round(s.load_seconds, 3),
                           "declined": s.declined} for s in stats.kv_offload},
    }, outputs


def busy_main(args, model_dir: Path) -> None:
    """`--busy`: tiers off, disk and Redis with and without read-ahead, under a decoding neighbour."""
    convs = conversations(model_dir, args)
    off, expected = run_busy(model_dir, convs, args, "tiers-off")
    print(json.dumps(off), flush=True)
    with tempfile.TemporaryDirectory(prefix="kv-tier-") as directory, redis_server(args.redis_url) as url:
        systems = [("disk-tier", {"kv_offload_disk_dir": directory + "/a"}),
                   ("disk-tier-no-read-ahead", {"kv_offload_disk_dir": directory + "/b",
                                                "kv_offload_prefetch_bytes": 0})]
        if url is not None:  # databases 1 and 2 of the server: the two systems share no entries
            server = url.rsplit("/", 1)[0]
            systems += [("redis-tier", {"kv_offload_redis_url": f"{server}/1"}),
                        ("redis-tier-no-read-ahead", {"kv_offload_redis_url": f"{server}/2",
                                                      "kv_offload_prefetch_bytes": 0})]
        for name, offload in systems:
            figures, outputs = run_busy(model_dir, convs, args, name, kv_offload_disk_bytes=args.tier_bytes,
                                        **offload)
            figures["outputs_equal_tiers_off"] = outputs == expected
            print(json.dumps(figures), flush=True)


def restart(model_dir: Path, convs, args, directory: str) -> dict:
    """A fresh engine on the disk tier the last run left: each conversation's context so far (its first turn), sent
    once: how much of it came from disk."""
    parts = engine(model_dir, args, kv_offload_disk_dir=directory)
    ttft, computed = [], []
    for c, conv in enumerate(convs):
        req = turn(parts, f"restart-c{c}", conv[0], args.out)
        ttft.append((req.first_token_time - req.arrival_time) * 1e3)
        computed.append(req.num_prompt_tokens - req.num_cached_tokens)
    (disk,) = parts.scheduler.make_stats(0).kv_offload
    parts.scheduler.kv.close()
    return {"system": "disk-after-restart", "first_turns": len(convs), "ttft_ms_p50": round(statistics.median(ttft), 1),
            "prefill_tokens_per_turn": round(statistics.mean(computed), 1), "disk_hits": disk.hits,
            "first_turn_tokens": args.first}


def ideal_computed(prompts_in_waves: list[list[list[int]]], block_size: int) -> int:
    """Prompt tokens a cluster with one shared, unbounded prefix cache computes: each prompt less its leading full
    blocks that an earlier wave's prompt computed (requests of one wave run at once), as the engine's lookup counts
    (at least one token is computed)."""
    from pdserve_server.engine.scheduling.block_pool import hash_block_tokens

    cached: set[bytes] = set()
    total = 0
    for wave in prompts_in_waves:
        new: set[bytes] = set()
        for prompt in wave:
            parent, hit, hits = None, True, 0
            for i in range(len(prompt) // block_size):
                parent = hash_block_tokens(parent, prompt[i * block_size:(i + 1) * block_size])
                new.add(parent)
                if hit and parent in cached and i < (len(prompt) - 1) // block_size:
                    hits += 1
                else:
                    hit = False
            total += len(prompt) - hits * block_size
        cached |= new
    return total


def documents(model_dir: Path, args) -> tuple[list[int], list[list[int]]]:
    """A `--document`-token window of the corpus and 2 x `--questions` distinct `--turn`-token windows after it."""
    ids = corpus_ids(model_dir)
    doc, rest = ids[:args.document], ids[args.document:]
    return doc, [rest[i * args.turn:(i + 1) * args.turn] for i in range(2 * args.questions + 1)]


def cluster_run(model_dir: Path, waves: list[list[list[int]]], args, name: str,
                offload: list[str]) -> tuple[dict, list[list[int]]]:
    """Each wave's prompts at once, wave after wave, on a fresh cluster; figures from the prefill workers."""
    import asyncio
    import urllib.request

    import grpc

    from pdserve import AsyncClient, SamplingParams
    from pdserve.v1 import worker_pb2, worker_pb2_grpc
    from pdserve_server.cli.launcher import ServeConfig, start_cluster

    logs = tempfile.mkdtemp(prefix=f"kv-tiers-{name}-")
    longest = max(len(p) for w in waves for p in w)
    worker = ["--kv-tokens", str(args.kv_tokens), "--max-model-len", str(longest + args.out + 16), "--threads", "1",
              "--dtype", args.dtype, "--metrics-port", "0", *offload]
    cluster = start_cluster(str(model_dir), "smol", ServeConfig(num_prefill=2, num_decode=1, log_dir=logs),
                            worker_args=worker, coordinator_args=["--no-local-prefill-queue"])
    outputs = []
    sampling = SamplingParams(max_tokens=args.out, temperature=0.0, ignore_eos=True)
    try:
        async def send(prompts: list[list[int]]) -> list:
            async with AsyncClient(cluster.address) as client:
                return await asyncio.gather(*(client.complete(p, sampling) for p in prompts))

        start = time.perf_counter()
        for prompts in waves:
            outputs += [list(done.token_ids) for done in asyncio.run(send(prompts))]
        wall = time.perf_counter() - start
        per_worker = {}
        for worker_name, address in sorted(cluster.worker_addresses.items()):
            if not worker_name.startswith("prefill"):
                continue
            with grpc.insecure_channel(address) as channel:
                s = worker_pb2_grpc.WorkerStub(channel).GetStats(worker_pb2.WorkerStatsRequest(), timeout=10,
                                                                 metadata=cluster.worker_metadata)
            page = urllib.request.urlopen(cluster.metrics_urls[worker_name], timeout=10).read().decode()
            disk_hits = sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                            if line.startswith("pdserve:kv_offload_hit_blocks_total"))
            per_worker[worker_name] = {"queried": s.prefix_cache_query_tokens,
                                       "computed": s.prefix_cache_query_tokens - s.prefix_cache_hit_tokens,
                                       "tier_hit_blocks": int(disk_hits)}
    finally:
        cluster.stop()
    computed = sum(w["computed"] for w in per_worker.values())
    ideal = ideal_computed(waves, 16)
    return {"system": name, "requests": len(outputs), "prompt_tokens": sum(len(p) for w in waves for p in w),
            "computed_cluster_wide": computed, "ideal_single_cache": ideal, "vs_ideal": round(computed / ideal, 3),
            "per_prefill_worker": per_worker, "wall_s": round(wall, 2), "logs": logs}, outputs


def cluster_main(args, model_dir: Path) -> None:
    doc, questions = documents(model_dir, args)
    n = args.questions
    waves = [[doc + questions[0]], [doc + q for q in questions[1:n + 1]], [doc + q for q in questions[n + 1:]]]
    off, expected = cluster_run(model_dir, waves, args, "tiers-off", [])
    print(json.dumps(off), flush=True)
    with tempfile.TemporaryDirectory(prefix="kv-tier-shared-") as directory:
        shared, outputs = cluster_run(model_dir, waves, args, "shared-disk-computed",
                                      ["--kv-offload-disk-dir", directory, "--kv-offload-store", "computed",
                                       "--kv-offload-disk-bytes", str(args.tier_bytes)])
    shared["outputs_equal_tiers_off"] = outputs == expected
    print(json.dumps(shared), flush=True)
    print(json.dumps({"computed_cluster_wide_x_fewer": round(off["computed_cluster_wide"]
                                                             / shared["computed_cluster_wide"], 2)}), flush=True)
    with redis_server() as url:  # the tier two hosts would share (here both workers are on this one)
        if url is None:
            print(json.dumps({"system": "shared-redis-computed", "skipped": "no redis-server on PATH"}), flush=True)
            return
        on_redis, outputs = cluster_run(model_dir, waves, args, "shared-redis-computed",
                                        ["--kv-offload-redis-url", url, "--kv-offload-store", "computed"])
    on_redis["outputs_equal_tiers_off"] = outputs == expected
    print(json.dumps(on_redis), flush=True)


@contextlib.contextmanager
def redis_server(url: str | None = None):
    """A Redis server on a free local port for the run (Debian's redis-server, bounded and LRU as docs/deploy.md
    runs it), yielding its URL; None when there is no redis-server. `url`: use that server instead (one on another
    host, or behind an emulated network)."""
    import shutil
    import socket
    import subprocess

    if url:
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="kv-tier-redis-") as workdir:
        server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                   "no", "--dir", workdir, "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"],
                                  stdout=subprocess.DEVNULL)
        try:
            for _ in range(100):  # up to 10 s for it to listen
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        break
                time.sleep(0.1)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            server.terminate()
            server.wait(10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--first", type=int, default=768, help="tokens of a conversation's first turn")
    p.add_argument("--turn", type=int, default=64, help="new user tokens of each later turn")
    p.add_argument("--out", type=int, default=16, help="output tokens of every turn")
    p.add_argument("--kv-tokens", type=int, default=2048, help="the KV pool, tokens")
    p.add_argument("--tier-bytes", type=int, default=2 * 2**30, help="each tier's size, bytes")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", metavar="NAME=DIR", help="random weights from DIR's config.json (NAME=builtin: "
                   "step_times.BUILTIN's); default: the packaged model's weights")
    p.add_argument("--busy", action="store_true", help="turns arrive while another request decodes (see above)")
    p.add_argument("--redis-url", help="--busy: a Redis server to use (db 1 and 2) instead of starting a local one")
    p.add_argument("--cluster", action="store_true", help="2 prefill workers sharing a disk tier (see above)")
    p.add_argument("--document", type=int, default=1536, help="--cluster: the shared document's tokens")
    p.add_argument("--questions", type=int, default=8, help="--cluster: questions per wave")
    args = p.parse_args()
    args.random_weights = args.model is not None
    if args.cluster and args.random_weights:
        p.error("--cluster serves the packaged model; --model is for the engine-level run")
    with tempfile.TemporaryDirectory(prefix="kv-tiers-model-") as tmp:
        main_on(args, model_dir(args.model, Path(tmp)))


def model_dir(spec: str | None, tmp: Path) -> Path:
    """The packaged model, or `--model NAME=DIR` / `NAME=builtin` (a config.json written to `tmp`)."""
    if spec is None:
        return resolve_model(None)
    name, _, where = spec.partition("=")
    if where != "builtin":
        return Path(where)
    from step_times import BUILTIN

    (tmp / "config.json").write_text(json.dumps(BUILTIN[name]))
    return tmp


def main_on(args, model_dir: Path) -> None:
    where = machine()
    if args.device.startswith("cuda"):
        import torch

        where += f"; {torch.cuda.get_device_name(args.device)}, torch {torch.__version__}"
    print(json.dumps({"machine": where, "commit": commit(), "date": time.strftime("%Y-%m-%d"),
                      "args": vars(args)}), flush=True)
    if args.cluster:
        cluster_main(args, model_dir)
        return
    if args.busy:
        busy_main(args, model_dir)
        return
    convs = conversations(model_dir, args)
    off, expected = run(model_dir, convs, args, "tiers-off")
    print(json.dumps(off), flush=True)
    every = args.conversations * (args.first + args.turns * (args.turn + args.out)) + 64 * args.turn
    held, exact = run(model_dir, convs, args, "pool-holds-all", kv_tokens=every)
    held["outputs_equal_tiers_off"] = exact == expected
    print(json.dumps(held), flush=True)
    results = [off]
    with tempfile.TemporaryDirectory(prefix="kv-tier-") as directory:
        for name, offload in (("cpu-tier", {"kv_offload_cpu_bytes": args.tier_bytes}),
                              ("disk-tier", {"kv_offload_disk_dir": directory,
                                             "kv_offload_disk_bytes": args.tier_bytes}),
                              ("disk-tier-always", {"kv_offload_disk_dir": directory + "/always",
                                                    "kv_offload_disk_bytes": args.tier_bytes,
                                                    "kv_offload_load": "always"})):
            figures, outputs = run(model_dir, convs, args, name, **offload)
            figures["outputs_equal_tiers_off"] = outputs == expected
            figures["outputs_equal_pool_holds_all"] = outputs == exact
            print(json.dumps(figures), flush=True)
            results.append(figures)
        print(json.dumps(restart(model_dir, convs, args, directory)), flush=True)
    for r in results[1:]:
        print(json.dumps({
            "system": r["system"], "vs": "tiers-off",
            "returning_ttft_p50_x": round(off["ttft_ms_p50"] / r["ttft_ms_p50"], 2),
            "prefill_tokens_fewer_x": round(off["prefill_tokens_per_returning_turn"]
                                            / max(r["prefill_tokens_per_returning_turn"], 1), 2),
            "throughput_x": round(r["output_tok_s"] / off["output_tok_s"], 2)}), flush=True)


if __name__ == "__main__":
    main()
