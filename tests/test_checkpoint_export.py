"""Chapter 07 export: a sharded checkpoint → one plain state dict (common's names), or Hugging
Face's LLaMA layout with q/k rows permuted to rotate_half, and back (parallel3d.export)."""

from __future__ import annotations

import importlib.util
import json
import math
import runpy
import sys
from dataclasses import asdict

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import common.model
from common.model import CONFIGS, build_model, get_config
from parallel3d.checkpoint import Shard, save_checkpoint
from parallel3d.export import (
    HF_NAMES,
    HF_TOP,
    config_from_hf,
    from_hf,
    halves_to_interleaved,
    hf_config,
    interleaved_to_halves,
    load_state_dict,
    main,
    to_hf,
)
from parallel3d.shard_layout import llama_3d_layout
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


def apply_rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotary: x·cos + rotate_half(x)·sin, frequencies repeated over the two halves."""
    cos, sin = torch.cat([cos, cos], -1)[:, None, :], torch.cat([sin, sin], -1)[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def hf_layout_logits(monkeypatch, state: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Logits of common's model run with HF's rotary on `state` in HF's layout (names mapped back
    without undoing any permutation)."""
    names = {v: k for k, v in HF_TOP.items()}
    names.update({f"model.layers.{i}.{v}": f"layers.{i}.{k}" for i in range(CFG.n_layers)
                  for k, v in HF_NAMES.items()})
    model = build_model(CFG, dtype=torch.float64)
    model.load_state_dict({names[k]: v for k, v in state.items()})
    with monkeypatch.context() as m:
        m.setattr(common.model, "apply_rope", apply_rope_rotate_half)
        return model(tokens)


def test_permuted_weights_give_identical_logits_under_hf_rotary(monkeypatch):
    model = build_model(CFG, seed=1, dtype=torch.float64)
    tokens = torch.randint(0, CFG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    expected = model(tokens)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    got = hf_layout_logits(monkeypatch, to_hf(state, CFG), tokens)
    assert (got - expected).abs().max().item() <= 1e-12 * expected.abs().max().item()
    # negative control: HF names without the permutation are a different model
    unpermuted = dict(to_hf(state, CFG))
    for i in range(CFG.n_layers):
        for short in ("q_proj", "k_proj"):
            common_name = f"layers.{i}.attention.w{short[0]}.weight"
            unpermuted[f"model.layers.{i}.self_attn.{short}.weight"] = state[common_name]
    wrong = hf_layout_logits(monkeypatch, unpermuted, tokens)
    assert (wrong - expected).abs().max().item() > 1e-3 * expected.abs().max().item()


def test_hf_state_dict_imports_back_to_the_same_weights():
    state = {k: v.detach() for k, v in build_model(CFG, seed=2, dtype=torch.float64).state_dict().items()}
    back = from_hf(to_hf(state, CFG), CFG)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_config_round_trips_every_named_config(name):
    cfg = CONFIGS[name]
    back = config_from_hf(json.loads(json.dumps(hf_config(cfg, torch.float32))))
    keep = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim", "norm_eps",
            "rope_theta", "rope_scaling", "max_seq_len")
    assert all(getattr(back, k) == getattr(cfg, k) for k in keep)


def _save_tp_fsdp(rank: int, root: str, state: dict) -> None:
    """Save `state` as ranks of a dp2 × tp2 mesh would (flat FSDP pieces of TP slices)."""
    from parallel3d.reshard import extract

    shards = {n: Shard(extract(state[n], r), r.global_shape, r.offsets, r.box_shape, r.flat_start)
              for n, r in llama_3d_layout(CFG, 2, 1, 2, rank).items()}
    save_checkpoint(root, 4, shards, {"step": 4}, config={"model": asdict(CFG)})


def test_export_consolidates_a_sharded_checkpoint_and_round_trips_through_hf(tmp_path):
    state = {k: v.detach() for k, v in build_model(CFG, seed=3, dtype=torch.float64).state_dict().items()}
    assert run_forked(4, _save_tp_fsdp, str(tmp_path / "ckpt"), state) == [0, 0, 0, 0]
    assert main([str(tmp_path / "ckpt"), "--out", str(tmp_path / "model.pt")]) == 0
    plain = load_state_dict(tmp_path / "model.pt")
    assert plain.keys() == state.keys() and all(torch.equal(plain[k], state[k]) for k in state)

    assert main([str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--hf"]) == 0
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (hf_cfg["hidden_size"], hf_cfg["num_key_value_heads"], hf_cfg["intermediate_size"]) == \
        (CFG.dim, CFG.n_kv_heads, CFG.hidden_dim)
    assert main([str(tmp_path / "hf"), "--from-hf", "--out", str(tmp_path / "back.pt")]) == 0
    back = load_state_dict(tmp_path / "back.pt")
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_export_module_entry_point_reports_a_bad_checkpoint_in_one_line(tmp_path, monkeypatch, capsys):
    """`python -m parallel3d.export` (run in-process: the module as __main__)."""
    monkeypatch.setattr(sys, "argv", ["export", str(tmp_path / "none"), "--out", str(tmp_path / "x.pt")])
    monkeypatch.delitem(sys.modules, "parallel3d.export")  # run it fresh, as `-m` does
    with pytest.raises(SystemExit) as info:
        runpy.run_module("parallel3d.export", run_name="__main__")
    assert info.value.code == 2
    expected = f"error: checkpoint directory {tmp_path / 'none'} does not exist"
    assert capsys.readouterr().err.strip() == expected


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed: the LlamaForCausalLM round trip is skipped "
                           "(pip install transformers to run it)")
def test_exported_model_gives_the_same_logits_in_transformers(tmp_path):
    from transformers import LlamaForCausalLM

    model = build_model(CFG, seed=4, dtype=torch.float64)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    save_checkpoint(tmp_path / "ckpt", 1, state, {"step": 1}, config={"model": asdict(CFG)})
    assert main([str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--hf"]) == 0
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float64,
                                          attn_implementation="eager")
    tokens = torch.randint(0, CFG.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    expected = model(tokens)
    got = hf(tokens).logits
    assert (got - expected).abs().max().item() <= 1e-10 * expected.abs().max().item()
    back = from_hf(hf.state_dict(), CFG)
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert math.isfinite(got.sum().item())
