"""Gemma 3 (text, model_type "gemma3_text"): greedy tokens and per-token logprobs equal HF transformers'
`Gemma3ForCausalLM` on tiny random-weight models (sliding and full layers, the local and global RoPE bases, linear
RoPE scaling, logit soft-capping), the config reading, strict loading, and the refusals of what is not
implemented."""
import random
import re
from pathlib import Path

import pytest
import torch

from conftest import hf_greedy, hf_next_logits
from pdserve_server.engine.models.config import ModelConfig
from pdserve_server.engine.execution.loader import load_state_dict
from pdserve_server.engine.models.gemma3 import Model
from pdserve_server.engine.offline import run_until_idle
from pdserve_server.engine.request import Request, SamplingParams
from pdserve_server.kernels.backends import select_ops
from test_models import VOCAB, run_greedy

LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
GEMMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=8,
             layer_types=LAYER_TYPES, rms_norm_eps=1e-6,
             # 8, not head_dim 16: a decoder that scaled by head_dim ** -0.5 would differ
             query_pre_attn_scalar=8,
             # uncapped, the tied head's logits reach about 13 (see _save_random_gemma): a cap of 4 bends them
             final_logit_softcapping=4.0,
             bos_token_id=None, eos_token_id=None, pad_token_id=0,  # no EOS: HF generate must not stop early
             initializer_range=0.1)


def randomize_norms(model) -> None:
    """Every RMSNorm weight drawn around 0 (HF initialises them to 0, a scale of 1 + 0, where a decoder that
    multiplied by w instead would go unnoticed on some norms), the post-sublayer and final norms' three times wider:
    the sublayers' outputs then outweigh the scaled embedding in the residual stream, or the tied head would mostly
    predict the input token again (greedy output stuck on one token), and the logits spread enough for the
    soft-capping to bend them and for greedy choices to be far from ties."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight",
                              "model.norm.weight")):
                p.normal_(0.0, 3.0)
            elif name.endswith("norm.weight"):
                p.normal_(0.0, 1.0)


def _save_random_gemma(model, out) -> str:
    """`randomize_norms`, then saved in HF format."""
    randomize_norms(model)
    model.save_pretrained(str(out))
    return str(out)


def _gemma(tmp_path_factory, name: str, **overrides) -> str:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**GEMMA, **overrides}))
    assert model.config.layer_types == LAYER_TYPES and model.config.tie_word_embeddings
    return _save_random_gemma(model, tmp_path_factory.mktemp(name))


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> str:
    """Full layers: base 1e6, sliding layers: 1e4 (Gemma 3's defaults), window 8."""
    return _gemma(tmp_path_factory, "tiny-gemma3")


@pytest.fixture(scope="module")
def gemma_linear_dir(tmp_path_factory) -> str:
    """As `gemma_dir` with Gemma 3 4B+'s linear RoPE scaling on the full layers (factor 8) and a global base of
    1e4, so that the scaled frequencies differ from the local ones within 65 positions."""
    return _gemma(tmp_path_factory, "tiny-gemma3-linear", rope_theta=10000.0, rope_local_base_freq=1000.0,
                  rope_scaling={"rope_type": "linear", "factor": 8.0})


def test_config_read_as_hf(gemma_dir, gemma_linear_dir):
    from transformers import AutoConfig

    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(gemma_dir), name="g", path="")
    assert cfg.architecture == "gemma3_text" and cfg.tie_word_embeddings
    assert cfg.layer_windows == (8, 8, 0, 8)
    assert cfg.attention_scale == 8 ** -0.5 and cfg.final_logit_softcapping == 4.0
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_linear_factor) == (1e6, 1e4, None)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.qk_norm) == (False, False, True)
    linear = ModelConfig.from_hf(AutoConfig.from_pretrained(gemma_linear_dir), name="g", path="")
    assert (linear.rope_theta, linear.rope_local_theta, linear.rope_linear_factor) == (1e4, 1e3, 8.0)


def _hf_logprob(model_dir: str, ids: list[int], token: int) -> float:
    return float(torch.log_softmax(hf_next_logits(model_dir, ids), dim=-1)[token])


@pytest.mark.parametrize("model_fixture,backend", [
    ("gemma_dir", "torch"),
    ("gemma_dir", "cpu"),  # the C decode kernel, its window included
    ("gemma_linear_dir", "torch"),
])
def test_greedy_and_logprobs_match_hf(request, model_fixture, backend):
    """Prompts of 1..40 tokens batched under a 16-token budget (chunked prefill), 24+ greedy tokens each: the tokens
    equal `generate()`'s, and each token's logprob equals HF's (fp32, 1e-4), which the greedy tokens alone cannot
    show for the soft-capping (tanh keeps the argmax)."""
    model_dir = request.getfixturevalue(model_fixture)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 6, 19, 40)]
    max_tokens = [24, 30, 26, 25]
    parts, reqs, chunked = run_greedy(model_dir, prompts, max_tokens, backend)
    assert chunked, "the test meant to exercise chunked prefill"
    for req, p, n in zip(reqs, prompts, max_tokens):
        assert req.output_token_ids == hf_greedy(model_dir, p, n), req.request_id

    # logprobs take the sampler's per-request path; a few tokens of the longest prompt (past the window) suffice
    logged = Request("lp", prompts[3], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0))
    events = [e for e in run_until_idle(parts, [logged]) if e.request_id == "lp"]
    ids = list(prompts[3])
    for e in events:
        assert abs(e.token.logprob - _hf_logprob(model_dir, ids, e.token.token_id)) < 1e-4, len(ids)
        ids.append(e.token.token_id)
    assert len(ids) == 46


@pytest.fixture(scope="module")
def gemma_state(gemma_dir):
    from transformers import AutoConfig

    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(gemma_dir), name="g", path="")
    return cfg, load_state_dict(Path(gemma_dir))


def test_load_is_strict(gemma_state):
    cfg, state = gemma_state
    ops = select_ops("torch", "cpu")
    Model(cfg, ops).load_weights(state)
    with pytest.raises(ValueError, match=re.escape("model.layers.0.extra.weight")):
        Model(cfg, ops).load_weights({**state, "model.layers.0.extra.weight": torch.zeros(1)})
    missing = "model.layers.3.pre_feedforward_layernorm.weight"
    with pytest.raises(KeyError, match=re.escape("layers.3.pre_feedforward_layernorm.weight")):
        Model(cfg, ops).load_weights({k: v for k, v in state.items() if k != missing})


@pytest.mark.parametrize("overrides,message", [
    (dict(attn_logit_softcapping=50.0), "gemma3_text: attn_logit_softcapping=50.0 is not supported"),
    (dict(use_bidirectional_attention=True), "gemma3_text: use_bidirectional_attention=True is not supported"),
    (dict(hidden_activation="gelu"), "gemma3_text: hidden_activation='gelu' is not supported"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
     "gemma3_text: rope_type 'yarn' for full_attention layers is not supported"),
    (dict(layer_types=["sliding_attention", "chunked_attention"], num_hidden_layers=2),
     "gemma3_text: layer_types[1]='chunked_attention' is not supported"),
])
def test_refuses_what_it_does_not_implement(overrides, message):
    from transformers import Gemma3TextConfig

    hf_cfg = Gemma3TextConfig(**{**GEMMA, **overrides})
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelConfig.from_hf(hf_cfg, name="g", path="")
