"""common/: the comm meter's byte counts, the memory ledger, data determinism, launch errors,
the report contract."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

from common.comm import CommMeter
from common.data import ByteCorpus, SyntheticTokens, local_micro_batches
from common.dist import LaunchError, env_world_size, pick_backend
from common.kernel.collectives import all_gather_single, reduce_scatter_single
from common.kernel.model import get_config
from common.memory import ActivationMeter, model_state_bytes, storage_bytes
from common.reference import SCALE_FLOOR, TOLERANCE, make_reference, relative_diff
from common.report import comm_convention, emit_report
from common.wire import WireMeter
from tests.equivalence import RunRecord, TrainSpec, compare


def meter_every_op() -> dict:
    """Each collective once on 12 float32 (48 bytes), plus a ring of sends."""
    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.ones(12)
    originals = (dist.all_reduce, dist.isend)
    with CommMeter() as meter:
        dist.all_reduce(x)
        all_gather_single(torch.empty(12 * n), x)
        reduce_scatter_single(torch.empty(12 // n), x)
        dist.broadcast(x, src=0)
        if n > 1:  # gloo cannot send to itself
            ops = [dist.P2POp(dist.isend, x, (rank + 1) % n),
                   dist.P2POp(dist.irecv, torch.empty(12), (rank - 1) % n)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            if rank % 2 == 0:
                dist.send(torch.ones(3), (rank + 1) % n)
            else:
                dist.recv(torch.empty(3), (rank - 1) % n)
    assert (dist.all_reduce, dist.isend) == originals, "the meter must restore torch.distributed"
    return meter.as_dict() | {"bytes_sent": meter.bytes_sent}


@pytest.mark.parametrize("n", [2, 4])
def test_comm_meter_counts_bytes_by_nccl_tests_conventions(pools, n):
    results = pools.run(n, meter_every_op)
    gather = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    scatter = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    for rank, stats in enumerate(results):
        assert stats["all_reduce"] == {"calls": 1, "bytes": 2 * (n - 1) / n * 48}
        assert stats[gather] == {"calls": 1, "bytes": (n - 1) / n * 48 * n}
        assert stats[scatter] == {"calls": 1, "bytes": (n - 1) / n * 48}
        assert stats["broadcast"] == {"calls": 1, "bytes": 48}
        assert stats["isend"] == {"calls": 1, "bytes": 48} and stats["irecv"] == {"calls": 1, "bytes": 48}
        sent = 12 if rank % 2 == 0 else 0
        assert stats.get("send", {"bytes": 0})["bytes"] == sent
        expected = 2 * (n - 1) / n * 48 + (n - 1) * 48 + (n - 1) / n * 48 + 48 + 48 + sent
        assert stats["bytes_sent"] == pytest.approx(expected, rel=1e-12)


def test_comm_meter_counts_nothing_on_one_rank(pools):
    stats = pools.run(1, meter_every_op)[0]
    assert stats["all_reduce"]["bytes"] == 0 and stats["broadcast"]["bytes"] == 0


def test_storage_bytes_counts_each_storage_once():
    flat = torch.zeros(100, dtype=torch.float64)
    views = [flat[:40], flat[40:], flat.view(10, 10)]
    assert storage_bytes(views) == 800
    assert storage_bytes([torch.zeros(3), torch.zeros(5)]) == 32


def test_model_state_bytes_sees_adamw_state():
    model = nn.Linear(4, 3, bias=True)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    state = model_state_bytes(model.parameters(), optimizer)
    assert state == {"params": 60, "grads": 60, "optimizer": 2 * 60 + 2 * 4}


def test_activation_meter_tracks_saved_tensors_until_backward_frees_them():
    w = nn.Parameter(torch.randn(256))
    x = torch.randn(256, requires_grad=True)
    with ActivationMeter([w]) as meter:
        y = (x * w).sin()  # saves x and w for the product (w excluded), and x*w for sin
        assert meter.current_bytes == 2 * 256 * 4
        y.sum().backward()
    del y
    assert meter.peak_bytes == 2 * 256 * 4 and meter.current_bytes == 0


def test_data_is_deterministic_and_ranks_partition_the_global_batch():
    data = SyntheticTokens(vocab_size=50, seq_len=7, seed=3)
    batch = data.global_batch(5, 12)
    assert torch.equal(batch, SyntheticTokens(50, 7, 3).global_batch(5, 12))
    assert not torch.equal(batch, data.global_batch(6, 12))
    pieces = [m for r in range(3) for m in local_micro_batches(batch, r, 3, micro_batch=2)]
    assert len(pieces) == 6 and torch.equal(torch.cat(pieces), batch)


def test_byte_corpus_reads_the_repository_by_default(tmp_path):
    corpus = ByteCorpus(seq_len=16, seed=0)
    batch = corpus.global_batch(0, 4)
    assert batch.shape == (4, 17) and batch.max() < 256 and len(corpus.data) > 10_000
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(ValueError, match="need more than seq_len"):
        ByteCorpus(seq_len=16, path=short)


def test_launch_without_torchrun_names_the_fix(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(LaunchError, match="torchrun --standalone --nproc-per-node N"):
        env_world_size()


def test_backend_follows_the_environment(monkeypatch):
    monkeypatch.setenv("PFS_BACKEND", "gloo")
    assert pick_backend() == "gloo"
    monkeypatch.setenv("PFS_BACKEND", "mpi")
    with pytest.raises(LaunchError, match="PFS_BACKEND='mpi' is not supported"):
        pick_backend()
    monkeypatch.delenv("PFS_BACKEND")
    assert pick_backend() == ("nccl" if torch.cuda.is_available() else "gloo")


def test_report_prints_json_as_last_line_without_the_per_step_arrays(tmp_path, capsys):
    """The printed line is for programs: every figure but the per-step arrays (2-5 KB over a long
    run), which it names in `per_step`; the --report file holds the whole report."""
    steps = 20
    report = {"chapter": 1, "strategy": "ddp", "world_size": 2, "mesh": {"dp": 2}, "backend": "gloo",
              "device": "cpu", "dtype": "float32", "steps": steps,
              "losses": [2.0 - i / 100 for i in range(steps)],
              "reference_losses": [2.0 - i / 100 for i in range(steps)], "tokens_per_s": 10.0,
              "comm": {}, "comm_bytes_per_rank": 100.0, "comm_bytes_formula": 50.0,
              "memory": {"params": 8}, "memory_formula": {"params": 8}, "ranks": [0, 1],
              "check_passed": True, "tolerance": 1e-10, "max_loss_diff": 0.0, "max_grad_diff": 0.0,
              "max_param_diff": 0.0}
    emit_report(report, str(tmp_path / "r.json"))
    out = capsys.readouterr().out.strip().splitlines()
    printed, written = json.loads(out[-1]), json.loads((tmp_path / "r.json").read_text())
    assert written == report
    assert printed == {k: v for k, v in report.items() if "losses" not in k} | {
        "per_step": ["losses", "reference_losses"]}
    assert len(out[-1]) < 600 < len(json.dumps(report))
    assert any("comm accounted (nccl-tests convention)" in line and "2.0000" in line for line in out)
    assert not any("written by gloo" in line for line in out)  # no observed row without a wire meter


def test_report_labels_what_gloo_wrote_apart_from_the_accounted_bytes(capsys):
    """A reduce-scatter run: gloo writes 2× the accounted bytes (it runs a full all-reduce), and
    the table says so under the row instead of leaving two figures that disagree unexplained."""
    report = {"chapter": 3, "strategy": "zero-2", "world_size": 2, "mesh": {"dp": 2}, "backend": "gloo",
              "device": "cpu", "dtype": "float32", "steps": 1, "losses": [2.0], "tokens_per_s": 10.0,
              "comm": {"reduce_scatter_tensor": {"calls": 1, "bytes": 50.0}}, "comm_bytes_per_rank": 50.0,
              "comm_bytes_formula": 50.0, "comm_convention": "accounted (nccl-tests)",
              "comm_written_bytes": 100.0, "memory": {}, "memory_formula": {}}
    emit_report(report)
    assert "written" not in capsys.readouterr().out.split("\n{")[0]  # the student's table: accounted only
    emit_report(report, observed=True)
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("comm written by gloo (wchar)") and line.endswith("2.0000") for line in out)
    assert any("reduce-scatter as a full all-reduce" in line for line in out)


def test_comm_convention_says_accounted_for_collectives_and_sent_for_p2p():
    """Collectives are charged by nccl-tests' convention, point-to-point sends as sent: the report
    labels the figure accordingly (neither is observed; common/wire.py observes)."""
    assert comm_convention({"all_reduce": {}}) == "accounted (nccl-tests)"
    assert comm_convention({"isend": {}, "irecv": {}}) == "sent (P2P)"
    assert comm_convention({"all_reduce": {}, "send": {}}) == "accounted + sent (P2P)"


def wire_around_all_reduce(numel: int) -> dict:
    wire = WireMeter("gloo", torch.device("cpu"), dist.get_world_size())
    wire.calibrate(windows=1, seconds=0.01)
    x = torch.ones(numel)
    wire.open()
    with CommMeter() as meter:
        dist.all_reduce(x)
    wire.close()
    return wire.report(meter.bytes_sent) | {"accounted": meter.bytes_sent}


def test_wire_meter_observes_the_bytes_gloo_writes(pools):
    """gloo's own bytes, observed: this rank's socket writes (wchar) are the accounted bytes plus
    gloo's framing; the machine's loopback bytes per rank are at least that (other processes on a
    shared machine add to them: the report states the background)."""
    for r in pools.run(2, wire_around_all_reduce, 2**18):
        assert r["accounted"] == 2**20  # 2(n-1)/n · 1 MiB with n = 2
        assert r["accounted"] <= r["comm_written_bytes"] < r["accounted"] + 2**16
        assert r["comm_observed_lo_bytes"] >= r["accounted"]
        assert r["comm_observed_lo_noise_bytes"] >= 0


def test_wire_meter_reports_none_where_it_cannot_observe():
    """NCCL traffic never passes through the kernel: no figure rather than a wrong one."""
    wire = WireMeter("nccl", torch.device("cuda", 0), 2)
    wire.open()
    wire.close()
    assert wire.report(1000.0) == {"comm_observed_lo_bytes": None,
                                   "comm_observed_lo_noise_bytes": None, "comm_written_bytes": None}


def test_relative_diff_does_not_divide_rounding_noise_by_rounding_noise():
    """A tensor that is zero in exact arithmetic (wq's gradient when seq_len = 1) holds ~1e-17 of
    rounding noise in both runs, different on different CPUs: measured against the model's scale,
    not its own, so the verdict does not depend on the machine."""
    big = torch.linspace(-1.0, 1.0, 50, dtype=torch.float64)
    noise = torch.randn(8, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 1e-17
    ours, ref = {"w2": big.clone(), "wq": noise}, {"w2": big, "wq": -noise}
    assert relative_diff(ours, ref) < 1e-12
    assert relative_diff({"wq": noise}, {"wq": -noise}) == pytest.approx(2.0)  # alone, it is its scale


def test_relative_diff_still_sees_a_small_bug_in_any_tensor_above_the_floor():
    big = torch.linspace(-1.0, 1.0, 50, dtype=torch.float64)
    small = torch.full((4,), 10 * SCALE_FLOOR, dtype=torch.float64)
    assert relative_diff({"a": big, "b": small * (1 + 1e-6)}, {"a": big, "b": small}) == pytest.approx(1e-6)
    tiny = torch.full((4,), SCALE_FLOOR / 100, dtype=torch.float64)  # below the floor: 1/100 as loud
    assert relative_diff({"a": big, "b": tiny * 2}, {"a": big, "b": tiny}) == pytest.approx(1e-2)


def test_scale_floor_still_catches_a_small_gradient_off_by_3e_10_of_itself():
    """The floor pinned by behaviour, in literal numbers (not derived from SCALE_FLOOR): a norm
    weight whose gradient is 1.5e-4 of the model's largest (the tiny model's wq/wk gradients sit
    at ~6e-4 of the head's at init) and is off by 3e-10 of itself must fail the float64 check.
    At a floor 10× higher it would be measured against 1e-3 of the largest: 4.5e-11, a pass."""
    head = torch.linspace(-1.0, 1.0, 50, dtype=torch.float64)
    norm = torch.full((8,), 1.5e-4, dtype=torch.float64)
    ref = {"output.weight": head, "norm.weight": norm}
    ours = {"output.weight": head, "norm.weight": norm * (1 + 3e-10)}
    assert relative_diff(ours, ref) == pytest.approx(3e-10, rel=1e-3)
    assert relative_diff(ours, ref) > TOLERANCE[torch.float64]


# --- the checker itself compares every step, not only the last ---------------------------------

def recorded_reference_run(spec) -> RunRecord:
    """A record that is the reference itself, with the parameters each step started from (the
    teacher-forced check reads them): every measure is at rounding level."""
    trainer = make_reference(spec.cfg, spec.seed, spec.torch_dtype, spec.optimizer, spec.lr,
                             clip_grad=spec.clip_grad, mixed_precision=spec.mixed_precision)
    data, losses, grads, starts = spec.data(), [], [], []
    for step in range(spec.steps):
        starts.append({n: t.clone() for n, t in trainer.parameters().items()})
        loss, g = trainer.step(data.global_batch(step, spec.global_batch))
        losses.append(loss)
        grads.append(g)
    params = {n: t.clone() for n, t in trainer.parameters().items()}
    return RunRecord(losses, grads, params, starts if spec.dtype != "float64" else [])


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_checker_sees_a_wrong_first_step_gradient_when_later_steps_are_right(dtype):
    """The properties' verdict (`compare`: free-running in float64, teacher-forced like --check
    otherwise) takes every step's gradients: one tensor of step 1 off by 1% must fail it, although
    steps 2 and 3 (and the final parameters) are exactly the reference's."""
    spec = TrainSpec(cfg=get_config("tiny", n_layers=1), world_size=1, global_batch=2,
                     micro_batch=2, seq_len=4, steps=3, dtype=dtype)
    record = recorded_reference_run(spec)
    assert max(compare(record, spec).values()) <= TOLERANCE[spec.precision]
    record.grads[0]["output.weight"] = record.grads[0]["output.weight"] * (1 + 1e-2)
    diffs = compare(record, spec)
    assert diffs["grad"] > 10 * TOLERANCE[spec.precision], diffs
