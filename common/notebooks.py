"""Execute every chapter's lesson.ipynb headless (`make notebooks` keeps the outputs in place;
the test suite runs them without writing)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def lesson_notebooks() -> list[Path]:
    return sorted(REPO_ROOT.glob("0*_*/lesson.ipynb"))


def execute(path: Path, timeout_s: int = 300, in_place: bool = False) -> float:
    """Run all cells with the notebook's directory as the working directory; returns seconds."""
    import nbclient
    import nbformat

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    nbclient.NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    if in_place:
        nbformat.write(nb, path)
    return time.perf_counter() - start


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--in-place", action="store_true", help="save the executed outputs")
    args = parser.parse_args()
    for notebook in lesson_notebooks():
        print(f"{notebook.relative_to(REPO_ROOT)}: {execute(notebook, in_place=args.in_place):.1f} s",
              flush=True)
