"""The stage split: a LLaMA cut by layers into p·v chunks, each a module that one rank runs.

    virtual stage s = c·p + r  (rank r's chunk c)        S = p·v stages in all
    stage 0      tok_embeddings + its layers
    stage S-1    its layers + norm + output (the head; the loss is the executor's callable)
    layers       an even split by default (the first n_layers mod S stages take one more);
                 an explicit `partition` (layers per stage, summing to n_layers) for uneven ones

A chunk keeps the model's own submodules under the model's own names (`layers` is a ModuleDict
keyed by the global layer index), so `chunk.named_parameters()` yields exactly the reference's
names ("layers.5.attention.wq.weight", "output.weight", …) and whatever replaced a block (tensor-
parallel linears, an FSDP unit) comes along unchanged. Per message between stages: an activation
[micro_batch, seq_len, dim] forward and its gradient of the same shape backward.

RoPE's positions travel with the batch: `forward(x, positions)` takes the positions of the tokens
this rank's attention sees, computed once per micro-batch from the batch's layout (0 … s−1, or a
context-parallel rank's zig-zag positions) and handed by the executor to every chunk, like
`Llama.forward(tokens, positions)`. A later stage cannot read them off its input: under sequence
parallelism it holds s/t of the tokens, under context parallelism not the first ones.

`LlamaChunk` is named for what it is: a chunk (Megatron's word for the part of the model one
virtual stage runs, and the executor's `chunks`) of LLaMA. It is not torch's
`torch.distributed.pipelining.PipelineStage`, the communication wrapper around a stage's module:
ours is the module, and executor.py does the communication.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

from common.kernel.model import LlamaConfig, rope_cos_sin


def partition_error(n_layers: int, p: int, v: int = 1, partition: Sequence[int] | None = None) -> str | None:
    """Why the layers cannot be split into p·v stages as asked (a message naming the flag and
    the fix), or None."""
    S = p * v
    if partition is not None:
        if len(partition) != S:
            return (f"--partition {','.join(map(str, partition))} has {len(partition)} entries for "
                    f"{p} stages × {v} virtual stages: give {S} layer counts")
        if sum(partition) != n_layers or min(partition) < 1:
            return (f"--partition {','.join(map(str, partition))}: each stage needs >= 1 layer and "
                    f"the counts must sum to the model's {n_layers} layers")
        return None
    if n_layers < S:
        return (f"{p} stages × {v} virtual stages = {S} > the model's {n_layers} layers: every stage "
                f"needs a layer; use at most {n_layers} stages (NPROC) or a model with more layers")
    if v > 1 and n_layers % S:
        return (f"--virtual-stages {v} on {p} stages: the model's {n_layers} layers are not divisible "
                f"by p·v = {S} (interleaving needs equal chunks); pick v so that p·v divides {n_layers}")
    return None


def layer_partition(n_layers: int, n_stages: int, partition: Sequence[int] | None = None) -> list[range]:
    """The global layer indices of each virtual stage."""
    counts = list(partition) if partition is not None else [
        n_layers // n_stages + (s < n_layers % n_stages) for s in range(n_stages)]
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


class LlamaChunk(nn.Module):
    """One virtual stage of LLaMA: [tok_embeddings] → layers → [norm → output]. forward(x,
    positions) takes tokens on the first stage, the previous stage's activation otherwise, and
    the RoPE positions of the tokens attention sees; returns the activation, or the logits on the
    last stage."""

    def __init__(self, stage: int, n_stages: int, cfg: LlamaConfig, layers: dict[str, nn.Module],
                 tok_embeddings: nn.Module | None = None, norm: nn.Module | None = None,
                 output: nn.Module | None = None):
        super().__init__()
        self.stage, self.n_stages, self.cfg = stage, n_stages, cfg
        self.tok_embeddings = tok_embeddings
        self.layers = nn.ModuleDict(layers)
        self.norm, self.output = norm, output

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.n_stages - 1

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        cos, sin = rope_cos_sin(self.cfg, positions, h.dtype)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return self.output(self.norm(h)) if self.output is not None else h


def split_model(model: nn.Module, p: int, v: int, rank: int,
                partition: Sequence[int] | None = None,
                stages: Sequence[int] | None = None) -> list[LlamaChunk]:
    """Rank `rank`'s chunks [stage rank, stage p + rank, …, stage (v-1)·p + rank] of common.kernel.model's
    Llama (its cfg and its attributes tok_embeddings, layers, norm, output), or the `stages` its
    schedule places on it (`Schedule.stages(rank)`, e.g. DualPipeV's r and 2p-1-r). The chunks share the
    model's modules; drop the model afterwards to free the other stages' layers (or split a model
    built on the meta device and materialize only the chunks: the other layers never exist)."""
    n_layers = len(model.layers)
    if (error := partition_error(n_layers, p, v, partition)) is not None:
        raise ValueError(error)
    S = p * v
    ranges = layer_partition(n_layers, S, partition)
    chunks = []
    for s in (stages if stages is not None else [c * p + rank for c in range(v)]):
        chunks.append(LlamaChunk(
            s, S, model.cfg, {str(i): model.layers[i] for i in ranges[s]},
            tok_embeddings=model.tok_embeddings if s == 0 else None,
            norm=model.norm if s == S - 1 else None, output=model.output if s == S - 1 else None))
    return chunks
