"""The ring all-reduce played out in one process, on plain tensors, step by step.

`simulate(tensors)` takes one tensor per (imaginary) rank and yields a `Snapshot` before the first
step and after each of the 2(n-1) steps: what every rank holds, chunk by chunk, which ranks'
contributions each chunk already contains (in the order they were folded in), and which chunk
every rank just sent to its right neighbour. It follows exactly the schedule of `ring.py`
(`reduce_scatter_chunks`, `all_gather_chunks`, `chunk_sizes`), so the drawing shows what the real
code does. `draw(snapshot)` renders one snapshot as text; `diagram(n)` the whole run.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .ring import all_gather_chunks, chunk_sizes, reduce_scatter_chunks

FOLDS = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum, "product": torch.mul}


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    chunk: int
    elements: int


@dataclass
class Snapshot:
    phase: str  # "start", "reduce-scatter" or "all-gather"
    step: int  # 1 … n-1 within the phase (0 at the start)
    n: int
    transfers: list[Transfer]  # what moved in this step (one per rank)
    chunks: list[list[torch.Tensor]]  # chunks[rank][i]: what rank holds of chunk i
    holds: list[list[tuple[int, ...]]]  # holds[rank][i]: ranks whose data chunk i contains, in order
    elements_sent: list[int]  # per rank, since the start

    def complete(self, rank: int, chunk: int) -> bool:
        return sorted(self.holds[rank][chunk]) == list(range(self.n))

    def result(self, rank: int) -> torch.Tensor:
        return torch.cat(self.chunks[rank])


def simulate(tensors: list[torch.Tensor], op: str = "sum") -> Iterator[Snapshot]:
    """Yield the state before the first step and after every one of the 2(n-1) steps."""
    n, length = len(tensors), tensors[0].numel()
    fold = FOLDS[op]
    chunks = [list(t.reshape(-1).clone().split(chunk_sizes(length, n))) for t in tensors]
    holds = [[(rank,)] * n for rank in range(n)]
    sent = [0] * n

    def snapshot(phase: str, step: int, transfers: list[Transfer]) -> Snapshot:
        return Snapshot(phase, step, n, transfers, [[c.clone() for c in row] for row in chunks],
                        [list(row) for row in holds], list(sent))

    yield snapshot("start", 0, [])
    for phase, schedule in (("reduce-scatter", reduce_scatter_chunks), ("all-gather", all_gather_chunks)):
        for step in range(n - 1):
            # Every rank sends at once: read all messages before anyone updates.
            transfers = [Transfer(r, (r + 1) % n, schedule(r, step, n)[0],
                                  chunks[r][schedule(r, step, n)[0]].numel()) for r in range(n)]
            messages = [(chunks[t.src][t.chunk].clone(), holds[t.src][t.chunk]) for t in transfers]
            for t, (data, contributors) in zip(transfers, messages, strict=True):
                assert t.chunk == schedule(t.dst, step, n)[1], "the receiver expects this chunk"
                sent[t.src] += t.elements
                if phase == "reduce-scatter":  # fold the partial into our own copy
                    chunks[t.dst][t.chunk] = fold(data, chunks[t.dst][t.chunk])
                    holds[t.dst][t.chunk] = contributors + holds[t.dst][t.chunk]
                else:  # a complete chunk replaces ours
                    chunks[t.dst][t.chunk] = data
                    holds[t.dst][t.chunk] = contributors
            yield snapshot(phase, step + 1, transfers)


def _cell(contributors: tuple[int, ...], n: int) -> str:
    text = "+".join(map(str, contributors))
    return "Σ" + text if len(contributors) == n else text


def draw(s: Snapshot) -> str:
    """One snapshot as a table: a row per rank, a column per chunk; a cell lists the ranks whose
    data that copy of the chunk contains (Σ: all of them), * marks what arrived in this step."""
    if s.phase == "start":
        title = f"start: each of the {s.n} ranks holds its own data, cut into {s.n} chunks"
    else:
        verb = "adds it to its copy" if s.phase == "reduce-scatter" else "stores it"
        title = f"{s.phase} step {s.step}/{s.n - 1}: rank r sends one chunk to rank r+1, which {verb}"
    width = max(9, len(_cell(tuple(range(s.n)), s.n)) + 2)
    arrived = {(t.dst, t.chunk) for t in s.transfers}
    lines = [title, (" " * 8 + "".join(f"chunk {i}".ljust(width) for i in range(s.n))).rstrip()]
    for rank in range(s.n):
        cells = [(_cell(h, s.n) + ("*" if (rank, i) in arrived else "")).ljust(width)
                 for i, h in enumerate(s.holds[rank])]
        lines.append(f"rank {rank}  " + "".join(cells).rstrip())
    if s.transfers:
        lines.append("sent:   " + ", ".join(f"{t.src}→{t.dst} chunk {t.chunk}" for t in s.transfers))
    return "\n".join(lines)


def diagram(n: int = 4) -> str:
    """The whole ring all-reduce on n ranks, snapshot after snapshot."""
    tensors = [torch.full((n,), float(rank)) for rank in range(n)]
    return "\n\n".join(draw(s) for s in simulate(tensors))
