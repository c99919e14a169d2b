"""The planner's one door to chapter 06's pipeline schedules: which stages a rank holds, how many
micro-batches of each it keeps in flight, and its idle time per step in closed form.

    schedule    stages on rank r        bubble per rank (the DeepSeek-V3 report's Table 2)
    1f1b        r (v chunks when v > 1)  (p-1)(F+B)/v
    dualpipe    r and p-1-r              (p/2-1)(F&B + B - 3W)

F, B, W: a micro-batch's forward, full backward (input and weight gradients) and weight-gradient
chunk on one stage; F&B: a forward and a backward of two micro-batches run as one overlapped
pair, each one's all-to-alls hidden under the other's compute. In flight, 1F1B holds
min(m, p-r) micro-batches on stage r (chapter 06's count, `memory_model.in_flight_microbatches`);
interleaved, the frameworks' warm-up count min(m·v, 2(p-r-1) + (v-1)·p + 1) chunks of 1/v (torch's
ScheduleInterleaved1F1B; Megatron's when m > p: at m = p Megatron, like chapter 06, runs every
forward first and holds all m); DualPipe holds p+1 at its peak on every rank, 2·(p/2)-h
of its own stage and h+1 of its mirror's (h = min(r, p-1-r): deepseek-ai/DualPipe's warm-up
`step_1 + step_2`, then step 4's first forward), and needs m ≥ 2p, even.
"""

from __future__ import annotations

from parallel3d.memory_model import in_flight_microbatches
from pipeline.schedules import SCHEDULES

PLANNED = ("1f1b", "dualpipe")


def check_schedule(schedule: str, p: int, m: int, v: int = 1) -> None:
    """A clear error for a schedule the planner cannot price at (p, m, v)."""
    if schedule not in PLANNED:
        raise ValueError(f"schedule {schedule!r}: use one of {', '.join(PLANNED)}")
    if schedule == "dualpipe" and (p % 2 or m % 2 or m < 2 * p or v != 1):
        raise ValueError(f"dualpipe at pp={p}, m={m}, v={v}: needs an even pp, an even m ≥ 2·pp = "
                         f"{2 * p} micro-batches per replica and no virtual stages")


def rank_stages(schedule: str, p: int, rank: int) -> tuple[int, ...]:
    """The pipeline stages rank `rank` holds."""
    return (rank, p - 1 - rank) if schedule == "dualpipe" else (rank,)


def pair_s(compute: float, all_to_alls: float) -> float:
    """An F&B pair's time: each micro-batch's all-to-alls run under the other's compute, so
    the pair lasts the longer of the two (the SMs DeepSeek gives the communication, 20 of
    132, are not priced)."""
    return max(compute, all_to_alls)


# --- the closed forms: DualPipe's from chapter 06's registry -----------------------------------
# Chapter 06's registry (`pipeline.schedules.SCHEDULES`) lists DualPipeV, whose Table 2 row is
# DualPipe's: (PP/2-1)(F&B + B - 3W) for PP stages; DualPipe runs PP = p stages on p ranks, so
# the bubble reads that entry with PP = p. Full DualPipe (two copies of each stage) is not a
# schedule of chapter 06, so its in-flight count (its warm-up, below) still lives here.

def bubble_s(schedule: str, p: int, v: int, F: float, B: float, W: float, FB: float) -> float:
    """Idle seconds per rank per step (the table above; 0 without a pipeline)."""
    if p == 1:
        return 0.0
    if schedule == "dualpipe":
        return SCHEDULES["dualpipev"].paper_idle(p, F, B, W, FB)
    return (p - 1) * (F + B) / v


def in_flight(schedule: str, p: int, m: int, v: int, rank: int) -> dict[int, float]:
    """{stage: micro-batches of its activations rank `rank` holds at its peak} (a stage's
    micro-batch, under interleaving, counts its v chunks)."""
    if schedule == "dualpipe":
        h = min(rank, p - 1 - rank)
        return {h: p - h, p - 1 - h: h + 1}
    if v > 1:
        return {rank: min(m * v, 2 * (p - rank - 1) + (v - 1) * p + 1) / v}
    return {rank: in_flight_microbatches(p, m, v, stage=rank)}
