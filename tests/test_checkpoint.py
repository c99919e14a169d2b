"""Chapter 07 checkpoints: the format, atomic commit, crashes at every point of a save, and one
clear error for each way a checkpoint can be bad (parallel3d.checkpoint: save, load)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from parallel3d.checkpoint.load import load_checkpoint, read_full, resolve_checkpoint, verify_checkpoint
from parallel3d.checkpoint.save import CRASH_ENV, CheckpointError, Shard, save_checkpoint
from tests.forked import run_forked
from tests.harness import RankError

ROWS, COLS = 6, 5


def full_state(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {"w": torch.randn(ROWS, COLS, dtype=torch.float64, generator=g),
            "norm": torch.randn(COLS, generator=g),
            "optim.w.step": torch.tensor(float(version))}


def rank_shards(state: dict, rank: int, world: int) -> dict[str, Shard]:
    """Rank r holds a flat range of w (FSDP-like, ragged) and a replicated norm and step."""
    flat = state["w"].reshape(-1)
    bounds = [ROWS * COLS * r // world for r in range(world + 1)]
    a, b = bounds[rank], bounds[rank + 1]
    return {"w": Shard(flat[a:b].clone(), (ROWS, COLS), (0, 0), (ROWS, COLS), a),
            "norm": Shard(state["norm"].clone(), (COLS,), (0,)),
            "optim.w.step": Shard(state["optim.w.step"].clone(), (), ())}


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def assert_state(root: Path, version: int) -> None:
    tensors, meta = read_full(root)
    assert meta["step"] == version and meta["state"] == {"step": version}
    for name, t in full_state(version).items():
        assert torch.equal(tensors[name], t), name


def test_single_rank_round_trip_keeps_bits_state_and_rank_state(tmp_path):
    state = full_state(1)
    path = save_checkpoint(tmp_path, 7, state, {"step": 7, "lr": 1e-3}, config={"dim": 5},
                           rank_state={"rng": "abc"})
    assert path == tmp_path / "step-00000007" and (tmp_path / "latest").read_text() == "step-00000007\n"
    out = {"w": torch.zeros(2, COLS, dtype=torch.float64)}  # rows 3..4 only
    loaded = load_checkpoint(tmp_path, {"w": Shard(out["w"], (ROWS, COLS), (3, 0))}, config={"dim": 5})
    assert torch.equal(out["w"], state["w"][3:5])
    assert (loaded.step, loaded.state, loaded.rank_state) == (7, {"step": 7, "lr": 1e-3}, {"rng": "abc"})
    assert verify_checkpoint(tmp_path) == path


def test_keep_prunes_old_checkpoints_but_never_the_latest(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, full_state(step), {"step": step}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000002", "step-00000003"]
    assert_state(tmp_path, 3)


def _save_versions(rank: int, root: str, world: int, crash: str | None, versions=(1, 2)) -> None:
    """Save versions in turn; the last one with the crash injected (if any)."""
    for v in versions:
        if crash and v == versions[-1]:
            os.environ[CRASH_ENV] = crash
        save_checkpoint(root, v, rank_shards(full_state(v), rank, world), {"step": v})


def test_each_rank_writes_only_its_shards_and_replicated_tensors_once(tmp_path):
    assert run_forked(3, _save_versions, str(tmp_path), 3, None) == [0, 0, 0]
    meta = json.loads((tmp_path / "step-00000002" / "metadata.json").read_text())
    assert [p["file"] for p in meta["tensors"]["w"]["pieces"]] == [f"rank-0000{r}.bin" for r in range(3)]
    for name in ("norm", "optim.w.step"):  # held by every rank, written by rank 0 only
        assert [p["file"] for p in meta["tensors"][name]["pieces"]] == ["rank-00000.bin"]
    sizes = {f: info["bytes"] for f, info in meta["files"].items()}
    assert sizes["rank-00001.bin"] == sizes["rank-00002.bin"] == 10 * 8  # its 10 float64 of w
    assert_state(tmp_path, 2)


# rank 1 dies: before writing, in the middle of its file, after writing (before the barrier);
# rank 0 dies: after metadata (before the rename), after the rename (before `latest` moves)
CRASH_POINTS = ["1:plan", "1:write", "1:gather", "0:rename", "0:latest"]


@pytest.mark.parametrize("crash", CRASH_POINTS)
def test_a_rank_killed_during_a_save_leaves_the_last_checkpoint_intact(tmp_path, crash):
    codes = run_forked(2, _save_versions, str(tmp_path), 2, crash)
    dead = int(crash[0])
    assert codes[dead] == 17, codes  # the injected os._exit, not some other failure
    before = digest(tmp_path / "step-00000001")
    assert resolve_checkpoint(tmp_path) == tmp_path / "step-00000001"
    verify_checkpoint(tmp_path)
    assert_state(tmp_path, 1)
    # the restarted job saves step 2 again over whatever the crash left
    assert run_forked(2, _save_versions, str(tmp_path), 2, None, (2,)) == [0, 0]
    assert_state(tmp_path, 2)
    assert digest(tmp_path / "step-00000001") == before
    assert not [p for p in tmp_path.iterdir() if p.name.endswith((".tmp", ".old"))]


# --- bad input: one line naming the file ---------------------------------------------------


def _good(root: Path) -> Path:
    return save_checkpoint(root, 1, full_state(1), {"step": 1}, config={"dim": 5})


def _flip_byte(path: Path, offset: int = 3) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _bad_checkpoints(root: Path) -> dict[str, tuple[Path, str]]:
    """{case: (path to load, regex the error must match)}."""
    root.mkdir(parents=True, exist_ok=True)
    cases = {"missing": (root / "nope", r"nope does not exist"),
             "empty": (root / "empty", r"empty is empty")}
    (root / "empty").mkdir()
    mid = root / "mid"
    (mid / "step-00000001.tmp").mkdir(parents=True)
    cases["mid-write"] = (mid, r"only a save that never finished \(step-00000001.tmp\)")
    cases["tmp-dir"] = (mid / "step-00000001.tmp", r"step-00000001.tmp is a save that never finished")
    for case in ("partial", "missing-shard", "truncated", "corrupt", "corrupt-metadata", "dangling"):
        step = _good(root / case)
        target = step / "rank-00000.bin"
        if case == "partial":
            (step / "metadata.json").unlink()
            cases[case] = (root / case, r"step-00000001 is partial: it has no metadata.json")
        elif case == "missing-shard":
            target.unlink()
            cases[case] = (root / case, r"shard file .*missing-shard/step-00000001/rank-00000.bin is missing")
        elif case == "truncated":
            target.write_bytes(target.read_bytes()[:-9])
            cases[case] = (root / case, r"rank-00000.bin is truncated or damaged: \d+ bytes, metadata")
        elif case == "corrupt":
            _flip_byte(target)
            cases[case] = (root / case, r"corrupt/step-00000001/rank-00000.bin is corrupt: the piece of 'w'")
        elif case == "corrupt-metadata":
            meta = json.loads((step / "metadata.json").read_text())
            meta["step"] = 2  # an edit that keeps the JSON valid
            (step / "metadata.json").write_text(json.dumps(meta))
            cases[case] = (root / case, r"metadata.json is corrupt: its checksum does not match")
        else:
            (root / case / "latest").write_text("step-00000009\n")
            cases[case] = (root / case, r"latest names step-00000009, which does not exist")
    return cases


def _load_all(root: Path, config: dict | None = None):
    return load_checkpoint(root, {"w": torch.zeros(ROWS, COLS, dtype=torch.float64)}, config=config)


def test_every_bad_checkpoint_is_one_clear_error_naming_the_file(tmp_path):
    cases = _bad_checkpoints(tmp_path)
    before = digest(tmp_path)
    for case, (path, message) in cases.items():
        with pytest.raises(CheckpointError, match=message) as info:
            _load_all(path)
        assert "\n" not in str(info.value), case
    assert digest(tmp_path) == before  # a failed load touches nothing


def test_a_checkpoint_of_another_model_config_is_rejected(tmp_path):
    _good(tmp_path)
    with pytest.raises(CheckpointError, match=r"metadata.json is a checkpoint of another model config "
                                              r"\(saved != this run: dim 5 != 6\)"):
        _load_all(tmp_path, config={"dim": 6})
    with pytest.raises(CheckpointError, match=r"'w' has shape \[6, 5\], this run asks for \[5, 6\]"):
        load_checkpoint(tmp_path, {"w": torch.zeros(5, 6, dtype=torch.float64)})


def test_saving_over_the_latest_checkpoint_is_refused_and_touches_nothing(tmp_path):
    _good(tmp_path)
    before = digest(tmp_path)
    with pytest.raises(CheckpointError, match=r"step-00000001 is the latest checkpoint; refusing"):
        _good(tmp_path)
    assert digest(tmp_path) == before


def test_shard_descriptions_that_do_not_tile_the_tensor_are_rejected(tmp_path):
    state = full_state(1)
    with pytest.raises(CheckpointError, match=r"'w': its pieces cover 20 of 30 elements"):
        save_checkpoint(tmp_path, 1, {"w": Shard(state["w"][:4], (ROWS, COLS), (0, 0))})
    assert not (tmp_path / "latest").exists()


def _no_collectives():
    fail = mock.Mock(side_effect=AssertionError("entered a collective"))
    return mock.patch.multiple(dist, all_gather_object=fail, gather_object=fail,
                               broadcast_object_list=fail, barrier=fail)


def load_without_collectives(path: str) -> None:
    with _no_collectives():
        _load_all(Path(path))


STRUCTURAL = ("missing", "mid-write", "partial", "truncated", "corrupt-metadata")


def test_structural_errors_fail_on_every_rank_before_any_collective(pools, tmp_path):
    cases = _bad_checkpoints(tmp_path)
    for case in STRUCTURAL:  # (a flipped byte is found only by the rank that reads it: below)
        path, message = cases[case]
        with pytest.raises(RankError, match=message) as info:
            pools.run(4, load_without_collectives, str(path))
        assert sorted(info.value.errors) == [0, 1, 2, 3], case
        assert all(e.startswith("CheckpointError") for e in info.value.errors.values()), case


BIG = torch.arange(40, dtype=torch.float64).view(8, 5)


def save_rows(root: str) -> None:
    """Rank r holds rows [2r, 2r + 2) of an 8 × 5 tensor."""
    rank = dist.get_rank()
    save_checkpoint(root, 1, {"w": Shard(BIG[2 * rank:2 * rank + 2].clone(), (8, 5), (2 * rank, 0))})


def load_rows(root: str) -> None:
    """Each rank reads back its own rows: only rank 1 reads rank-00001.bin."""
    rank = dist.get_rank()
    out = torch.zeros(2, 5, dtype=torch.float64)
    load_checkpoint(root, {"w": Shard(out, (8, 5), (2 * rank, 0))})
    assert torch.equal(out, BIG[2 * rank:2 * rank + 2])


def test_a_corrupt_piece_read_by_one_rank_fails_every_rank(pools, tmp_path):
    pools.run(4, save_rows, str(tmp_path))
    pools.run(4, load_rows, str(tmp_path))
    _flip_byte(tmp_path / "step-00000001" / "rank-00001.bin")
    with pytest.raises(RankError, match=r"rank-00001.bin is corrupt") as info:
        pools.run(4, load_rows, str(tmp_path))
    assert sorted(info.value.errors) == [0, 1, 2, 3]
    assert len(set(info.value.errors.values())) == 1
