"""`common/kernel/a2a_plan.py` rule by rule: each rule of `a2a_errors` (1: the same all-to-alls in
the same order; 2: splits that pair, one split per rank of the group, summing to the rows, rows of
one shape; 3: contiguous, on the rank's device) is handed a clean plan and the plan with one
breach, and must name exactly that breach; `A2ARecorder` must record what a rank posts (global
ranks of a subgroup, shapes, device, contiguity) and, with `post_rows=False`, post only the count
exchange. The grader (05's expert lab) and tests/test_moe_expert_parallel_plan.py rest on these.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from common.kernel.a2a_plan import A2ARecorder, a2a_errors, sent_rows


def tensor(rows: int, row: tuple = (4,), dtype: str = "float64", device: str = "cpu",
           contiguous: bool = True) -> dict:
    return {"rows": rows, "row": row, "dtype": dtype, "contiguous": contiguous, "device": device,
            "on_device": device == "cpu"}


def exchange(group: tuple, sends: list[list[int]], phase: str = "forward") -> list[dict]:
    """One all-to-all over `group`, as each member records it: sends[q][p] rows from q to p."""
    records = []
    for q_at, _ in enumerate(group):
        in_splits = list(sends[q_at])
        out_splits = [sends[s][q_at] for s in range(len(group))]
        records.append({"phase": phase, "group": group, "in": tensor(sum(in_splits)),
                        "out": tensor(sum(out_splits)), "in_splits": in_splits, "out_splits": out_splits})
    return records


def plan() -> list[list[dict]]:
    """4 ranks, EP groups (0, 1) and (2, 3); each group: a skewed forward exchange (rank 1 and 3
    receive nothing) and its reverse in backward."""
    per_rank: list[list[dict]] = [[] for _ in range(4)]
    for group in ((0, 1), (2, 3)):
        for phase, sends in (("forward", [[3, 0], [2, 0]]), ("backward", [[3, 2], [0, 0]])):
            for at, record in zip(group, exchange(group, sends, phase), strict=True):
                per_rank[at].append(record)
    return per_rank


def test_a_plan_that_keeps_every_rule_has_no_error():
    assert a2a_errors(plan()) == []
    assert sent_rows(plan()[0][0], 0) == 0 and sent_rows(plan()[1][0], 1) == 2


def broken(edit) -> list[str]:
    per_rank = copy.deepcopy(plan())
    edit(per_rank)
    return a2a_errors(per_rank)


def _skip(p):  # rank 1 receives nothing forward: "skip the exchange" (and its reverse)
    p[1][:] = []


def _phase(p):  # rank 3 posts its backward exchange as a forward one
    p[3][1]["phase"] = "forward"


def _dtype(p):  # rank 2 sends float32 rows where rank 3 sends float64
    p[2][0]["in"]["dtype"] = "float32"


def _swap(p):  # rank 0 swaps its two send splits (and its tensor still has the rows)
    p[0][1]["in_splits"].reverse()


def _row(p):  # rank 3 receives rows of another width than rank 2 sends
    p[3][0]["out"]["row"] = (5,)


def _sum_in(p):  # rank 0's input has a row its splits do not send
    p[0][0]["in"]["rows"] += 1


def _sum_out(p):  # rank 2's output is short of what its splits receive
    p[2][0]["out"]["rows"] -= 1


def _length(p):  # rank 0 sends one split per expert, not per rank: [3, 0, 0] sums to the rows
    p[0][0]["in_splits"].append(0)


def _short(p):  # rank 2 hands one split for a group of two
    p[2][1]["out_splits"] = [p[2][1]["out_splits"][0]]
    p[2][1]["out"]["rows"] = p[2][1]["out_splits"][0]


def _device(p):  # rank 3's output left on another device
    p[3][1]["out"].update(device="meta", on_device=False)


def _contiguous(p):  # rank 1 hands a transposed view
    p[1][0]["in"]["contiguous"] = False


BREACHES = [
    (_skip, "rule 1: group [0, 1]", "rank 1: 0"),
    (_phase, "rule 1: group [2, 3]", "posts different"),
    (_dtype, "rule 1: group [2, 3]", "posts different"),
    (_swap, "rule 2: group [0, 1], all-to-all #1", "rank 0 sends rank 0 2 rows"),
    (_row, "rule 2: group [2, 3], all-to-all #0", "rank 3 expects 0 of (5,) from rank 2"),
    (_sum_in, "rule 2: rank 0, all-to-all #0", "input splits [3, 0] sum to 3, its tensor has 4 rows"),
    (_sum_out, "rule 2: rank 2, all-to-all #0", "output splits [3, 2] sum to 5, its tensor has 4 rows"),
    (_length, "rule 2: rank 0, all-to-all #0", "input splits [3, 0, 0]: 3 splits for a group of 2"),
    (_short, "rule 2: rank 2, all-to-all #1", "output splits [3]: 1 splits for a group of 2"),
    (_device, "rule 3: rank 3, all-to-all #1", "its output is on meta"),
    (_contiguous, "rule 3: rank 1, all-to-all #0", "its input is not contiguous"),
]


@pytest.mark.parametrize("edit, head, detail", BREACHES, ids=[b[0].__name__[1:] for b in BREACHES])
def test_each_breach_is_named_by_its_rule(edit, head, detail):
    errors = broken(edit)
    assert any(e.startswith(head) and detail in e for e in errors), "\n".join(errors)
    other = "[2, 3]" if "[0, 1]" in head or "rank 0" in head or "rank 1" in head else "[0, 1]"
    assert not any(f"group {other}" in e for e in errors), "a breach in one group blames the other"


def test_recorder_marks_a_tensor_off_the_rank_device():
    on = A2ARecorder()._tensor(torch.empty(3, 2, dtype=torch.float64))
    off = A2ARecorder()._tensor(torch.empty(3, 2, device="meta"))
    assert (on["on_device"], off["on_device"], off["device"], off["row"]) == (True, False, "meta", (2,))


SENDS = [[2, 1], [1, 1]]  # SENDS[q][p]: rows rank q sends rank p


def record_subgroup(post_rows: bool) -> dict:
    """World 2 as one group [0, 1] built with new_group: a count exchange (int64, equal splits),
    then a row exchange with SENDS from a transposed (non-contiguous) input, rows of width 2."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    counts = torch.tensor([10 * rank, 10 * rank + 1], dtype=torch.int64)
    got = torch.empty(2, dtype=torch.int64)
    splits, out_splits = SENDS[rank], [SENDS[q][rank] for q in range(2)]
    x = torch.full((2, sum(splits)), rank + 1.0, dtype=torch.float64).t()
    out = torch.full((sum(out_splits), 2), -1.0, dtype=torch.float64)
    with A2ARecorder(post_rows=post_rows) as rec:
        dist.all_to_all_single(got, counts, group=group)
        rec.phase = "backward"
        dist.all_to_all_single(out, x.contiguous() if post_rows else x, out_splits, splits, group=group)
    return {"records": rec.records, "got": got.tolist(), "out": out.flatten().tolist()}


def test_recorder_records_what_a_rank_posts_and_posts_only_counts_without_rows(pools):
    for post_rows in (False, True):
        results = pools.run(2, record_subgroup, post_rows)
        for rank, result in enumerate(results):
            counts, rows = result["records"]
            assert (counts["group"], counts["phase"], counts["in"]["dtype"]) == ((0, 1), "forward", "int64")
            assert counts["in_splits"] == counts["out_splits"] == [1, 1]
            assert result["got"] == [rank, 10 + rank]  # the counts moved either way
            assert (rows["phase"], rows["in"]["row"], rows["in"]["rows"]) == ("backward", (2,), 3 - rank)
            assert rows["in"]["contiguous"] is post_rows and rows["in"]["on_device"]
            moved = [1.0] * 4 + [2.0] * 2 if rank == 0 else [1.0] * 2 + [2.0] * 2
            assert result["out"] == (moved if post_rows else [0.0] * len(moved))
        errors = a2a_errors([r["records"] for r in results])
        assert errors == ([] if post_rows else [
            "rule 3: rank 0, all-to-all #1 (backward): its input is not contiguous",
            "rule 3: rank 1, all-to-all #1 (backward): its input is not contiguous"])
