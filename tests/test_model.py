"""common.model: exact shapes and counts of the real LLaMAs, and the blocks against plain math."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from common.model import (
    CONFIGS,
    Attention,
    LlamaConfig,
    RMSNorm,
    build_model,
    count_parameters,
    get_config,
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
