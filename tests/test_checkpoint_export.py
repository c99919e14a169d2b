"""Chapter 07 export: a sharded checkpoint → one plain state dict (common's names), or Hugging
Face's LLaMA layout with q/k rows permuted to rotate_half, and back (parallel3d.checkpoint.export).
The HF layout is checked against transformers' own LlamaForCausalLM (a dev dependency)."""

from __future__ import annotations

import json
import math
import runpy
import sys
from dataclasses import asdict

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from common.kernel.model import CONFIGS, build_model, get_config
from parallel3d.checkpoint.export import (
    config_from_hf,
    from_hf,
    halves_to_interleaved,
    hf_config,
    interleaved_to_halves,
    load_weights,
    main,
)
from parallel3d.checkpoint.save import Shard, save_checkpoint
from parallel3d.checkpoint.shard_layout import llama_3d_layout
from tests.forked import run_forked

CFG = get_config("tiny", n_layers=2, n_kv_heads=2)  # GQA: wk is permuted with its own head count


@given(heads=st.integers(1, 4), half=st.integers(1, 4), cols=st.integers(1, 5))
def test_rotary_permutation_round_trips_and_moves_pairs_to_halves(heads, half, cols):
    d = 2 * half
    w = torch.arange(heads * d * cols, dtype=torch.float64).view(heads * d, cols)
    hf = interleaved_to_halves(w, heads)
    assert torch.equal(halves_to_interleaved(hf, heads), w)
    for h in range(heads):  # head h's row 2i lands at i, row 2i+1 at i + d/2
        for i in range(half):
            assert torch.equal(hf[h * d + i], w[h * d + 2 * i])
            assert torch.equal(hf[h * d + half + i], w[h * d + 2 * i + 1])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_config_round_trips_every_named_config(name):
    cfg = CONFIGS[name]
    back = config_from_hf(json.loads(json.dumps(hf_config(cfg, torch.float32))))
    keep = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim", "norm_eps",
            "rope_theta", "rope_scaling", "max_seq_len")
    assert all(getattr(back, k) == getattr(cfg, k) for k in keep)


def _save_tp_fsdp(rank: int, root: str, state: dict) -> None:
    """Save `state` as ranks of a dp2 × tp2 mesh would (flat FSDP pieces of TP slices)."""
    from parallel3d.checkpoint.reshard import extract

    shards = {n: Shard(extract(state[n], r), r.global_shape, r.offsets, r.box_shape, r.flat_start)
              for n, r in llama_3d_layout(CFG, 2, 1, 2, rank).items()}
    save_checkpoint(root, 4, shards, {"step": 4}, config={"model": asdict(CFG)})


def test_export_consolidates_a_sharded_checkpoint_and_round_trips_through_hf(tmp_path):
    state = {k: v.detach() for k, v in build_model(CFG, seed=3, dtype=torch.float64).state_dict().items()}
    assert run_forked(4, _save_tp_fsdp, str(tmp_path / "ckpt"), state) == [0, 0, 0, 0]
    assert main([str(tmp_path / "ckpt"), "--out", str(tmp_path / "model.pt")]) == 0
    plain = load_weights(tmp_path / "model.pt")
    assert plain.keys() == state.keys() and all(torch.equal(plain[k], state[k]) for k in state)

    assert main([str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--hf"]) == 0
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (hf_cfg["hidden_size"], hf_cfg["num_key_value_heads"], hf_cfg["intermediate_size"]) == \
        (CFG.dim, CFG.n_kv_heads, CFG.hidden_dim)
    assert main([str(tmp_path / "hf"), "--from-hf", "--out", str(tmp_path / "back.pt")]) == 0
    back = load_weights(tmp_path / "back.pt")
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_export_module_entry_point_reports_a_bad_checkpoint_in_one_line(tmp_path, monkeypatch, capsys):
    """`python -m parallel3d.checkpoint.export` (run in-process: the module as __main__)."""
    monkeypatch.setattr(sys, "argv", ["export", str(tmp_path / "none"), "--out", str(tmp_path / "x.pt")])
    monkeypatch.delitem(sys.modules, "parallel3d.checkpoint.export")  # run it fresh, as `-m` does
    with pytest.raises(SystemExit) as info:
        runpy.run_module("parallel3d.checkpoint.export", run_name="__main__")
    assert info.value.code == 2
    expected = f"error: checkpoint directory {tmp_path / 'none'} does not exist"
    assert capsys.readouterr().err.strip() == expected


def hf_llama_computes_in_its_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """Patch HF's LLaMA so that a float64 model computes in float64. HF upcasts RMSNorm and
    RoPE (cos, sin of float32 frequencies) to float32 on purpose, for bf16 training; eager
    attention's softmax too (the test uses sdpa, which keeps the dtype). Unpatched, a float64
    model agrees with common's only to ~6e-8 relative, float32's rounding, not an export error.
        RMSNorm(x) = g · x / sqrt(mean(x²) + eps)      cos, sin of p · θ^(-2i/d), repeated over halves
    """
    from transformers.models.llama import modeling_llama as hf

    def rms_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.rope_type == "default", "only the unscaled rotary is promoted here"
        cfg = self.config
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        theta = cfg.rope_parameters["rope_theta"]
        inv_freq = theta ** -(torch.arange(0, dim, 2, dtype=torch.float64, device=x.device) / dim)
        # HF's own float32 frequencies, read from the exported config.json, are these rounded
        torch.testing.assert_close(self.inv_freq.double(), inv_freq, rtol=1e-7, atol=0)
        angles = position_ids[..., None].double() * inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    monkeypatch.setattr(hf.LlamaRMSNorm, "forward", rms_norm)
    monkeypatch.setattr(hf.LlamaRotaryEmbedding, "forward", rotary)


def test_exported_model_gives_the_same_logits_in_transformers(tmp_path, monkeypatch):
    """The export's only check against the real consumer: LlamaForCausalLM.from_pretrained on the
    exported folder, float64 throughout (hf_llama_computes_in_its_dtype), so the 1e-10 gate holds
    and any layout or config error (a transposed weight, a wrong rotary permutation, norm_eps,
    rope_theta) shows. transformers is in the dev extra: `make test` installs it."""
    from transformers import LlamaForCausalLM

    hf_llama_computes_in_its_dtype(monkeypatch)
    model = build_model(CFG, seed=4, dtype=torch.float64)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    save_checkpoint(tmp_path / "ckpt", 1, state, {"step": 1}, config={"model": asdict(CFG)})
    assert main([str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--hf"]) == 0
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64, attn_implementation="sdpa")
    tokens = torch.randint(0, CFG.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    expected = model(tokens)
    got = hf(tokens).logits
    assert got.dtype == torch.float64 and math.isfinite(got.sum().item())
    assert (got - expected).abs().max().item() <= 1e-10 * expected.abs().max().item()
    back = from_hf(hf.state_dict(), CFG)
    assert all(torch.equal(back[k], state[k]) for k in state)
