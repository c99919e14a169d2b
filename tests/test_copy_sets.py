"""The pieces people copy (common/copy_sets.py): the rule that keeps them copyable, each piece's
declared copy set equal to the import closure of its entry files, the READMEs' "Copy it" sections
equal to what the sets say, and a copy of each set, alone in an empty directory, training a model
in a user's plain loop like one device (float64, 1e-10).

The copy keeps each file's package folder (01_data_parallel/ddp.py → data_parallel/ddp.py, an
empty __init__.py in each folder), so the files' imports resolve as written, with no rewriting.
Its ranks are forked (common/forkrun.py) and run tests/copy_loops.py, which first drops the
repository's modules and its editable install's finder and keeps only the copy, the standard
library and site-packages on sys.path: a file missing from a set is a ModuleNotFoundError there
(a control below checks exactly that), never a silent import from the repository.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from common import copy_sets
from common.copy_sets import COPY_SETS, KERNEL, ROOT
from common.forkrun import forkrun

LOOPS = Path(__file__).with_name("copy_loops.py")
WORLD = {"parallelize_3d": 4}  # tp 2 × pp 2; every other piece on 2 ranks
TOLERANCE = 1e-10
STEPS = 3  # 2 steps, a checkpoint, a fresh piece loaded from it, 1 step more


def test_core_files_import_only_the_stdlib_torch_their_chapter_and_the_kernel():
    assert copy_sets.violations() == []


def test_a_core_file_importing_outside_the_kernel_breaks_the_rule(tmp_path, monkeypatch):
    """The rule's own control: a planted import of the memory ledger (common/, not the kernel)
    and one of another chapter, in a copy of chapter 01 beside the kernel."""
    for f in [*KERNEL, "pyproject.toml", "01_data_parallel/ddp.py", "01_data_parallel/naive.py"]:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / f, tmp_path / f)
    ddp = tmp_path / "01_data_parallel/ddp.py"
    ddp.write_text(ddp.read_text().replace("from .naive import broadcast_module",
                                           "from .naive import broadcast_module\nfrom common.memory "
                                           "import storage_bytes\nfrom zero.flat import FlatGroup", 1))
    monkeypatch.setattr(copy_sets, "ROOT", tmp_path)
    found = "\n".join(copy_sets.violations())
    line = 1 + ddp.read_text().split("\n").index("from common.memory import storage_bytes")
    assert f"ddp.py:{line} imports common.memory: not in the torch-only kernel" in found, found
    assert "imports zero.flat: not its chapter, the kernel or a chapter it composes" in found, found


# an optional package at a file's top, as each form of import runs it at import time
OPTIONAL_AT_THE_TOP = {
    "import matplotlib.pyplot as plt": "matplotlib.pyplot",
    "from safetensors.torch import save_file": "safetensors.torch",
    "try:\n    import matplotlib\nexcept ImportError:\n    matplotlib = None": "matplotlib",
    "class Plot:\n    from matplotlib import pyplot": "matplotlib",
    "import importlib\npyplot = importlib.import_module('matplotlib.pyplot')": "matplotlib.pyplot",
    "safetensors = __import__('safetensors')": "safetensors",
}
INSIDE = "def plot():\n    import matplotlib.pyplot as plt\n    return plt\n"


def test_an_optional_package_at_the_top_of_a_core_file_is_reported(tmp_path, monkeypatch):
    """OPTIONAL packages (matplotlib, safetensors) only inside the function that needs it: every
    form of import that runs when the file is imported is reported at its line, the same import
    inside a function is not in a core file, and is in a kernel file (torch and the stdlib only)."""
    for f in [*KERNEL, "pyproject.toml", "01_data_parallel/ddp.py", "01_data_parallel/naive.py"]:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / f, tmp_path / f)
    monkeypatch.setattr(copy_sets, "ROOT", tmp_path)
    ddp, clip = tmp_path / "01_data_parallel/ddp.py", tmp_path / "common/kernel/clip.py"
    ddp.write_text(ddp.read_text() + "\n" + INSIDE)
    clip.write_text(clip.read_text() + "\n" + INSIDE)
    assert copy_sets.violations() == [
        f"common/kernel/clip.py:{len(clip.read_text().splitlines()) - 1} imports matplotlib.pyplot: "
        "kernel files use torch and the stdlib only"]
    clip.write_text((ROOT / "common/kernel/clip.py").read_text())
    for planted, module in OPTIONAL_AT_THE_TOP.items():
        ddp.write_text((ROOT / "01_data_parallel/ddp.py").read_text() + "\n" + planted + "\n")
        first = len((ROOT / "01_data_parallel/ddp.py").read_text().splitlines()) + 2  # the planted lines'
        line = first + next(i for i, text in enumerate(planted.split("\n")) if module.split(".")[0] in text)
        assert copy_sets.violations() == [f"01_data_parallel/ddp.py:{line} imports {module} at the top: "
                                          "import it inside the function that needs it"], planted


def test_each_copy_set_is_the_import_closure_of_its_entries():
    for name, piece in COPY_SETS.items():
        assert copy_sets.closure(piece.entries) == piece.files, (
            f"{name}: declared {piece.files}, the entries {piece.entries} import "
            f"{copy_sets.closure(piece.entries)}: update COPY_SETS in common/copy_sets.py")


MOE_PIECES = ("expert parallelism",)  # pieces that exist for a MoE model


def test_moe_stays_out_of_the_loop_the_executor_and_every_dense_copy():
    """The shared loop and the pipeline executor tell a module with its own loss term its scale
    through the module's `aux_loss_scale`, without importing common/kernel/moe.py;
    common/kernel/model.py imports it only to build a MoE block, and 07's recipe 05's MoE plan and
    expert parallelism only in the two steps a MoE model takes; so no dense piece's copy carries
    them (parallelize_3d's README names them for a MoE model). Re-adding an import at the top of
    any of those files turns this red."""
    for path in ("common/training.py", "06_pipeline/executor.py", "common/kernel/model.py",
                 "07_3d/parallelize.py"):
        assert "common/kernel/moe.py" not in copy_sets.closure((path,)), f"{path} imports the MoE layer"
    for name, piece in COPY_SETS.items():
        if name not in MOE_PIECES:
            assert "common/kernel/moe.py" not in piece.files + copy_sets.closure(piece.entries), name
    assert copy_sets.optional_files(COPY_SETS["parallelize_3d"]) == (  # 05's MoE plan and EP
        "05_tensor_parallel/expert_parallel.py", "05_tensor_parallel/formulas.py",
        "05_tensor_parallel/moe_tensor_parallel.py", "common/kernel/moe.py")


def test_each_readme_gives_its_pieces_copy_sets():
    for readme in copy_sets.readmes():
        section = copy_sets.current_section((ROOT / readme).read_text(encoding="utf-8")) or ""
        assert section.rstrip() == copy_sets.readme_section(readme).rstrip(), (
            f"{readme}'s 'Copy it' section is not what common/copy_sets.py says: run "
            "`python -m common.copy_sets --write`")


def lay_out(files: tuple[str, ...], root: Path) -> Path:
    """`files` copied into `root` under their package names, an empty __init__.py in each
    package folder; the user's (dense) model, common/kernel/model.py as `user_model`, beside them when
    the set does not hold it (a dense model never imports common/kernel/moe.py)."""
    for f in files:
        dest = root / copy_sets.copy_path(f)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / f, dest)
        for folder in dest.relative_to(root).parents:
            if folder != Path("."):
                (root / folder / "__init__.py").touch()
    if "common/kernel/model.py" not in files:  # the user's model
        shutil.copy(ROOT / "common/kernel/model.py", root / "user_model.py")
    return root


def run_copy(piece: str, files: tuple[str, ...], tmp_path: Path):
    root = lay_out(files, tmp_path / "copy")
    return root, forkrun(str(LOOPS), piece, str(root), str(tmp_path), nproc=WORLD.get(piece, 2),
                         cwd=tmp_path, env={"COPY_PACKAGES": ",".join(copy_sets.PACKAGES)}, timeout_s=240)


@pytest.mark.parametrize("piece", list(COPY_SETS))
def test_a_copy_of_the_set_alone_trains_like_one_device(piece, tmp_path):
    root, result = run_copy(piece, COPY_SETS[piece].files, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("COPY-RESULT ")]
    report = json.loads(lines[0].removeprefix("COPY-RESULT "))
    outside = [f for f in report["files"] if not f.startswith(str(root))]
    assert not outside, f"{piece} imported project code from outside its copy: {outside}"
    expected = {str(root / copy_sets.copy_path(f)) for f in COPY_SETS[piece].files}
    assert expected <= set(report["files"]), sorted(expected - set(report["files"]))
    assert report["steps"] >= STEPS and report["norms"] <= TOLERANCE and report["params"] <= TOLERANCE, report


def test_a_copy_missing_a_file_fails_instead_of_reaching_the_repository(tmp_path):
    """The isolation's control: DDP's set without naive.py cannot quietly import the repo's."""
    files = tuple(f for f in COPY_SETS["DDP"].files if not f.endswith("naive.py"))
    _, result = run_copy("DDP", files, tmp_path)
    assert result.returncode != 0
    assert "No module named 'data_parallel.naive'" in result.stderr, result.stderr[-2000:]
