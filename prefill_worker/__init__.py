"""Prefill worker: schedules prompts (token budget, chunked prefill, prefix cache), samples the first token and
pushes the request's KV blocks to the decode worker the coordinator picked."""
