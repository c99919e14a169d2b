"""Export a sharded checkpoint as one plain state dict of common's LLaMA, or in Hugging Face's
LLaMA layout; and import an HF LLaMA state dict back (`python -m parallel3d.checkpoint.export`):

    CKPT --out model.pt               common names, torch.save
    CKPT --out model.safetensors      the same, if safetensors is installed
    CKPT --out hf_dir --hf            config.json + model.safetensors (or pytorch_model.bin),
                                      for LlamaForCausalLM.from_pretrained
    hf_dir --from-hf --out model.pt   HF → common names (to start a run here)

Rotary layouts. common (like Meta's original LLaMA) rotates interleaved pairs of each head's
dimensions, (x[2i], x[2i+1]); HF's LlamaForCausalLM rotates halves, (x[i], x[i + d/2])
(`rotate_half`). Attention scores q·k are unchanged by permuting q's and k's head dimensions the
same way, so exporting permutes the *rows* of wq and wk within each head:

    row 2i of a head → row i,   row 2i+1 → row i + d/2        (HF's convert_llama_weights_to_hf.py)

wv, wo and everything else keep their layout; only names change.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import fields
from pathlib import Path

import torch

from common.kernel.model import LlamaConfig, get_config
from parallel3d.checkpoint.load import read_full
from parallel3d.checkpoint.save import CheckpointError
from parallel3d.checkpoint.state import OPTIM

HF_NAMES = {  # common name (per block: after "layers.{i}.") → HF name
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
HF_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}
BLOCK = re.compile(r"^layers\.(\d+)\.(.+)$")
HF_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of wq/wk from Meta's pair layout to HF's half layout, head by head."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def halves_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `interleaved_to_halves`."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def to_hf(state: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """common's state dict → HF LlamaForCausalLM's (q/k rows permuted to rotate_half)."""
    out = {}
    for name, t in state.items():
        if name in HF_TOP:
            out[HF_TOP[name]] = t
            continue
        i, rest = BLOCK.match(name).groups()
        if rest == "attention.wq.weight":
            t = interleaved_to_halves(t, cfg.n_heads)
        elif rest == "attention.wk.weight":
            t = interleaved_to_halves(t, cfg.n_kv_heads)
        out[f"model.layers.{i}.{HF_NAMES[rest]}"] = t.contiguous()
    return out


def from_hf(state: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """HF LlamaForCausalLM's state dict → common's (buffers such as rotary inv_freq dropped)."""
    top = {v: k for k, v in HF_TOP.items()}
    block = {v: k for k, v in HF_NAMES.items()}
    out = {}
    for name, t in state.items():
        if name in top:
            out[top[name]] = t
            continue
        m = HF_BLOCK.match(name)
        if m is None or m.group(2) not in block:
            continue
        i, rest = m.group(1), block[m.group(2)]
        if rest == "attention.wq.weight":
            t = halves_to_interleaved(t, cfg.n_heads)
        elif rest == "attention.wk.weight":
            t = halves_to_interleaved(t, cfg.n_kv_heads)
        out[f"layers.{i}.{rest}"] = t.contiguous()
    return out


def hf_config(cfg: LlamaConfig, dtype: torch.dtype) -> dict:
    """config.json for transformers' LlamaForCausalLM with the same architecture."""
    scaling = None
    if cfg.rope_scaling is not None:
        factor, low, high, ctx = cfg.rope_scaling
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                   "high_freq_factor": high, "original_max_position_embeddings": ctx}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": cfg.dim, "intermediate_size": cfg.hidden_dim,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "rope_scaling": scaling, "max_position_embeddings": cfg.max_seq_len,
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
            "torch_dtype": str(dtype).removeprefix("torch.")}


def config_from_hf(hf: dict) -> LlamaConfig:
    """The LlamaConfig of an HF config.json (intermediate_size given: multiple_of reproduces it)."""
    scaling = hf.get("rope_scaling")
    cfg = LlamaConfig(
        dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        vocab_size=hf["vocab_size"], multiple_of=hf["intermediate_size"],
        ffn_dim_multiplier=hf["intermediate_size"] / int(8 * hf["hidden_size"] / 3),
        norm_eps=hf.get("rms_norm_eps", 1e-5), rope_theta=hf.get("rope_theta", 10000.0),
        rope_scaling=None if not scaling else (scaling["factor"], scaling["low_freq_factor"],
                                               scaling["high_freq_factor"],
                                               scaling["original_max_position_embeddings"]),
        max_seq_len=hf.get("max_position_embeddings", 2048))
    if cfg.hidden_dim != hf["intermediate_size"]:
        raise ValueError(f"intermediate_size {hf['intermediate_size']} is not reproduced "
                         f"({cfg.hidden_dim}): set multiple_of/ffn_dim_multiplier by hand")
    return cfg


def model_config_of(meta: dict) -> LlamaConfig:
    """The LlamaConfig a checkpoint was saved with: metadata's config["model"] (a dict of
    LlamaConfig's fields, or a named config)."""
    model = (meta.get("config") or {}).get("model")
    if isinstance(model, str):
        return get_config(model)
    if isinstance(model, dict):
        names = {f.name for f in fields(LlamaConfig)}
        kwargs = {k: (tuple(v) if isinstance(v, list) else v) for k, v in model.items() if k in names}
        return LlamaConfig(**kwargs)
    raise CheckpointError("the checkpoint's metadata.json has no config['model'] (the LlamaConfig "
                          "it was saved with): pass --model NAME")


def consolidate(path: str | Path, model: str | None = None) -> tuple[dict[str, torch.Tensor], LlamaConfig]:
    """The whole model's weights from a sharded checkpoint (optimizer state left out)."""
    state, meta = read_full(path)
    state = {n: t for n, t in state.items() if not n.startswith(OPTIM)}
    return state, get_config(model) if model else model_config_of(meta)


def save_weights(state: dict[str, torch.Tensor], path: Path) -> Path:
    """safetensors for a .safetensors path (needs the package), torch.save otherwise."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise SystemExit(f"--out {path}: safetensors is not installed (pip install safetensors), "
                             "or write a .pt file") from None
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    else:
        torch.save(state, path)
    return path


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def export_hf(state: dict[str, torch.Tensor], cfg: LlamaConfig, out: Path) -> Path:
    """A directory LlamaForCausalLM.from_pretrained can read."""
    out.mkdir(parents=True, exist_ok=True)
    hf = to_hf(state, cfg)
    dtype = next(iter(hf.values())).dtype
    (out / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n")
    try:
        import safetensors  # noqa: F401
        return save_weights(hf, out / "model.safetensors")
    except ImportError:
        return save_weights(hf, out / "pytorch_model.bin")


def import_hf(directory: Path) -> tuple[dict[str, torch.Tensor], LlamaConfig]:
    """An HF LLaMA directory (config.json + model.safetensors or pytorch_model.bin) → common's."""
    cfg = config_from_hf(json.loads((directory / "config.json").read_text()))
    files = [directory / "model.safetensors", directory / "pytorch_model.bin"]
    file = next((f for f in files if f.exists()), None)
    if file is None:
        raise SystemExit(f"{directory}: no model.safetensors or pytorch_model.bin")
    return from_hf(load_weights(file), cfg), cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="checkpoint directory (root with `latest`, or a step-* directory); "
                                "with --from-hf, an HF model directory")
    p.add_argument("--out", required=True, help="output file (.pt or .safetensors), or directory with --hf")
    p.add_argument("--hf", action="store_true", help="Hugging Face LLaMA names and rotary layout")
    p.add_argument("--from-hf", action="store_true", help="import an HF LLaMA directory instead")
    p.add_argument("--model", default=None, help="named config, if the checkpoint does not record one")
    args = p.parse_args(argv)
    out = Path(args.out)
    try:
        if args.from_hf:
            state, cfg = import_hf(Path(args.path))
            written = save_weights(state, out)
        else:
            state, cfg = consolidate(args.path, args.model)
            written = export_hf(state, cfg, out) if args.hf else save_weights(state, out)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    numel = sum(t.numel() for t in state.values())
    print(f"wrote {written}: {len(state)} tensors, {numel:,} parameters, dim {cfg.dim}, "
          f"{cfg.n_layers} layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
