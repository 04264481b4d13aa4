"""The naive baseline of seed 004: an HTTP server that calls HF `model.generate()` once per request, one request
at a time, and streams its tokens as OpenAI-compatible SSE (`POST /v1/completions`, `stream: true`).

No batching, no scheduler, no KV management beyond what `generate()` does. Concurrent requests wait on a lock,
which is what a single-model FastAPI endpoint amounts to. Prompts are token-id lists (or text); `ignore_eos`
maps to `min_new_tokens = max_tokens`; greedy only (the harness sends temperature 0).

Usage: python bench/naive_server.py --model-dir DIR [--port 0] [--threads N] [--ready-file F]
"""
from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

from pdserve_server.server_common.grpc_server import write_ready_file


class _SseStreamer(BaseStreamer):
    """Writes each generated token as one SSE event; `generate()` first puts the prompt, which is skipped."""

    def __init__(self, write, model: str, tokenizer):
        self.write, self.model, self.tokenizer = write, model, tokenizer
        self.seen_prompt = False
        self.count = 0

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        for tok in value.reshape(-1).tolist():
            self.count += 1
            self.write({"object": "text_completion", "model": self.model,
                        "choices": [{"index": 0, "text": self.tokenizer.decode([tok]), "finish_reason": None}]})

    def end(self) -> None:
        pass


def make_handler(model, tokenizer, name: str, lock: threading.Lock):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep the benchmark's stderr clean
            pass

        def _event(self, obj) -> None:
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self.send_error(404, "only /v1/completions")
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                prompt = body["prompt"]
                ids = tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else [int(t) for t in prompt]
                max_tokens = int(body.get("max_tokens", 16))
            except (KeyError, ValueError, TypeError) as e:
                self.send_error(400, f"bad request: {e}")
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            streamer = _SseStreamer(self._event, name, tokenizer)
            with lock:  # one generate() at a time: the naive server's defining property
                with torch.inference_mode():
                    model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   max_new_tokens=max_tokens,
                                   min_new_tokens=max_tokens if body.get("ignore_eos") else None,
                                   do_sample=False, streamer=streamer, pad_token_id=tokenizer.eos_token_id)
            self._event({"object": "text_completion", "model": name, "choices": [],
                         "usage": {"prompt_tokens": len(ids), "completion_tokens": streamer.count}})
            self.wfile.write(b"data: [DONE]\n\n")

    return Handler


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # the stdlib's listen backlog of 5 resets connections at concurrency 64
    daemon_threads = True


def main() -> None:
    p = argparse.ArgumentParser(description="naive model.generate() baseline server (OpenAI-compatible SSE)")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--ready-file", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    server = _Server((args.host, args.port),
                                 make_handler(model, tokenizer, "naive", threading.Lock()))
    address = f"http://{args.host}:{server.server_address[1]}"
    write_ready_file(args.ready_file, address)
    print(f"naive server on {address}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
