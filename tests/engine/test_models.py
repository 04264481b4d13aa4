"""Model registry and strict weight loading: greedy parity with HF transformers for architectures with projection
biases (Qwen2; Llama with attention_bias), per-head q/k norm and head_dim != hidden / heads (Qwen3), Llama-3
RoPE scaling and sliding-window attention (Mistral, Phi-3, Qwen2 with some layers sliding), loud failures on
missing / unused / misshapen tensors, and the registry's refusal of configs we cannot serve correctly."""
import dataclasses
import random
import re

import pytest
import torch

from conftest import hf_greedy
from pdserve_server.engine.args import EngineArgs
from pdserve_server.engine.builder import build_engine
from pdserve_server.engine.models.config import ModelConfig
from pdserve_server.engine.models.decoder import DecoderModel
from pdserve_server.engine.offline import run_until_idle
from pdserve_server.engine.request import Request, SamplingParams
from pdserve_server.kernels.backends import select_ops

VOCAB = 1024
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
            bos_token_id=None, eos_token_id=None,  # no EOS: HF generate must not stop early
            # HF's default 0.02 leaves attention near-uniform, where q/k biases barely move the output; at 0.1
            # zeroing any one of the q, k, v, o biases changes the greedy tokens of both models below.
            initializer_range=0.1)


def _save_random(model, out) -> str:
    """Non-zero biases (HF initialises them to zero, which a bias-dropping loader would pass), q/k norm weights
    away from HF's initial ones (which a norm-dropping or weight-dropping decoder would match more often) and a
    sharper LM head so greedy choices are far from ties; saved in HF format (the engine needs no tokenizer)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1.0, 0.5)
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY, rms_norm_eps=1e-6))
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    return _save_random(model, tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="module")
def llama_bias_dir(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, rms_norm_eps=1e-5, attention_bias=True))
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    return _save_random(model, tmp_path_factory.mktemp("tiny-llama-bias"))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    """Qwen3 with head_dim 32 != hidden_size / heads = 16 (q/k/v project to 128 / 64 / 64 wide, o_proj back to 64)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=32, rms_norm_eps=1e-6))
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is None and attn.q_norm.weight.shape == (32,)
    return _save_random(model, tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory) -> str:
    """Phi-3: q/k/v and gate/up stored fused in the checkpoint (the loader must take them as they are)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    model = Phi3ForCausalLM(Phi3Config(**TINY, rms_norm_eps=1e-5, pad_token_id=0, sliding_window=None))
    out = _save_random(model, tmp_path_factory.mktemp("tiny-phi3"))
    from safetensors import safe_open
    with safe_open(f"{out}/model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    assert "model.layers.0.self_attn.q_proj.weight" not in names
    return out


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory) -> str:
    """Mistral without a sliding window: Llama's numerics under another model_type."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**TINY, rms_norm_eps=1e-5, sliding_window=None))
    return _save_random(model, tmp_path_factory.mktemp("tiny-mistral"))


# Sliding windows far shorter than the 40-token prompts plus 24+ generated tokens: HF's mask hides most of the
# context from most queries, so a decoder that attended fully would generate other tokens (checked by breaking it).
@pytest.fixture(scope="module")
def mistral_window_dir(tmp_path_factory) -> str:
    """Mistral with sliding_window 8 on both layers."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**TINY, rms_norm_eps=1e-5, sliding_window=8))
    return _save_random(model, tmp_path_factory.mktemp("tiny-mistral-window"))


@pytest.fixture(scope="module")
def phi3_window_dir(tmp_path_factory) -> str:
    """Phi-3 with sliding_window 12 on both layers (HF uses the value as is, as Mistral does)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    model = Phi3ForCausalLM(Phi3Config(**TINY, rms_norm_eps=1e-5, pad_token_id=0, sliding_window=12))
    return _save_random(model, tmp_path_factory.mktemp("tiny-phi3-window"))


@pytest.fixture(scope="module")
def qwen2_window_dir(tmp_path_factory) -> str:
    """Qwen2 with use_sliding_window, window 8 and max_window_layers 1 over three layers: HF's layer_types makes
    layer 0 full attention and layers 1 and 2 sliding."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(**{**TINY, "num_hidden_layers": 3}, rms_norm_eps=1e-6, use_sliding_window=True,
                      sliding_window=8, max_window_layers=1)
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    return _save_random(Qwen2ForCausalLM(cfg), tmp_path_factory.mktemp("tiny-qwen2-window"))


# Llama-3 scaling for head_dim 16, theta 1e4: the wavelengths 2*pi/inv_freq are 6.3, 19.9, 62.8, 199, ... so with
# original_max_position_embeddings 64 (thresholds 64 / 4 = 16 and 64 / 1 = 64) the first frequency is kept, the next
# two are smoothed and the other five divided by 8: all three branches of the formula are taken.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def llama3_rope_dir(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, rms_norm_eps=1e-5, rope_parameters=dict(LLAMA3_ROPE)))
    assert model.config.rope_parameters["rope_type"] == "llama3"
    return _save_random(model, tmp_path_factory.mktemp("tiny-llama3-rope"))


def run_greedy(model_dir: str, prompts: list[list[int]], max_tokens: list[int], backend: str = "torch"):
    """Run all prompts in one engine with a 16-token step budget on attention backend `backend`. Returns (engine
    parts, requests, chunked) where chunked says some prefill was split (a later chunk then attends over K/V
    already in cached blocks)."""
    parts = build_engine(EngineArgs(dtype="float32", model_dir=model_dir, block_size=8, kv_tokens=2048,
                                    max_num_batched_tokens=16, burst_prefill_tokens=0,
                                    max_model_len=512, attention_backend=backend))
    reqs = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    chunks = []  # per step: a prefill chunk that stops short of the prompt's end
    run_until_idle(parts, reqs, on_step=lambda out: chunks.append(any(not x.sample for x in out.prefills)))
    return parts, reqs, any(chunks)


@pytest.mark.parametrize("model_fixture,qkv_bias,o_bias", [
    ("qwen2_dir", True, False),
    ("llama_bias_dir", True, True),
])
@pytest.mark.parametrize("backend", ["torch", "cpu"])  # cpu: the linears (their biases too) in our small-M kernel
def test_greedy_matches_hf_with_projection_biases(request, model_fixture, qkv_bias, o_bias, backend):
    """Prompts of 1..40 tokens (40 spans five 8-token KV blocks) batched together under a 16-token budget."""
    model_dir = request.getfixturevalue(model_fixture)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 6, 19, 40)]
    max_tokens = [5, 8, 6, 7]
    parts, reqs, chunked = run_greedy(model_dir, prompts, max_tokens, backend)
    assert (parts.model_config.qkv_bias, parts.model_config.o_bias) == (qkv_bias, o_bias)
    assert chunked, "the test meant to exercise chunked prefill"
    for req, p, n in zip(reqs, prompts, max_tokens):
        assert req.output_token_ids == hf_greedy(model_dir, p, n), req.request_id


def test_llama3_rope_frequencies_are_hfs_and_scaled(llama3_rope_dir):
    """The engine's inverse frequencies equal HF's bit for bit (`_compute_llama3_parameters`, and the loaded HF
    model's buffer), and differ from plain RoPE's in all three regimes, so the parity test below is not vacuous."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_rope_utils import _compute_llama3_parameters

    from pdserve_server.engine.models.layers import RotaryEmbedding, default_inv_freq

    hf_cfg = AutoConfig.from_pretrained(llama3_rope_dir)
    cfg = _from_hf(hf_cfg)
    assert cfg.rope_llama3 is not None and cfg.rope_llama3.original_max_position_embeddings == 64
    ours = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_llama3).inv_freq
    assert torch.equal(ours, _compute_llama3_parameters(hf_cfg)[0])
    hf_model = AutoModelForCausalLM.from_pretrained(llama3_rope_dir, dtype=torch.float32)
    assert torch.equal(ours, hf_model.model.rotary_emb.inv_freq)
    plain = default_inv_freq(cfg.head_dim, cfg.rope_theta)
    assert ours[0] == plain[0]  # high frequency: kept
    assert torch.all((ours[1:3] < plain[1:3]) & (ours[1:3] > plain[1:3] / 8))  # medium: smoothed
    assert torch.allclose(ours[3:], plain[3:] / 8)  # low: divided by the factor


@pytest.mark.parametrize("model_fixture,flags", [
    ("qwen3_dir", (False, False, True, False)),
    ("llama3_rope_dir", (False, False, False, True)),
    ("mistral_dir", (False, False, False, False)),
    ("phi3_dir", (False, False, False, False)),
])
def test_greedy_matches_hf_long(request, model_fixture, flags):
    """Qwen3, Llama with Llama-3 RoPE scaling and Mistral: 24+ greedy tokens from prompts of 1..40 tokens under a
    16-token budget (chunked prefill); positions reach 65, past the llama3 fixture's
    original_max_position_embeddings of 64."""
    model_dir = request.getfixturevalue(model_fixture)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 6, 19, 40)]
    max_tokens = [24, 30, 26, 25]
    parts, reqs, chunked = run_greedy(model_dir, prompts, max_tokens)
    c = parts.model_config
    assert (c.qkv_bias, c.o_bias, c.qk_norm, c.rope_llama3 is not None) == flags
    assert chunked, "the test meant to exercise chunked prefill"
    for req, p, n in zip(reqs, prompts, max_tokens):
        assert len(req.output_token_ids) == n
        assert req.output_token_ids == hf_greedy(model_dir, p, n), req.request_id


@pytest.mark.parametrize("model_fixture,windows,backend", [
    ("mistral_window_dir", (8, 8), "torch"),
    ("mistral_window_dir", (8, 8), "cpu"),  # the C decode kernel's window
    ("phi3_window_dir", (12, 12), "torch"),
    ("qwen2_window_dir", (0, 8, 8), "torch"),
])
def test_greedy_matches_hf_sliding_window(request, model_fixture, windows, backend):
    """24+ greedy tokens from prompts of 1..40 tokens under a 16-token budget, with windows of 8 or 12: chunked
    prefill attends across chunk boundaries and decodes reach position 65, so both attention ops read from the
    middle of the context (blocks wholly before the window, windows starting mid-block)."""
    model_dir = request.getfixturevalue(model_fixture)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 6, 19, 40)]
    max_tokens = [24, 30, 26, 25]
    parts, reqs, chunked = run_greedy(model_dir, prompts, max_tokens, backend)
    assert parts.model_config.layer_windows == windows
    assert chunked, "the test meant to exercise chunked prefill"
    for req, p, n in zip(reqs, prompts, max_tokens):
        assert len(req.output_token_ids) == n
        assert req.output_token_ids == hf_greedy(model_dir, p, n), req.request_id


@pytest.mark.parametrize("model_fixture,window", [("mistral_window_dir", 8), ("phi3_window_dir", 12),
                                                  ("qwen2_window_dir", 0)])
def test_blocks_behind_every_layers_window_go_back_during_the_run(request, model_fixture, window):
    """Every layer sliding (Mistral, Phi-3): a request holds at most the blocks its window and one step's tokens
    span, the null block stands in for the rest, and the output is still HF's; one full-attention layer (the
    Qwen2 config): every block is kept. The pool is whole and consistent after."""
    model_dir = request.getfixturevalue(model_fixture)
    parts = build_engine(EngineArgs(dtype="float32", model_dir=model_dir, block_size=8, kv_tokens=2048,
                                    max_num_batched_tokens=16, burst_prefill_tokens=0, max_model_len=512,
                                    attention_backend="torch"))
    kv = parts.scheduler.kv
    assert kv.sliding_window == window
    rng = random.Random(1)
    prompt = [rng.randrange(3, VOCAB) for _ in range(45)]
    req = Request("long", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    held, nulls = [], []

    def watch(out):
        for s in out.prefills + out.decodes:
            held.append(sum(b != kv.null_block for b in s.block_ids))
            nulls.append(s.block_ids.count(kv.null_block) if window else 0)

    run_until_idle(parts, [req], on_step=watch)
    assert req.output_token_ids == hf_greedy(model_dir, prompt, 40)
    if window:
        # Keys the step can see (window - 1 back from its first token) plus its own tokens (at most 16), in blocks.
        assert max(held) <= (window + 16) // 8 + 2, held
        assert max(nulls) >= (45 + 40 - window) // 8 - 1, nulls
    else:
        assert kv.null_block is None and max(held) == -(-(45 + 40 - 1) // 8)
    assert kv.pool.num_free_blocks == kv.num_usable_blocks and kv.pool.integrity_errors() == []


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_request_longer_than_the_kv_pool_runs_under_a_sliding_window(mistral_window_dir, mistral_dir, backend):
    """Window 8 on a pool of 4 usable 8-token blocks (32 tokens): a 100-token prompt with 60 outputs (20 blocks'
    worth) is admitted, computed in chunks that fit beside the window, and equals HF's greedy output; the same
    request on the same pool without a window (the windowless Mistral) is refused at admission."""
    def engine(model_dir):
        return build_engine(EngineArgs(dtype="float32", model_dir=model_dir, block_size=8, kv_tokens=40,
                                       max_num_batched_tokens=16, burst_prefill_tokens=0, max_model_len=512,
                                       attention_backend=backend))

    rng = random.Random(2)
    prompt = [rng.randrange(3, VOCAB) for _ in range(100)]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    with pytest.raises(ValueError, match="CAPACITY"):
        run_until_idle(engine(mistral_dir), [Request("plain", prompt, params)])
    parts = engine(mistral_window_dir)
    kv = parts.scheduler.kv
    assert kv.num_usable_blocks == 4
    req = Request("long", prompt, params)
    run_until_idle(parts, [req], max_steps=200)
    assert req.output_token_ids == hf_greedy(mistral_window_dir, prompt, 60)
    assert parts.scheduler.num_preemptions == 0
    assert kv.pool.num_free_blocks == kv.num_usable_blocks and kv.pool.integrity_errors() == []


@pytest.fixture(scope="module")
def tiny_llama():
    """(ModelConfig, HF state dict) of a bias-free tiny Llama, in memory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    state = {k: v.detach().clone() for k, v in LlamaForCausalLM(hf_cfg).state_dict().items()}
    return ModelConfig.from_hf(hf_cfg, name="tiny", path=""), state


def new_model(cfg: ModelConfig):
    return DecoderModel(cfg, select_ops("torch", "cpu"))


def test_load_accepts_hf_names_and_known_leftovers(tiny_llama):
    cfg, state = tiny_llama
    model = new_model(cfg)
    model.load_weights({**state, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)})
    qkv = torch.cat([state[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(model.layers[1].self_attn.qkv_proj.weight, qkv)
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"])

    new_model(cfg).load_weights({k.removeprefix("model."): v for k, v in state.items()})  # no `model.` prefix
    tied = new_model(dataclasses.replace(cfg, tie_word_embeddings=True))
    tied.load_weights(state)  # lm_head.weight is tolerated and ignored: the head is the embedding
    assert torch.equal(tied.lm_head.weight, state["model.embed_tokens.weight"])


@pytest.mark.parametrize("extra", ["model.layers.0.self_attn.q_proj.bias", "model.layers.1.self_attn.k_norm.weight",
                                   "model.extra_norm.weight"])
def test_load_rejects_unused_tensor(tiny_llama, extra):
    """The first two cases are a Qwen2-style bias and a Qwen3-style k norm offered to a config without them: they
    must not be dropped silently."""
    cfg, state = tiny_llama
    model = new_model(cfg)
    before = model.embed_tokens.weight.detach().clone()
    with pytest.raises(ValueError, match=re.escape(extra)):
        model.load_weights({**state, extra: torch.zeros(32)})
    assert torch.equal(model.embed_tokens.weight, before)  # nothing copied from a rejected state dict


def test_unused_tensors_listed_sorted_and_truncated(tiny_llama):
    cfg, state = tiny_llama
    extras = {f"model.junk.{i:02d}": torch.zeros(1) for i in range(12)}
    with pytest.raises(ValueError, match="12 unused") as e:
        new_model(cfg).load_weights({**state, **extras})
    msg = str(e.value)
    assert "model.junk.00, model.junk.01" in msg and "model.junk.09" in msg
    assert "model.junk.10" not in msg and "and 2 more" in msg


def test_load_rejects_missing_tensor(tiny_llama):
    cfg, state = tiny_llama
    missing = "model.layers.1.mlp.down_proj.weight"
    with pytest.raises((KeyError, ValueError), match=re.escape("layers.1.mlp.down_proj.weight")):
        new_model(cfg).load_weights({k: v for k, v in state.items() if k != missing})
    with pytest.raises((KeyError, ValueError), match="lm_head.weight"):  # untied head: no fallback to embedding
        new_model(cfg).load_weights({k: v for k, v in state.items() if k != "lm_head.weight"})
    with pytest.raises((KeyError, ValueError), match=re.escape("layers.0.self_attn.q_proj.bias")):
        new_model(dataclasses.replace(cfg, qkv_bias=True)).load_weights(state)  # bias-free checkpoint as Qwen2
    with pytest.raises((KeyError, ValueError), match=re.escape("layers.0.self_attn.q_norm.weight")):
        new_model(dataclasses.replace(cfg, qk_norm=True)).load_weights(state)  # norm-free checkpoint as Qwen3


def test_load_rejects_wrong_shape(tiny_llama):
    cfg, state = tiny_llama
    with pytest.raises(ValueError, match="norm.weight: expected shape"):
        new_model(cfg).load_weights({**state, "model.norm.weight": torch.ones(33)})


def _from_hf(hf_config) -> ModelConfig:
    return ModelConfig.from_hf(hf_config, name="m", path="")


def test_registry_flags_per_model_type():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    from pdserve_server.engine.models.interface import Llama3RopeScaling

    def flags(c):
        return c.qkv_bias, c.o_bias, c.qk_norm

    assert flags(_from_hf(LlamaConfig())) == (False, False, False)
    assert flags(_from_hf(LlamaConfig(attention_bias=True))) == (True, True, False)
    assert flags(_from_hf(Qwen2Config())) == (True, False, False)
    assert flags(_from_hf(Qwen3Config())) == (False, False, True)
    assert flags(_from_hf(Qwen3Config(attention_bias=True))) == (True, True, True)  # HF: q, k, v and o alike
    assert _from_hf(Qwen3Config(head_dim=32, hidden_size=64, num_attention_heads=4)).head_dim == 32
    assert flags(_from_hf(MistralConfig(sliding_window=None))) == (False, False, False)
    assert flags(_from_hf(MistralConfig(sliding_window=4096, max_position_embeddings=4096))) == (False, False, False)
    assert _from_hf(LlamaConfig()).layer_windows is None
    assert _from_hf(LlamaConfig()).rope_llama3 is None
    # Llama 3.1's own values, given the transformers 4 way (rope_scaling with rope_theta beside it)
    llama31 = LlamaConfig(rope_theta=500000.0, max_position_embeddings=131072, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    assert _from_hf(llama31).rope_llama3 == Llama3RopeScaling(8.0, 1.0, 4.0, 8192)
    assert _from_hf(llama31).rope_theta == 500000.0


def test_registry_reads_sliding_windows_as_hf():
    """Which layers slide, over what window, as HF's modeling code decides it (transformers 5.24): Mistral,
    Mixtral and Phi-3 every layer when `sliding_window` is set (the value as is); Qwen2 / Qwen3 the layers
    `layer_types` marks, by default those from `max_window_layers` on, and only with `use_sliding_window`;
    Qwen3-MoE every layer with `use_sliding_window`. No sliding layer: None."""
    from transformers import MistralConfig, MixtralConfig, Phi3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    def windows(c):
        return _from_hf(c).layer_windows

    small = dict(num_hidden_layers=3, max_position_embeddings=512)
    assert windows(MistralConfig(**small, sliding_window=128)) == (128, 128, 128)
    assert windows(MistralConfig(**small, sliding_window=None)) is None
    assert windows(MixtralConfig(**small, sliding_window=64)) == (64, 64, 64)
    assert windows(Phi3Config(**small, sliding_window=2047)) == (2047, 2047, 2047)  # Phi-3-mini-4k's, not 2046
    assert windows(Qwen2Config(**small)) is None
    assert windows(Qwen2Config(**small, sliding_window=64, max_window_layers=1)) is None  # use_sliding_window off
    on = dict(small, use_sliding_window=True, sliding_window=64)
    assert windows(Qwen2Config(**on, max_window_layers=1)) == (0, 64, 64)
    assert windows(Qwen2Config(**on, max_window_layers=3)) is None
    explicit = ["sliding_attention", "full_attention", "sliding_attention"]
    assert windows(Qwen3Config(**on, layer_types=explicit)) == (64, 0, 64)
    assert windows(Qwen3MoeConfig(**small, use_sliding_window=True, sliding_window=16)) == (16, 16, 16)
    assert windows(Qwen3MoeConfig(**small, sliding_window=16)) is None


def test_registry_rejects_what_it_cannot_serve():
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    with pytest.raises(ValueError, match="mlp_bias"):
        _from_hf(LlamaConfig(mlp_bias=True))
    with pytest.raises(ValueError, match="'gpt2'.*llama, mistral, mixtral, phi3, qwen2, qwen3, qwen3_moe"):
        _from_hf(GPT2Config())
    with pytest.raises(ValueError, match="mistral: sliding_window=0 is not supported"):
        _from_hf(MistralConfig(sliding_window=0))
    with pytest.raises(ValueError, match=re.escape("qwen2: layer_types[1]='chunked_attention' is not supported")):
        _from_hf(Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=8,
                             layer_types=["full_attention", "chunked_attention"]))
    with pytest.raises(ValueError, match=re.escape("qwen2: layer_types[0]='sliding_attention' needs a sliding_window")):
        _from_hf(Qwen2Config(num_hidden_layers=1, layer_types=["sliding_attention"]))  # use_sliding_window off
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        _from_hf(LlamaConfig(hidden_act="gelu"))
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5"):
        _from_hf(LlamaConfig(partial_rotary_factor=0.5))


@pytest.mark.parametrize("model_type,rope", [
    ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
    ("llama", {"type": "dynamic", "factor": 2.0}),  # the legacy key
    ("llama", {"rope_type": "linear", "factor": 2.0}),
    ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
    ("qwen2", {"rope_type": "dynamic", "factor": 2.0}),
])
def test_registry_refuses_unsupported_rope_type_by_name(model_type, rope):
    """Any RoPE type but 'default' and 'llama3' is refused at load, the message naming it, where a decoder that
    ignored it would serve plain RoPE's frequencies."""
    from transformers import AutoConfig

    rope_type = rope.get("rope_type", rope.get("type"))
    hf_cfg = AutoConfig.for_model(model_type, max_position_embeddings=512, rope_scaling=dict(rope))
    assert hf_cfg.rope_parameters["rope_type"] == rope_type  # HF kept it: the refusal is ours
    with pytest.raises(ValueError, match=f"{model_type}: rope_type '{rope_type}' is not supported"):
        _from_hf(hf_cfg)
