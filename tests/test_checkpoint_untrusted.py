"""A checkpoint is untrusted input (parallel3d.checkpoint.untrusted): every crafted metadata.json,
its checksum recomputed as an attacker would, is refused with one line before a byte is read, on
every rank; the genuine checkpoint beside each loads."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from parallel3d.checkpoint.load import load_checkpoint, read_full, verify_checkpoint
from parallel3d.checkpoint.save import CheckpointError, _body_checksum, save_checkpoint
from tests.harness import RankError
from tests.test_checkpoint import COLS, ROWS, full_state

SECRET = b"a file the user can read, outside the checkpoint" * 8


def good(root: Path) -> Path:
    return save_checkpoint(root, 1, full_state(1), {"step": 1}, config={"dim": 5})


def rewrite(step: Path, edit: Callable[[dict], None]) -> None:
    """Edit metadata.json and recompute its checksum: a checksum is not a signature."""
    meta = json.loads((step / "metadata.json").read_text())
    meta.pop("checksum")
    edit(meta)
    (step / "metadata.json").write_text(json.dumps({**meta, "checksum": _body_checksum(meta)}))


def rename_file(meta: dict, new: str) -> None:
    (info,) = meta["files"].values()
    meta["files"] = {new: info}
    for t in meta["tensors"].values():
        for p in t["pieces"]:
            p["file"] = new


def piece(meta: dict, name: str = "w") -> dict:
    return meta["tensors"][name]["pieces"][0]


def crafted(root: Path) -> dict[str, tuple[Path, str]]:
    """{case: (checkpoint root, regex of the one-line refusal)}; a secret file sits beside them."""
    secret = root / "secret.bin"
    secret.write_bytes(SECRET)
    cases: dict[str, tuple[Path, str]] = {}

    def case(name: str, message: str, edit: Callable[[dict], None] | None = None,
             after: Callable[[Path], None] | None = None) -> None:
        step = good(root / name)
        if edit:
            rewrite(step, edit)
        if after:
            after(step)
        cases[name] = (root / name, message)

    def absolute(meta: dict) -> None:
        """The attack in full: the secret's bytes, with checksums that match them."""
        rename_file(meta, str(secret))
        meta["files"][str(secret)].update(bytes=len(SECRET), crc32=zlib.crc32(SECRET))
        w = piece(meta)
        w.update(offset=0, crc32=zlib.crc32(SECRET[:w["nbytes"]]))
    case("absolute-path", r"names shard file '/.*secret.bin': a checkpoint's files must be plain names",
         absolute)
    case("dot-dot", r"names shard file '\.\./secret.bin'", lambda m: rename_file(m, "../secret.bin"))
    case("sub-path", r"names shard file 'x/rank-00000.bin'", lambda m: rename_file(m, "x/rank-00000.bin"))

    def symlink_out(step: Path) -> None:
        target = step / "rank-00000.bin"
        target.unlink()
        target.symlink_to(secret)
    case("symlink", r"names shard file 'rank-00000.bin', a link out of", after=symlink_out)

    def latest_out(step: Path) -> None:
        (step.parent / "latest").write_text("../" + step.parent.name + "/step-00000001\n")
    case("latest-out", r"latest names '\.\./latest-out/step-00000001', not a step-N directory",
         after=latest_out)

    def latest_link(step: Path) -> None:
        elsewhere = root / "elsewhere"
        good(elsewhere)
        (step.parent / "step-00000002").symlink_to(elsewhere / "step-00000001")
        (step.parent / "latest").write_text("step-00000002\n")
    case("latest-symlink", r"latest names step-00000002, a link: refused", after=latest_link)

    case("dtype-not-a-dtype", r"tensor 'w'.*dtype 'load' is not one of",
         lambda m: m["tensors"]["w"].update(dtype="load"))
    case("dtype-not-a-string", r"dtype \['float64'\] is not one of",
         lambda m: m["tensors"]["w"].update(dtype=["float64"]))
    case("offset-past-file", r"runs past the end of rank-00000.bin",
         lambda m: piece(m).update(offset=piece(m)["offset"] + 10_000))
    case("shape-past-file", r"a piece of 300 elements says 2400 bytes|runs past the end",
         lambda m: (m["tensors"]["w"].update(shape=[60, 5]),
                    piece(m).update(numel=300, nbytes=2400, box_shape=[60, 5])))
    case("nbytes-lie", r"a piece of 30 elements says 16 bytes \(240 at 8 bytes each\)",
         lambda m: piece(m).update(nbytes=16))
    case("box-past-shape", r"a piece's box \[6, 5\] at \[1, 0\] runs past the shape \[6, 5\]",
         lambda m: piece(m).update(offsets=[1, 0]))
    case("negative-offset", r"piece offset is -8: an integer >= 0", lambda m: piece(m).update(offset=-8))
    case("unlisted-file", r"a piece is in 'rank-00007.bin', which 'files' does not list",
         lambda m: piece(m).update(file="rank-00007.bin"))
    case("float-as-int", r"step is 1.5: an integer", lambda m: m.update(step=1.5))
    case("flat-range-past-box", r"a piece's flat range \[0, 30\) is outside its box \[3, 5\]",
         lambda m: piece(m).update(box_shape=[3, 5], offsets=[0, 0], flat_start=0))

    def symlink_inside(step: Path) -> None:  # no link at all, even to a file of its own directory
        target, inner = step / "rank-00000.bin", step / "inner.bin"
        inner.write_bytes(target.read_bytes())
        target.unlink()
        target.symlink_to(inner)
    case("symlink-inside", r"names shard file 'rank-00000.bin', a link out of", after=symlink_inside)
    return cases


def load_w(path: Path) -> torch.Tensor:
    out = torch.zeros(ROWS, COLS, dtype=torch.float64)
    load_checkpoint(path, {"w": out})
    return out


def test_each_crafted_checkpoint_is_refused_with_one_line(tmp_path):
    cases = crafted(tmp_path)
    for name, (path, message) in cases.items():
        for attempt in (load_w, read_full, verify_checkpoint):
            with pytest.raises(CheckpointError, match=message) as info:
                attempt(path)
            assert "\n" not in str(info.value), (name, attempt.__name__)


def test_the_genuine_checkpoint_loads(tmp_path):
    """The control: unedited, and edited with an honest rewrite, the same checkpoint loads."""
    good(tmp_path / "plain")
    rewrite(good(tmp_path / "rewritten"), lambda meta: None)
    for root in ("plain", "rewritten"):
        assert torch.equal(load_w(tmp_path / root), full_state(1)["w"])


def test_no_byte_is_read_before_the_refusal(tmp_path, monkeypatch):
    """The metadata is checked whole before any shard file is opened."""
    cases = crafted(tmp_path)
    opened = []
    real_open = open

    def spy(file, *args, **kwargs):
        if str(file).endswith(".bin"):
            opened.append(str(file))
        return real_open(file, *args, **kwargs)
    monkeypatch.setattr("builtins.open", spy)
    for path, _ in cases.values():
        with pytest.raises(CheckpointError):
            load_w(path)
    assert opened == []


def test_a_kind_mismatch_is_refused_before_reading(tmp_path):
    good(tmp_path)
    with pytest.raises(CheckpointError, match=r"'w' is saved as torch.float64, this run asks for torch.int6"):
        load_checkpoint(tmp_path, {"w": torch.zeros(ROWS, COLS, dtype=torch.int64)})


def load_crafted(path: str) -> None:
    load_w(Path(path))


def test_a_crafted_checkpoint_is_refused_on_every_rank(pools, tmp_path):
    cases = crafted(tmp_path)
    path, message = cases["absolute-path"]
    with pytest.raises(RankError, match=message) as info:
        pools.run(2, load_crafted, str(path))
    assert sorted(info.value.errors) == [0, 1]
    assert len(set(info.value.errors.values())) == 1


def test_without_the_checks_the_crafted_checkpoint_loads_the_secret(tmp_path, monkeypatch):
    """Why the checks exist: with them taken out, the absolute-path case resumes without a word
    and its weights are the bytes of a file outside the checkpoint."""
    path, _ = crafted(tmp_path)["absolute-path"]
    monkeypatch.setattr("parallel3d.checkpoint.load.check_metadata", lambda directory, meta: None)
    monkeypatch.setattr("parallel3d.checkpoint.load.member", lambda directory, name: directory / name)
    w = load_w(path)
    assert w.view(-1).view(torch.uint8).numpy().tobytes() == SECRET[:ROWS * COLS * 8]
