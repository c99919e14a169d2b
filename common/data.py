"""Deterministic batches: the same global batch for step s on every rank and in the reference.

A source returns the global batch of step s as tokens [global_batch, seq_len + 1]; inputs are
tokens[:, :-1] and targets tokens[:, 1:]. A data-parallel rank takes its contiguous slice of
global_batch / dp rows and cuts it into micro-batches; the reference takes all of it.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parent.parent


class SyntheticTokens:
    """Uniform random tokens, a pure function of (seed, step)."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def global_batch(self, step: int, batch_size: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randint(0, self.vocab_size, (batch_size, self.seq_len + 1), generator=gen)


def repo_text_files() -> list[Path]:
    """This repository's Markdown and Python, sorted, outside hidden folders (.venv, .git: walking
    the virtual environment's ~10⁵ entries took ~1.2 s in every rank of every run)."""
    files = []
    for folder, dirs, names in os.walk(REPO_ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        files += [Path(folder) / n for n in names if n.endswith((".md", ".py"))]
    return sorted(files)


class ByteCorpus:
    """Byte-level language modelling (vocab 256) on a text file, or by default on this
    repository's own Markdown and Python: windows at offsets drawn from (seed, step), so the
    demo's loss visibly falls."""

    def __init__(self, seq_len: int, seed: int = 0, path: str | Path | None = None):
        if path is None:
            raw = b"\n".join(p.read_bytes() for p in repo_text_files())
        else:
            raw = Path(path).read_bytes()
        if len(raw) < seq_len + 2:
            raise ValueError(f"--data {path} has {len(raw)} bytes; need more than seq_len + 1 = "
                             f"{seq_len + 1}")
        self.data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
        self.vocab_size, self.seq_len, self.seed = 256, seq_len, seed

    def global_batch(self, step: int, batch_size: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.data) - self.seq_len - 1, (batch_size,), generator=gen)
        return torch.stack([self.data[s : s + self.seq_len + 1] for s in starts.tolist()])


def split_inputs_targets(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return tokens[:, :-1], tokens[:, 1:]


def local_micro_batches(tokens: torch.Tensor, dp_rank: int, dp_size: int,
                        micro_batch: int) -> list[torch.Tensor]:
    """This data-parallel rank's rows [r·B/dp, (r+1)·B/dp) of the global batch, in micro-batches."""
    rows = tokens.shape[0] // dp_size
    local = tokens[dp_rank * rows : (dp_rank + 1) * rows]
    return list(local.split(micro_batch))


def make_data(source: str | None, vocab: int, seq_len: int, seed: int, device: torch.device | None = None):
    """The token source of `--data` (`source`: a file, None for this repository's text, or
    "synthetic"). A byte corpus is read by every rank on its own, so (with a process group) the
    ranks compare a checksum of what they read: a file edited while the job started would
    otherwise give the ranks different data, silently."""
    if source == "synthetic":
        return SyntheticTokens(vocab, seq_len, seed)
    corpus = ByteCorpus(seq_len, seed, source)
    if dist.is_initialized() and dist.get_world_size() > 1:
        digest = zlib.crc32(corpus.data.to(torch.uint8).numpy().tobytes())
        ends = torch.tensor([digest, -digest, len(corpus.data), -len(corpus.data)],
                            dtype=torch.int64, device=device)
        dist.all_reduce(ends, op=dist.ReduceOp.MAX)
        if ends[0] != -ends[1] or ends[2] != -ends[3]:
            raise RuntimeError(f"the ranks read different corpora from --data {source or '(repo)'}: "
                               "a file changed while the job started; rerun, or pass a fixed --data FILE")
    return corpus
