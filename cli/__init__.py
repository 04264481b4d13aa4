"""The `pdserve` command line, the top layer: one entry point per role (coordinator, prefill, decode, colocated),
`serve` (a whole local cluster), `generate` (an SDK client), and model resolution. Each command imports only
its own role, so `pdserve coordinator` never loads torch or the engine."""
