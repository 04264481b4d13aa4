"""Coordinator: the public gRPC server. Tokenizes, validates, routes each request to a prefill and a decode worker,
detokenizes incrementally, applies stop strings, streams to the client, and frees everything on finish/cancel."""
