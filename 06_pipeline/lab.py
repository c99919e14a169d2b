"""Lab 06: write 1F1B as data, and the send/recv groups that carry it without deadlock.

The model is cut into p stages, stage r on rank r (README "Four schedules", "Schedules as data").
You write what the chapter's executor (PipelineExecutor) runs; it does the compute and posts
exactly the groups you return.

1. `one_f_one_b(p, m)`: for each rank, the ordered list of its actions, Action("F", i) the
   forward of micro-batch i on its stage and Action("B", i) its backward. Any order you return
   must respect the data:
       F(i) on stage r   after F(i) on stage r − 1     (its input is that stage's output)
       B(i) on stage r   after B(i) on stage r + 1     (the gradient of its output comes from there)
       B(i) on stage r   after F(i) on stage r         (it needs the activations F saved)
   1F1B is the order that holds the fewest activations for GPipe's bubble: a micro-batch's
   activations live on a rank from its F to its B, and rank r never holds more than p − r at
   once (GPipe, every F first, holds m), while the bubble stays (p − 1)/(m + p − 1) with
   F = 1, B = 2 (idle over total rank-time). Read the order off the README's 1F1B timeline.

2. `messages(p, rank, action)`: what the action receives before it runs and what it sends when
   done, each a Message(kind, microbatch, src_stage, src, dst) or None. An activation ("act")
   goes forward to the next stage; its gradient ("grad") comes back; src_stage is the stage that
   sends (here stage = rank). Stage 0 reads tokens; the last stage ends in the loss.

3. `p2p_schedule(p, rank, actions)`: the rank's actions in their order with the groups it posts
   between them, one list of Action and Exchange items. `Exchange(sends=(...), recvs=(...))` is
   one `batch_isend_irecv` of those Messages. The executor walks your list: an Exchange posts its
   sends and receives; an Action waits for its receive, computes, and hands its output to a later
   Exchange. So every receive must be posted before its action, every send after its action,
   each exactly once. gloo runs any such list; NCCL does not: on NCCL a rank's groups run one
   after another, and a send completes only when the peer's matching receive is in the group the
   peer is running now. The grader replays what the executor posts under those rules (common/
   p2p_plan.find_deadlock) before anything runs, and prints the groups where it gets stuck.

Check your work: `make lab-check N=6` (from the repo root), or `grade(6)` in the notebook: your
order's dependencies and memory, its simulated bubble, your messages and groups, the NCCL replay
at p = 2, 3, 4, then two AdamW steps on 2 and 3 ranks against one device (float64, 1e-10), with
the activations each rank holds at its peak measured in micro-batches (at most p − r). Only this
file is yours to edit; keep the names and signatures.
"""

from __future__ import annotations

from pipeline.p2p import Exchange
from pipeline.schedules import Action, Message


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """actions[r]: rank r's actions under 1F1B, in the order it runs them (p lists, 2m each)."""
    raise NotImplementedError("one_f_one_b: each rank's 1F1B order of F and B actions")


def messages(p: int, rank: int, action: Action) -> tuple[Message | None, Message | None]:
    """(what `action` on stage `rank` receives before it runs, what it sends when done)."""
    raise NotImplementedError("messages: the activation or gradient an action receives and sends")


def p2p_schedule(p: int, rank: int, actions: list[Action]) -> list[Action | Exchange]:
    """`actions` (this rank's order), in order, with the Exchange groups posted between them."""
    raise NotImplementedError("p2p_schedule: the actions with the send/recv groups between them")
