"""All-to-all plans under NCCL's rules: what every rank of a group posts through
`all_to_all_single`, recorded on each rank and checked across the ranks before anything moves.

An `all_to_all_single` with split sizes completes only when every rank of its group posts it, in
the same order as its other collectives, with splits that pair. gloo on CPU aborts or hangs on a
breach too, but only once the tensors move, and a rank that skips an exchange it has nothing for
(a routing that sends it no token) runs fine until the routing changes. The rules:

    1. every rank of a group posts the same all-to-alls in the same order (per phase: forward,
       backward), even one by which it sends and receives nothing;
    2. they pair: what rank q sends rank p (q's input_split_sizes[p]) is what p expects from q
       (p's output_split_sizes[q]); each rank's splits, one per rank of the group, sum to its
       tensors' rows; the rows agree;
    3. every tensor is contiguous, on the rank's device.

`A2ARecorder` records on one rank; with `post_rows=False` it posts only the integer all-to-alls
(a count exchange: equal splits, safe) and records the others without moving data (their outputs
zero-filled), so a plan that would desynchronize gloo is checked, not run. `a2a_errors` checks the
three rules over every rank's records. tests/test_moe_expert_parallel_plan.py checks the chapter's
own plan (with the host syncs of a real run); the labs' grader checks a student's with this one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from common.kernel.patch import patch_dist


class A2ARecorder:
    """`with A2ARecorder(post_rows) as rec:` … `rec.records`: this rank's all-to-alls, in order,
    each tagged with `rec.phase` ("forward" until the caller sets "backward")."""

    def __init__(self, post_rows: bool = True, device: torch.device | None = None):
        self.post_rows, self.device = post_rows, device or torch.device("cpu")
        self.records: list[dict] = []
        self.phase = "forward"

    def _tensor(self, t: torch.Tensor) -> dict:
        return {"rows": t.shape[0], "row": tuple(t.shape[1:]), "dtype": str(t.dtype).removeprefix("torch."),
                "contiguous": t.is_contiguous(), "device": str(t.device),
                "on_device": t.device == self.device}

    def _call(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
              async_op=False):
        n, ranks = dist.get_world_size(group), tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        self.records.append({"phase": self.phase, "group": ranks, "in": self._tensor(input),
                             "out": self._tensor(output),
                             "in_splits": list(input_split_sizes or [input.shape[0] // n] * n),
                             "out_splits": list(output_split_sizes or [output.shape[0] // n] * n)})
        if self.post_rows or not input.is_floating_point():
            return self._all_to_all(output, input, output_split_sizes, input_split_sizes, group=group,
                                    async_op=async_op)
        output.zero_()
        return None

    def _wrap(self, all_to_all):
        self._all_to_all = all_to_all
        return self._call

    def __enter__(self) -> A2ARecorder:
        self._patch = patch_dist({"all_to_all_single": self._wrap})
        self._patch.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._patch.__exit__(*exc)


def sent_rows(record: dict, rank: int) -> int:
    """Rows an all-to-all moves off this rank (all but those it keeps for itself)."""
    me = record["group"].index(rank)
    return sum(record["in_splits"]) - record["in_splits"][me]


def a2a_errors(per_rank: list[list[dict]]) -> list[str]:
    """One line per breach of rules 1–3 over every rank's records (global rank = list index)."""
    errors = []
    for rank, records in enumerate(per_rank):
        for i, r in enumerate(records):
            for side in ("in", "out"):
                t = r[side]
                if not (t["contiguous"] and t["on_device"]):
                    errors.append(f"rule 3: rank {rank}, all-to-all #{i} ({r['phase']}): its {side}put is "
                                  f"{'not contiguous' if not t['contiguous'] else 'on ' + t['device']}")
                if len(r[f"{side}_splits"]) != len(r["group"]):
                    errors.append(f"rule 2: rank {rank}, all-to-all #{i} ({r['phase']}): {side}put splits "
                                  f"{r[f'{side}_splits']}: {len(r[f'{side}_splits'])} splits for a group of "
                                  f"{len(r['group'])}, one per rank")
                elif sum(r[f"{side}_splits"]) != t["rows"]:
                    errors.append(f"rule 2: rank {rank}, all-to-all #{i} ({r['phase']}): {side}put splits "
                                  f"{r[f'{side}_splits']} sum to {sum(r[f'{side}_splits'])}, its tensor has "
                                  f"{t['rows']} rows")
    for group in sorted({r["group"] for records in per_rank for r in records}):
        seqs = {q: [r for r in per_rank[q] if r["group"] == group] for q in group}
        keys = {q: [(r["phase"], r["in"]["dtype"]) for r in seq] for q, seq in seqs.items()}
        if any(len(r[f"{side}_splits"]) != len(group) for seq in seqs.values() for r in seq
               for side in ("in", "out")):
            continue  # named above; the splits cannot be paired
        if any(keys[q] != keys[group[0]] for q in group):
            counts = ", ".join(f"rank {q}: {len(keys[q])}" for q in group)
            errors.append(f"rule 1: group {list(group)} posts different all-to-alls ({counts}): every rank "
                          "posts every exchange, even one by which it sends and receives nothing")
            continue
        for i, first in enumerate(seqs[group[0]]):
            for p_at, p in enumerate(group):
                for q_at, q in enumerate(group):
                    sent, expected = seqs[q][i]["in_splits"][p_at], seqs[p][i]["out_splits"][q_at]
                    row_in, row_out = seqs[q][i]["in"]["row"], seqs[p][i]["out"]["row"]
                    if sent != expected or row_in != row_out:
                        errors.append(f"rule 2: group {list(group)}, all-to-all #{i} ({first['phase']}): "
                                      f"rank {q} sends rank {p} {sent} rows of {row_in}, rank {p} expects "
                                      f"{expected} of {row_out} from rank {q}")
    return errors
