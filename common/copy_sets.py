"""What to copy to use one piece of the course in your own code: the torch-only kernel and the
copy set of each piece, written once here and checked by tests/test_copy_sets.py.

The rule. A chapter's core files (every .py of a chapter folder but train.py, bench*.py,
__init__.py, exercises.py, solutions.py, lab*.py and torch_*.py) import only the standard
library, torch, files of their own chapter, the KERNEL below, and, in chapter 07 only, the
chapters it composes (COMPOSES); always from the module that defines the name
(`from fsdp.wrap import MixedPrecision`), never from a package's __init__.py, so that a copy
works with an empty __init__.py. A third-party package in OPTIONAL may be imported inside the one
function that needs it (a plot, an export format), never at the top of a file. Kernel files
import only the standard library, torch and the kernel. What only a mixture-of-experts model
uses (the MoE layer of OPTIONAL_KERNEL and what imports it) is imported inside the function that
needs it (common/kernel/model.py builds a MoE block; 07's recipe takes 05's MoE plan and expert
parallelism), so a dense copy leaves it out.

A piece's copy set is the import closure of its entry files: every project file they import,
and those files' imports, down to the kernel (imports under `if TYPE_CHECKING:` excluded, and
those inside a function: the README names them for the models that need them). Copy
each file into a folder named by its package (01_data_parallel/ddp.py → data_parallel/ddp.py,
common/kernel/clip.py → common/kernel/clip.py), with an empty __init__.py in each folder, on your import path:
the imports then resolve as they are, with no edit. The test copies exactly that into an empty
directory and trains with it alone, and checks the "Copy it" section of each README against
`readme_section`: `python -m common.copy_sets --write` rewrites those sections.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from common.chapters import FOLDERS, PACKAGES

ROOT = Path(__file__).resolve().parent.parent


# the torch-only kernel: every file of common/kernel/ (the folder is the declaration)
KERNEL = tuple(sorted(str(p.relative_to(ROOT)) for p in (ROOT / "common/kernel").glob("*.py")
                      if p.name != "__init__.py"))
OPTIONAL_KERNEL = {"common/kernel/moe.py": "a mixture-of-experts model (n_experts > 0)"}
COMPOSES = {"parallel3d": ("fsdp", "tensor_parallel", "pipeline")}
OPTIONAL = {"matplotlib": "06's timeline plots", "safetensors": "07's Hugging Face export"}
NOT_CORE = re.compile(  # the before-stop hook's exemption pattern
    r"(^|/)(train[a-z_]*|bench[a-z_]*|__init__|exercises|solutions|lab[a-z_0-9]*|torch_[a-z0-9_]*)\.py$")


@dataclass(frozen=True)
class CopySet:
    """A piece people copy: the README that lists it, the import a user writes, the files its
    use starts from, and the files to copy (= the import closure of `entries`, checked)."""

    readme: str
    use: str
    entries: tuple[str, ...]
    files: tuple[str, ...]


COPY_SETS: dict[str, CopySet] = {
    "DDP": CopySet(
        "01_data_parallel/README.md", "from data_parallel.ddp import DistributedDataParallel",
        ("01_data_parallel/ddp.py",),
        ("01_data_parallel/ddp.py", "01_data_parallel/naive.py")),
    "ring all-reduce": CopySet(
        "02_ring_allreduce/README.md", "from ring_allreduce.ring import ring_all_reduce",
        ("02_ring_allreduce/ring.py",),
        ("02_ring_allreduce/agreement.py", "02_ring_allreduce/plan.py", "02_ring_allreduce/ring.py")),
    "ZeroOptimizer": CopySet(
        "03_zero/README.md", "from zero.optimizer import ZeroOptimizer",
        ("03_zero/optimizer.py",),
        ("03_zero/arguments.py", "03_zero/flat.py", "03_zero/offload.py", "03_zero/optimizer.py",
         "03_zero/optimizer_state.py", "03_zero/sole_reducer.py", "common/kernel/clip.py",
         "common/kernel/collectives.py")),
    "FSDP": CopySet(
        "04_fsdp/README.md", "from fsdp.fully_sharded import FullyShardedDataParallel",
        ("04_fsdp/fully_sharded.py",),
        ("04_fsdp/flat_param.py", "04_fsdp/fully_sharded.py", "04_fsdp/state.py", "04_fsdp/wrap.py",
         "common/kernel/clip.py", "common/kernel/collectives.py", "common/kernel/mesh.py")),
    "TP layers and plan": CopySet(
        "05_tensor_parallel/README.md",
        "from tensor_parallel.parallelize import parallelize_llama, vocab_parallel_loss",
        ("05_tensor_parallel/parallelize.py", "common/kernel/clip.py"),  # clipping needs the global norm
        ("05_tensor_parallel/cross_entropy.py", "05_tensor_parallel/layers.py",
         "05_tensor_parallel/mappings.py", "05_tensor_parallel/parallelize.py",
         "05_tensor_parallel/sharding.py", "common/kernel/clip.py", "common/kernel/collectives.py")),
    "expert parallelism": CopySet(
        "05_tensor_parallel/expert_parallel.md",
        "from tensor_parallel.expert_parallel import expert_parallel, is_expert",
        ("05_tensor_parallel/expert_parallel.py", "common/kernel/clip.py"),  # clipping: the global norm
        ("05_tensor_parallel/expert_parallel.py", "common/kernel/clip.py", "common/kernel/model.py",
         "common/kernel/moe.py")),
    "ring attention": CopySet(
        "05_tensor_parallel/README.md", "from tensor_parallel.context_parallel import apply_context_parallel",
        ("05_tensor_parallel/context_parallel.py",),
        ("05_tensor_parallel/context_layout.py", "05_tensor_parallel/context_parallel.py",
         "common/kernel/collectives.py")),
    "pipeline schedule and executor": CopySet(
        "06_pipeline/README.md",
        "from pipeline.executor import PipelineExecutor; from pipeline.schedules import make_schedule",
        # the norm over stages
        ("06_pipeline/executor.py", "06_pipeline/schedules.py", "common/kernel/clip.py"),
        ("06_pipeline/backward_split.py", "06_pipeline/executor.py", "06_pipeline/p2p.py",
         "06_pipeline/schedules.py", "06_pipeline/timeline.py", "common/kernel/clip.py")),
    "parallelize_3d": CopySet(
        "07_3d/README.md",
        "from parallel3d.parallelize import parallelize_3d; from parallel3d.clip import clip_grad_norm_3d",
        ("07_3d/parallelize.py", "07_3d/clip.py", "common/kernel/mesh.py", "06_pipeline/executor.py"),
        ("04_fsdp/flat_param.py", "04_fsdp/fully_sharded.py", "04_fsdp/state.py", "04_fsdp/wrap.py",
         "05_tensor_parallel/context_layout.py", "05_tensor_parallel/context_parallel.py",
         "05_tensor_parallel/cross_entropy.py",
         "05_tensor_parallel/layers.py", "05_tensor_parallel/mappings.py",
         "05_tensor_parallel/parallelize.py", "05_tensor_parallel/sharding.py",
         "06_pipeline/backward_split.py", "06_pipeline/executor.py", "06_pipeline/p2p.py",
         "06_pipeline/schedules.py", "06_pipeline/stage.py", "06_pipeline/timeline.py",
         "07_3d/checkpoint/reshard.py", "07_3d/clip.py", "07_3d/parallelize.py", "07_3d/recompute.py",
         "07_3d/shards.py", "common/kernel/clip.py", "common/kernel/collectives.py", "common/kernel/mesh.py",
         "common/kernel/model.py")),
    "checkpoint save/load": CopySet(
        "07_3d/checkpoint/README.md",
        "from parallel3d.checkpoint.save import save_checkpoint; "
        "from parallel3d.checkpoint.load import load_checkpoint",
        ("07_3d/checkpoint/save.py", "07_3d/checkpoint/load.py", "07_3d/checkpoint/state.py"),
        ("07_3d/checkpoint/load.py", "07_3d/checkpoint/reshard.py", "07_3d/checkpoint/save.py",
         "07_3d/checkpoint/state.py", "07_3d/checkpoint/untrusted.py")),
}


# --- reading imports --------------------------------------------------------------------------

@dataclass(frozen=True)
class Import:
    module: str  # absolute dotted name (a relative import resolved)
    names: tuple[str, ...]  # `from module import names`; () for `import module`
    line: int
    lazy: bool  # inside a function
    typing_only: bool  # under `if TYPE_CHECKING:`


def module_name(path: str) -> str:
    """"07_3d/checkpoint/save.py" → "parallel3d.checkpoint.save" (a package: its __init__'s name)."""
    parts = Path(path).with_suffix("").parts
    parts = (FOLDERS[parts[0]], *parts[1:])
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_path(module: str) -> str | None:
    """The project file that defines `module`, or None for anything else (torch, the stdlib)."""
    top, *rest = module.split(".")
    if top not in PACKAGES:
        return None
    base = "/".join([PACKAGES[top], *rest])
    for candidate in (f"{base}.py", f"{base}/__init__.py"):
        if (ROOT / candidate).is_file():
            return candidate
    return None


DYNAMIC = ("importlib.import_module", "import_module", "__import__")  # called with a name: an import too


def imports(path: str) -> list[Import]:
    """Every import statement of a file (also inside functions), relative ones made absolute, and
    every `importlib.import_module("name")` / `__import__("name")`."""
    package = module_name(path) if path.endswith("__init__.py") else module_name(path).rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(Import(a.name, (), child.lineno, lazy, typing_only) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = package.rsplit(".", child.level - 1)[0] if child.level else ""
                module = ".".join(p for p in (base, child.module or "") if p)
                names = tuple(a.name for a in child.names)
                found.append(Import(module, names, child.lineno, lazy, typing_only))
            else:
                if (isinstance(child, ast.Call) and ast.unparse(child.func) in DYNAMIC and child.args
                        and isinstance(child.args[0], ast.Constant) and isinstance(child.args[0].value, str)):
                    found.append(Import(child.args[0].value, (), child.lineno, lazy, typing_only))
                in_function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                checking = isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
                visit(child, lazy or in_function, typing_only or checking)

    visit(ast.parse((ROOT / path).read_text(encoding="utf-8")), False, False)
    return found


def resolve(imp: Import) -> list[str]:
    """The project files an import needs: `from pkg import sub` is pkg/sub.py; `from pkg import
    Name` is pkg/__init__.py (which the rule forbids: import Name from its module)."""
    if imp.names:
        files = [module_path(f"{imp.module}.{name}") for name in imp.names]
        if all(files):
            return files
    own = module_path(imp.module)
    return [own] if own else []


def closure(entries: tuple[str, ...] | list[str], optional: bool = False) -> tuple[str, ...]:
    """Every project file the entries need at run time, the entries included, sorted; with
    `optional`, also the files they import inside a function (for a MoE model)."""
    seen, todo = set(entries), list(entries)
    while todo:
        for imp in imports(todo.pop()):
            for f in resolve(imp) if not imp.typing_only else []:
                if f not in seen and (optional or not imp.lazy):
                    seen.add(f)
                    todo.append(f)
    return tuple(sorted(seen))


def optional_files(piece: CopySet) -> tuple[str, ...]:
    """The files a piece's files import inside a function (and what those need): a MoE model's."""
    return tuple(f for f in closure(piece.files, optional=True) if f not in piece.files)


# --- the rule -----------------------------------------------------------------------------------

def chapter_folders() -> list[str]:
    return sorted(folder for folder in PACKAGES.values() if folder != "common")


def core_files() -> list[str]:
    """Every core file of every chapter (07's subpackages included; a chapter's figures/ is the
    code of its pictures, not of its mechanism)."""
    return sorted(str(p.relative_to(ROOT)) for folder in chapter_folders()
                  for p in (ROOT / folder).rglob("*.py")
                  if not NOT_CORE.search(p.name) and "figures" not in p.relative_to(ROOT).parts)


def violations() -> list[str]:
    """One line per import that breaks the rule, in a core or a kernel file."""
    out = []
    for path in core_files() + list(KERNEL):
        own, kernel = module_name(path).split(".")[0], path in KERNEL
        allowed = {"common"} if kernel else {own, "common", *COMPOSES.get(own, ())}
        for imp in imports(path):
            top = imp.module.split(".")[0]
            where = f"{path}:{imp.line} imports {imp.module}"
            if top == "torch" or top in sys.stdlib_module_names:
                continue
            if top in OPTIONAL and not kernel:
                if not imp.lazy:
                    out.append(f"{where} at the top: import it inside the function that needs it")
                continue
            if top not in PACKAGES:
                out.append(f"{where}: {'kernel' if kernel else 'core'} files use torch and the stdlib only")
                continue
            if top not in allowed:
                out.append(f"{where}: " + ("kernel files import only the kernel" if kernel else
                                           "not its chapter, the kernel or a chapter it composes"))
            files = resolve(imp)
            if top == "common" and not (files and set(files) <= set(KERNEL)):
                out.append(f"{where}: not in the torch-only kernel {KERNEL}")
            elif any(f.endswith("__init__.py") for f in files):
                out.append(f"{where}'s __init__.py: import {', '.join(imp.names)} from its module")
    return out


# --- the READMEs ----------------------------------------------------------------------------------

def line_count(path: str) -> int:
    return len((ROOT / path).read_text(encoding="utf-8").splitlines())


def copy_path(path: str) -> str:
    """Where a file goes in a copy: its package's name for its folder."""
    folder, _, rest = path.partition("/")
    return f"{FOLDERS[folder]}/{rest}"


def fill(text: str) -> str:
    return textwrap.fill(text, 100, break_long_words=False, break_on_hyphens=False)


def readme_section(readme: str) -> str:
    """The "## Copy it" section of `readme`: each of its pieces' import, files and lines (how to
    copy, and the test that trains a copy alone: CONTRIBUTING.md's "Copy a piece")."""
    here = (ROOT / readme).parent
    out = ["## Copy it", "", "<!-- generated: python -m common.copy_sets --write; "
           "tests/test_copy_sets.py checks it -->"]
    for name, piece in COPY_SETS.items():
        if piece.readme != readme:
            continue
        total = sum(line_count(f) for f in piece.files)
        link = lambda f: f"[{Path(f).name}]({os.path.relpath(ROOT / f, here)})"  # noqa: E731
        folders: dict[str, list[str]] = {}  # by the folder each file goes to in a copy
        for f in piece.files:
            folders.setdefault(str(Path(copy_path(f)).parent), []).append(link(f))
        links = "; ".join(f"`{folder}/` {', '.join(files)}" for folder, files in folders.items())
        optional = optional_files(piece)
        why = ", ".join(OPTIONAL_KERNEL[f] for f in optional if f in OPTIONAL_KERNEL)
        extra = f" For {why}, also {', '.join(f'`{copy_path(f)}`' for f in optional)}." if optional else ""
        out += [fill(f"**{name}** (`{piece.use}`): {len(piece.files)} files, {total} lines: {links}.{extra}")]
    guide = os.path.relpath(ROOT / "CONTRIBUTING.md", here)
    out += [f"How to copy, and the test that trains a copy alone: [CONTRIBUTING.md]({guide}#copy-a-piece)."]
    return "\n".join(out) + "\n"


def current_section(text: str) -> str | None:
    """The "## Copy it" section of a README's text (up to the next "## " heading), or None."""
    match = re.search(r"^## Copy it\n.*?(?=^## |\Z)", text, re.M | re.S)
    return match.group(0) if match else None


def readmes() -> list[str]:
    return sorted({piece.readme for piece in COPY_SETS.values()})


def write_readmes() -> list[str]:
    """Rewrite each README's "Copy it" section (appended when it has none); the changed ones."""
    changed = []
    for readme in readmes():
        path, section = ROOT / readme, readme_section(readme)
        text = path.read_text(encoding="utf-8")
        old = current_section(text)
        if old is None:
            new = text.rstrip("\n") + "\n\n" + section
        else:  # a blank line before the next heading
            new = text.replace(old, section + ("\n" if text.index(old) + len(old) < len(text) else ""))
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(readme)
    return changed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="rewrite the READMEs' Copy it sections")
    args = p.parse_args(argv)
    if args.write:
        print("\n".join(write_readmes()) or "every README is up to date")
        return
    for readme in readmes():
        print(f"--- {readme}\n{readme_section(readme)}")
    print("\n".join(violations()) or "every core file keeps the rule")


if __name__ == "__main__":
    main()
