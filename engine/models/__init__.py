"""Model architectures we serve.

`interface` says what an architecture module provides (read it first); `config` is `ModelConfig`, the architecture
as the engine serves it, read from an HF config; `registry` maps an HF `model_type` to its module; `config_checks` holds
the config checks they share; `layers` and `moe` the building blocks; `decoder` the pre-norm decoder and strict weight
loader that every architecture registered today uses; one module per architecture (`llama`, `mistral`, `mixtral`,
`phi3`, `qwen2`, `qwen3`, `qwen3_moe`) parses its config. This package imports nothing itself, so `config` can use the
registry without loading the decoder. What the modules import of the rest of the engine sits below them: `engine.args`
(dtype names), `engine.attention` (a step's attention metadata), `engine.parallel.tensor_parallel` (tensor
parallelism), and `kernels`.
"""
