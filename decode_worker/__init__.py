"""Decode worker: reserves KV blocks, receives the prompt's KV straight into them, and decodes every running
request one token per step (continuous batching); also the colocated worker (computes prompts itself)."""
