"""Model architectures we serve.

`registry` maps an HF `model_type` to the flags our decoder needs (read from the HF config; what we cannot serve
correctly is rejected there), and `llama` holds the decoder shared by Llama, Mistral, Phi-3, Qwen2 and Qwen3. This
package imports nothing itself, so `engine.config` can use the registry without loading the decoder.
"""
