"""common.kernel.model: exact shapes and counts of the real LLaMAs, and the blocks against plain math."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from common.kernel.model import (
    CONFIGS,
    Attention,
    LlamaConfig,
    RMSNorm,
    build_model,
    count_parameters,
    get_config,
    init_parameter,
    initializer,
    materialize,
    rope_cos_sin,
    rope_frequencies,
)

# Published parameter counts (the checkpoints' own tensors).
PARAMETER_COUNTS = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496,
    "llama3.1-405b": 405_853_388_800,
}
FFN_HIDDEN = {"llama2-7b": 11008, "llama2-70b": 28672, "llama3.1-8b": 14336, "llama3.1-405b": 53248}


# Every field of the named configs, pinned: for the real models, the values of Meta's params.json
# (norm_eps 1e-5 everywhere; LLaMA 3.1: rope_theta 500000 and use_scaled_rope with factor 8, low
# and high frequency factors 1 and 4, original context 8192). A changed eps or theta keeps the
# parameter count and changes every number the model computes.
L31_ROPE = (8.0, 1.0, 4.0, 8192)
FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "ffn_dim_multiplier",
          "norm_eps", "rope_theta", "rope_scaling", "max_seq_len")
PUBLISHED = {
    "llama2-7b": (4096, 32, 32, 32, 32000, 256, None, 1e-5, 10000.0, None, 4096),
    "llama2-13b": (5120, 40, 40, 40, 32000, 256, None, 1e-5, 10000.0, None, 4096),
    "llama2-70b": (8192, 80, 64, 8, 32000, 4096, 1.3, 1e-5, 10000.0, None, 4096),
    "llama3.1-8b": (4096, 32, 32, 8, 128256, 1024, 1.3, 1e-5, 500000.0, L31_ROPE, 131072),
    "llama3.1-70b": (8192, 80, 64, 8, 128256, 4096, 1.3, 1e-5, 500000.0, L31_ROPE, 131072),
    "llama3.1-405b": (16384, 126, 128, 8, 128256, 4096, 1.2, 1e-5, 500000.0, L31_ROPE, 131072),
    # the course's demo sizes (every chapter's README quotes numbers computed from them)
    "tiny": (32, 8, 4, 4, 256, 16, None, 1e-5, 10000.0, None, 2048),
    "small": (256, 8, 8, 4, 256, 64, None, 1e-5, 10000.0, None, 2048),
    # MoE (tests/test_moe.py counts them): Mixtral 8x7B's params.json; DeepSeek-V3's config.json
    # (pre-training context 4096; its MLA fields below, which only the planner reads)
    "tiny-moe": (32, 8, 4, 4, 256, 16, None, 1e-5, 10000.0, None, 2048),
    "mixtral-8x7b": (4096, 32, 32, 8, 32000, 256, None, 1e-5, 1e6, None, 32768),
    "deepseek-v3": (7168, 61, 128, 128, 129280, 1024, 0.96, 1e-6, 10000.0, None, 4096),
}
MOE_FIELDS = ("n_experts", "top_k", "n_shared_experts", "moe_hidden_dim", "gate", "aux_loss_coef",
              "capacity_factor", "first_dense_layers", "bias_update_rate", "n_expert_groups", "topk_groups")
DENSE = (0, 2, 0, None, "softmax", 0.01, None, 0, 0.0, 1, 1)  # the defaults, unused by a dense model
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
MLA_PUBLISHED = {"deepseek-v3": (1536, 512, 128, 64, 128)}  # its config.json; planner-only
MOE_PUBLISHED = {
    "tiny-moe": (8, 2, 1, 32, "softmax", 0.01, None, 1, 0.0, 1, 1),
    "mixtral-8x7b": (8, 2, 0, 14336, "softmax", 0.02, None, 0, 0.0, 1, 1),
    "deepseek-v3": (256, 8, 1, 2048, "sigmoid", 1e-4, None, 3, 1e-3, 8, 4),
}


def test_named_configs_are_exactly_the_published_ones():
    assert set(PUBLISHED) == set(CONFIGS), "pin every named config here"
    for name, values in PUBLISHED.items():
        cfg = get_config(name)
        assert {f: getattr(cfg, f) for f in FIELDS} == dict(zip(FIELDS, values, strict=True)), name
        moe = MOE_PUBLISHED.get(name, DENSE)
        assert {f: getattr(cfg, f) for f in MOE_FIELDS} == dict(zip(MOE_FIELDS, moe, strict=True)), name
        mla = MLA_PUBLISHED.get(name, (0,) * 5)
        assert {f: getattr(cfg, f) for f in MLA_FIELDS} == dict(zip(MLA_FIELDS, mla, strict=True)), name
        assert {f.name for f in dataclasses.fields(cfg)} == {*FIELDS, *MOE_FIELDS, *MLA_FIELDS}, \
            "a new field: pin it"


@pytest.mark.parametrize("name", ["tiny", "llama3.1-8b"])
def test_the_model_uses_the_configs_norm_eps(name):
    cfg = get_config(name)
    model = build_model(cfg, device="meta")
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * cfg.n_layers + 1 and {m.eps for m in norms} == {cfg.norm_eps}


@pytest.mark.parametrize("name", PARAMETER_COUNTS)
def test_real_shapes_have_published_parameter_counts(name):
    model = build_model(get_config(name), device="meta")
    assert count_parameters(model) == PARAMETER_COUNTS[name]


@pytest.mark.parametrize("name", FFN_HIDDEN)
def test_ffn_hidden_size_rule(name):
    assert get_config(name).hidden_dim == FFN_HIDDEN[name]


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_demo_sizes_split_for_every_default(name):
    cfg = CONFIGS[name]
    assert cfg.n_heads % 4 == 0 and cfg.n_kv_heads % 4 == 0 and cfg.n_layers % 8 == 0


def test_bad_config_names_the_values():
    with pytest.raises(ValueError, match="n_heads=6 is not divisible by n_kv_heads=4"):
        LlamaConfig(dim=48, n_layers=1, n_heads=6, n_kv_heads=4, vocab_size=8)
    with pytest.raises(ValueError, match="unknown model 'huge'"):
        get_config("huge")


def plain_attention(attn: Attention, cfg: LlamaConfig, x: torch.Tensor) -> torch.Tensor:
    """Loops over batch, head and query position; RoPE through complex multiplication (as in
    Meta's reference code); the causal mask by slicing keys 0..t."""
    B, T, _ = x.shape
    hd, H, KV = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    rot = torch.polar(torch.ones(T, hd // 2, dtype=torch.float64),
                      torch.arange(T, dtype=torch.float64)[:, None] * rope_frequencies(cfg)[None])

    def rope(v: torch.Tensor) -> torch.Tensor:  # v: [T, hd]
        return torch.view_as_real(torch.view_as_complex(v.reshape(T, hd // 2, 2)) * rot).flatten(1)

    out = torch.zeros(B, T, H * hd, dtype=x.dtype)
    for b in range(B):
        q = (x[b] @ attn.wq.weight.T).view(T, H, hd)
        k = (x[b] @ attn.wk.weight.T).view(T, KV, hd)
        v = (x[b] @ attn.wv.weight.T).view(T, KV, hd)
        for h in range(H):
            kv = h // (H // KV)
            qh, kh = rope(q[:, h]), rope(k[:, kv])
            for t in range(T):
                scores = kh[: t + 1] @ qh[t] / math.sqrt(hd)
                out[b, t, h * hd : (h + 1) * hd] = torch.softmax(scores, 0) @ v[: t + 1, kv]
    return out @ attn.wo.weight.T


@given(heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (4, 4), (6, 3)]), head_dim=st.sampled_from([2, 4, 8]),
       T=st.integers(1, 6), B=st.integers(1, 2), scaled=st.booleans(), seed=st.integers(0, 2**16))
def test_attention_equals_plain_loop(heads, head_dim, T, B, scaled, seed):
    H, KV = heads
    cfg = LlamaConfig(dim=H * head_dim, n_layers=1, n_heads=H, n_kv_heads=KV, vocab_size=8,
                      rope_theta=50.0, rope_scaling=(4.0, 1.0, 2.0, 4) if scaled else None)
    torch.manual_seed(seed)
    attn = Attention(cfg).double()
    x = torch.randn(B, T, cfg.dim, dtype=torch.float64)
    cos, sin = rope_cos_sin(cfg, torch.arange(T), torch.float64)
    torch.testing.assert_close(attn(x, cos, sin), plain_attention(attn, cfg, x), rtol=1e-12, atol=1e-12)


def test_llama31_rope_scaling_keeps_high_and_divides_low_frequencies():
    cfg = get_config("llama3.1-8b")
    plain = get_config("llama3.1-8b", rope_scaling=None)
    scaled, base = rope_frequencies(cfg), rope_frequencies(plain)
    wavelen = 2 * math.pi / base
    assert torch.equal(scaled[wavelen < 8192 / 4], base[wavelen < 8192 / 4])
    torch.testing.assert_close(scaled[wavelen > 8192], base[wavelen > 8192] / 8, rtol=1e-15, atol=0)
    between = (wavelen >= 8192 / 4) & (wavelen <= 8192)
    assert between.any() and ((scaled[between] < base[between]) & (scaled[between] > base[between] / 8)).all()


def test_rmsnorm_formula():
    norm = RMSNorm(5, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(torch.arange(1.0, 6.0))
    x = torch.randn(3, 5, dtype=torch.float64)
    expected = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6) * torch.arange(1.0, 6.0)
    torch.testing.assert_close(norm(x), expected, rtol=1e-14, atol=1e-14)


def test_init_is_a_function_of_the_seed_alone():
    cfg = get_config("tiny", n_layers=2)
    a, b = build_model(cfg, seed=3), build_model(cfg, seed=3)
    c, d = build_model(cfg, seed=4), build_model(cfg, seed=3, dtype=torch.float64)
    for (name, pa), pb, pc, pd in zip(a.named_parameters(), b.parameters(), c.parameters(),
                                      d.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        assert torch.equal(pa, pd.float()), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name


def test_model_is_causal_and_loss_starts_near_log_vocab():
    cfg = get_config("tiny", n_layers=2)
    model = build_model(cfg, seed=0, dtype=torch.float64)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9))
    changed = tokens.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % cfg.vocab_size
    torch.testing.assert_close(model(tokens)[:, :5], model(changed)[:, :5], rtol=0, atol=0)
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1


def test_init_is_addressable_per_parameter():
    """Each parameter is a function of (seed, its full name) alone: drawn by name, in any order,
    or materialized into a piece of a meta model, it equals build_model's; parameters of the same
    shape differ, and the std is the one init_std names."""
    cfg = get_config("tiny", n_layers=2)
    model = build_model(cfg, seed=5, dtype=torch.float64)
    init = initializer(cfg, 5)
    for name, p in reversed(list(model.named_parameters())):
        assert torch.equal(p, init(name)), name
        assert torch.equal(p, init_parameter(name, p.shape, 5, cfg.n_layers)), name
    wq0, wq1 = model.layers[0].attention.wq.weight, model.layers[1].attention.wq.weight
    assert not torch.equal(wq0, wq1)
    assert abs(wq0.std().item() - 0.02) < 2e-3
    assert abs(model.layers[0].attention.wo.weight.std().item() - 0.02 / math.sqrt(4)) < 1e-3
    block = build_model(cfg, dtype=torch.float32, device="meta").layers[1]  # one block of a meta model
    materialize(block, lambda n: init(f"layers.1.{n}"), "cpu", lambda n, full: full.flip(0))
    for name, p in block.named_parameters():
        full = model.get_parameter(f"layers.1.{name}")
        assert p.device.type == "cpu" and p.dtype == torch.float32, name
        assert torch.equal(p, full.flip(0).float()), name
    with pytest.raises(ValueError, match="local piece has shape"):
        materialize(build_model(cfg, device="meta"), init, "cpu", lambda n, full: full[:1])
