"""Model architectures we serve.

`interface` says what an architecture module provides (read it first); `registry` maps an HF `model_type` to its
module; `config_checks` holds the config checks they share; `layers` and `moe` the building blocks; `decoder` the
pre-norm decoder and strict weight loader that every architecture registered today uses; one module per
architecture (`llama`, `mistral`, `mixtral`, `phi3`, `qwen2`, `qwen3`, `qwen3_moe`) parses its config. This package
imports nothing itself, so `engine.config` can use the registry without loading the decoder.
"""
