"""Chapter 05, context parallelism: ring and all-gather attention equal one device's attention.

The layouts and their load balance (pure), the ring's P2P plan under NCCL's rules (pure, then
recorded from real runs), attention and its q/k/v gradients against the single-device attention
(float64, cp 1/2/4, causal or not, GQA, both variants, both layouts), the whole model with global
RoPE positions, the negative controls, the wire bytes and saved bytes against formulas.py."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st

from common.comm import CommMeter
from common.dist import init_distributed
from common.kernel.model import LlamaConfig, build_model
from common.kernel.p2p_plan import P2PRecorder, find_deadlock, normalize, plan_from_records
from common.memory import ActivationMeter
from common.training import train
from tensor_parallel import (
    all_gather_attention,
    apply_context_parallel,
    attention_work,
    context_layout,
    load_balance,
    ring_attention,
    ring_plan,
    sequence_positions,
    shard_sequence,
    unshard_sequence,
    zigzag_positions,
)
from tensor_parallel import context_parallel as cpmod
from tensor_parallel import train as tp_train
from tensor_parallel.formulas import cp_activation_bytes, cp_comm_bytes
from tests.equivalence import TrainSpec, check_strategy, spec_run
from tests.harness import RankError

# --- layouts (pure) -------------------------------------------------------------------------------


def test_zigzag_holds_chunks_r_and_2cp_minus_1_minus_r_and_unshard_inverts_shard():
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sequence_positions(8, 2, 1, "contiguous").tolist() == [4, 5, 6, 7]
    x = torch.arange(2 * 24).view(2, 24)
    for cp in (1, 2, 3, 4):
        for layout in ("zigzag", "contiguous"):
            pieces = [shard_sequence(x, cp, r, 1, layout) for r in range(cp)]
            assert torch.equal(unshard_sequence(pieces, 1, layout), x)


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    """Every rank scores the same number of unmasked query-key pairs under zig-zag; contiguous
    ranks range from the diagonal alone to everything; both total s(s+1)/2."""
    for cp in range(1, 9):
        s = 4 * cp
        for layout in ("zigzag", "contiguous"):
            assert sum(attention_work(s, cp, r, layout) for r in range(cp)) == s * (s + 1) // 2
        assert load_balance(s, cp) == 1.0
        c = s // cp  # contiguous: rank cp-1 does (cp-1)·c² + c(c+1)/2, rank 0 c(c+1)/2
        assert load_balance(s, cp, "contiguous") == ((cp - 1) * c * c + c * (c + 1) / 2) / (c * (c + 1) / 2)
        assert load_balance(s, cp, "contiguous", causal=False) == 1.0


# --- the ring's P2P plan (pure) ---------------------------------------------------------------------


def test_ring_plans_are_deadlock_free_and_send_the_formula_blocks():
    """Forward (cp-1) K/V sends per rank; backward (cp-1) K/V + (cp-1) dK/dV: every plan for
    cp ≤ 8 replays under NCCL's rules without deadlock."""
    for cp in range(1, 9):
        for phase, sends in (("forward", cp - 1), ("backward", 2 * (cp - 1))):
            plan = ring_plan(phase, cp, 96, 128, ranks=[10 + r for r in range(cp)])
            assert find_deadlock(plan) is None, (phase, cp)
            assert all(sum(op[0] == "send" for g in groups for op in g) == sends for groups in plan.values())


def test_negative_control_sends_before_receives_in_separate_groups_deadlock():
    """The same messages with each send posted as its own group before its receive: every rank
    waits in a send for a neighbour that also waits in a send."""
    for cp in (2, 3, 4):
        split = {r: [[op] for g in groups for op in sorted(g, key=lambda op: op[0] != "send")]
                 for r, groups in ring_plan("forward", cp, 8).items()}
        found = find_deadlock(split)
        assert found is not None and set(found.stuck) == set(range(cp))


# --- attention against one device (the rank pool) ----------------------------------------------------


def _seeded(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _drop_lse_correction(out, lse, block_out, block_lse) -> None:
    """Adds each block's normalized output without rescaling by exp(lse_block - lse)."""
    out.add_(block_out)
    lse.copy_(torch.logaddexp(lse, block_lse))


def _skip_a_needed_block(cp, rank, source, layout="zigzag", causal=True):
    """Drops the first fully visible pair of every step after the first."""
    pairs = PAIRS(cp, rank, source, layout, causal)
    full = [p for p in pairs if p[2] == "full"]
    return [p for p in pairs if source == rank or not full or p != full[0]]


PAIRS = context_layout.block_pairs
BROKEN = {"lse-dropped": ("_merge", _drop_lse_correction),
          "causal-block-skipped": ("block_pairs", _skip_a_needed_block),
          "dkv-not-home": ("_arrived_home", lambda own, travelled: own)}


def _broken(name: str | None):
    if name is None:
        return contextlib.nullcontext()
    return mock.patch.object(cpmod, *BROKEN[name])


def attention_vs_full(b: int, heads: int, kv: int, s: int, d: int, causal: bool, variant: str,
                      layout: str, seed: int, broken: str | None = None) -> dict[str, float]:
    """Runs on every rank (the CP group = the world): CP attention of this rank's tokens, forward
    and backward, against one device's attention of the whole sequence; max relative differences
    of the output and of dq, dk, dv on this rank's tokens."""
    cp, r = dist.get_world_size(), dist.get_rank()
    q, k, v, dout = (_seeded((b, h, s, d), seed + i) for i, h in enumerate((heads, kv, kv, heads)))
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    group = heads // kv
    reference = F.scaled_dot_product_attention(full[0], full[1].repeat_interleave(group, 1),
                                               full[2].repeat_interleave(group, 1), is_causal=causal)
    reference.backward(dout)
    local = [shard_sequence(x, cp, r, 2, layout).requires_grad_() for x in (q, k, v)]
    attend = ring_attention if variant == "ring" else all_gather_attention
    with _broken(broken):
        out = attend(*local, None, causal, layout)
        out.backward(shard_sequence(dout, cp, r, 2, layout))
    mine = lambda x: shard_sequence(x, cp, r, 2, layout)  # noqa: E731
    return {"out": _max_rel(out.detach(), mine(reference.detach())),
            **{f"d{n}": _max_rel(x.grad, mine(f.grad)) for n, x, f in zip("qkv", local, full, strict=True)}}


@example(cp=4, causal=True, variant="ring", layout="zigzag", gqa=True, b=1, d=2, c=1, seed=0)
@example(cp=2, causal=False, variant="all_gather", layout="contiguous", gqa=False, b=2, d=4, c=2, seed=1)
@given(cp=st.sampled_from([1, 2, 4]), causal=st.booleans(), variant=st.sampled_from(["ring", "all_gather"]),
       layout=st.sampled_from(["zigzag", "contiguous"]), gqa=st.booleans(), b=st.integers(1, 2),
       d=st.sampled_from([2, 4]), c=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_context_parallel_attention_equals_one_device_float64(pools, cp, causal, variant, layout, gqa,
                                                               b, d, c, seed):
    """Output and dL/dq, dL/dk, dL/dv within 1e-10 (max relative), every rank."""
    heads, kv = (4, 2) if gqa else (2, 2)
    s = c * 2 * cp  # c tokens per zig-zag chunk
    results = pools.run(cp, attention_vs_full, b, heads, kv, s, d, causal, variant, layout, seed)
    worst = {key: max(r[key] for r in results) for key in results[0]}
    assert max(worst.values()) < 1e-10, worst


@pytest.mark.parametrize("broken, cp, variant", [
    ("lse-dropped", 2, "ring"), ("causal-block-skipped", 2, "ring"),
    ("causal-block-skipped", 2, "all_gather"), ("dkv-not-home", 4, "ring")])
def test_broken_context_parallel_attention_is_rejected(pools, broken, cp, variant):
    """Each deliberate break misses the reference by far more than 1e-10 (its figure below)."""
    results = pools.run(cp, attention_vs_full, 1, 4, 2, 4 * cp, 4, True, variant, "zigzag", 3, broken)
    worst = {key: max(r[key] for r in results) for key in results[0]}
    assert max(worst.values()) > 1e-3, worst
    if broken == "dkv-not-home":  # the forward and dq are untouched; dk, dv miss the other ranks' shares
        assert worst["out"] < 1e-10 and worst["dq"] < 1e-10 and min(worst["dk"], worst["dv"]) > 1e-3


# --- the model with global RoPE positions -------------------------------------------------------------


def model_vs_full(cfg: LlamaConfig, b: int, s: int, variant: str, wrong_positions: bool = False) -> dict:
    """Runs on every rank: the same model on one device (whole sequence) and under CP (this rank's
    zig-zag tokens, RoPE at their global positions; gradients summed over the CP group)."""
    cp, r = dist.get_world_size(), dist.get_rank()
    tokens = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(7))
    full, model = build_model(cfg, 0, torch.float64), build_model(cfg, 0, torch.float64)
    reference = full(tokens)
    reference.square().sum().backward()
    apply_context_parallel(model, None, variant)
    positions = torch.arange(s // cp) if wrong_positions else zigzag_positions(s, cp, r)
    logits = model(shard_sequence(tokens, cp, r), positions)
    logits.square().sum().backward()
    diffs = {"logits": _max_rel(logits.detach(), shard_sequence(reference.detach(), cp, r))}
    for (name, p), ref in zip(model.named_parameters(), full.parameters(), strict=True):
        dist.all_reduce(p.grad)
        diffs[name] = _max_rel(p.grad, ref.grad)
    return diffs


GQA = LlamaConfig(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32, multiple_of=8)


@pytest.mark.parametrize("cp, variant", [(2, "ring"), (4, "ring"), (2, "all_gather")])
def test_model_under_context_parallelism_equals_one_device(pools, cp, variant):
    results = pools.run(cp, model_vs_full, GQA, 2, 4 * cp, variant)
    assert max(max(r.values()) for r in results) < 1e-10


def test_negative_control_local_rope_positions_are_rejected(pools):
    results = pools.run(2, model_vs_full, GQA, 2, 8, "ring", True)
    assert max(max(r.values()) for r in results) > 1e-3


# --- what the code posts, sends and saves ---------------------------------------------------------------


def recorded_attention(b: int, heads: int, kv: int, s: int, d: int, variant: str) -> dict:
    """Runs on every rank: one forward + backward under the P2P recorder, the comm meter and the
    saved-tensor ledger."""
    cp, r = dist.get_world_size(), dist.get_rank()
    q, k, v = (shard_sequence(_seeded((b, h, s, d), i), cp, r, 2).requires_grad_()
               for i, h in enumerate((heads, kv, kv)))
    attend = ring_attention if variant == "ring" else all_gather_attention
    with P2PRecorder() as recorder, CommMeter() as meter, ActivationMeter() as saved:
        out = attend(q, k, v, None)
        forward_saved = saved.current_bytes
        out.backward(torch.ones_like(out))
    comm = meter.as_dict()
    return {"groups": dict(recorder.groups), "sent": meter.bytes_sent, "saved": forward_saved,
            "calls": {op: int(x["calls"]) for op, x in comm.items()}}


@pytest.mark.parametrize("cp", [2, 4])
def test_recorded_ring_groups_are_the_plan_and_bytes_the_formula(pools, cp):
    """The groups a real run posts are ring_plan's forward then backward groups (global peers),
    deadlock-free; the bytes sent and the bytes saved for backward are formulas.py's, per variant."""
    b, heads, kv, s, d = 1, 4, 2, 8 * cp, 4
    ring, gathered = (pools.run(cp, recorded_attention, b, heads, kv, s, d, variant)
                      for variant in ("ring", "all_gather"))
    plans = plan_from_records([x["groups"] for x in ring])
    block = 2 * b * kv * (s // cp) * d * 8
    expected = {rank: ring_plan("forward", cp, block)[rank] + ring_plan("backward", cp, block)[rank]
                for rank in range(cp)}
    unlabelled = lambda plan: {r: [[(o.kind, o.peer, o.nbytes) for o in g] for g in gs]  # noqa: E731
                               for r, gs in normalize(plan).items()}
    assert list(plans) == [tuple(range(cp))]
    assert unlabelled(plans[tuple(range(cp))]) == unlabelled(expected)
    assert find_deadlock(plans[tuple(range(cp))]) is None
    for variant, results in (("ring", ring), ("all_gather", gathered)):
        assert all(x["sent"] == sum(cp_comm_bytes(b, s, kv, d, cp, 8, variant).values()) for x in results)
        assert all(x["saved"] == cp_activation_bytes(b, s, heads, kv, d, cp, 8, variant) for x in results)
    assert gathered[0]["calls"].get("isend", 0) == 0


# --- 05's trainer with --cp ---------------------------------------------------------------------------


def cp_strategy(spec: TrainSpec, tp: int, cp: int, sequence_parallel: bool):
    run = spec_run(spec, tp_train.validate, tp=tp, cp=cp, sequence_parallel=sequence_parallel)
    return tp_train.TensorParallelStrategy(run, init_distributed())


def test_cp_2_by_dp_2_training_equals_single_device_float64(pools):
    """world 4 = tp 1 × cp 2 × dp 2, GQA, AdamW, clipping, 2 micro-batches: gradients averaged over
    dp × cp; losses, per-step gradients and final parameters within 1e-10."""
    spec = TrainSpec(cfg=GQA, world_size=4, dp=2, global_batch=4, micro_batch=1, seq_len=8, steps=2,
                     clip_grad=1e-3)
    check_strategy(pools, spec, cp_strategy, 1, 2, False)


def validate_argv(argv: list[str]):
    return tp_train.validate(tp_train.parse_args(argv), dist.get_world_size())


@pytest.mark.parametrize("argv, message", [
    (["--cp", "3"], r"world size 4 is not divisible by --cp 3"),
    (["--cp", "0"], r"--cp 0: must be >= 1"),
    (["--cp", "2", "--tp", "4"], r"world size 4 is not divisible by --cp 2 × --tp 4 = 8"),
    (["--cp", "2", "--seq-len", "6"], r"into 4 equal chunks \(cp = 2\): use a sequence length divisible"),
])
def test_bad_cp_input_fails_on_every_rank_before_any_collective(pools, argv, message):
    with pytest.raises(RankError, match=message) as info:
        pools.run(4, validate_argv, argv)
    assert sorted(info.value.errors) == [0, 1, 2, 3]


def train_cli(argv: list[str]) -> dict:
    args = tp_train.parse_args(argv)
    run = tp_train.validate(args, dist.get_world_size())
    ctx = init_distributed()
    return train(run, ctx, tp_train.build(run, ctx), 5)


def test_train_tp_2_cp_2_sp_check_passes_and_report_matches_formulas(pools):
    """`--tp 2 --cp 2 --sequence-parallel --dtype float64 --check`: PASS; every byte row (comm,
    the ring's own P2P bytes, memory, activations) equals its formula; zig-zag balance 1.0."""
    argv = ["--model", "tiny", "--dtype", "float64", "--steps", "2", "--global-batch", "2",
            "--seq-len", "8", "--check", "--data", "synthetic", "--log-every", "0",
            "--tp", "2", "--cp", "2", "--sequence-parallel"]
    reports = pools.run(4, train_cli, argv)
    report = reports[0]
    assert all(r["check_passed"] for r in reports)
    assert report["mesh"] == {"dp": 1, "cp": 2, "tp": 2} and report["cp_load_balance"] == 1.0
    assert report["comm_bytes_per_rank"] == pytest.approx(report["comm_bytes_formula"], rel=1e-12)
    assert report["comm"]["isend"]["bytes"] == pytest.approx(report["cp_comm_bytes_formula"], rel=1e-12)
    for key in ("params", "grads", "optimizer", "activations_peak"):
        assert report["memory"][key] == pytest.approx(report["memory_formula"][key], rel=1e-12), key
