"""The run report: one JSON object that rank 0 prints as its last line (and `--report` writes),
after a short human-readable table of the same numbers. The printed line leaves out the per-step
arrays (`losses`, `reference_losses`: a list per step, 2-5 KB over a long run) and names them in
`per_step`; the file `--report PATH` writes holds them too."""

from __future__ import annotations

import json
from pathlib import Path

REPORT_KEYS = (
    "chapter", "strategy", "world_size", "mesh", "backend", "device", "dtype", "mixed_precision",
    "steps", "losses", "reference_losses", "max_loss_diff", "max_grad_diff", "max_param_diff",
    "tolerance", "teacher_forced", "free_running", "check_passed", "tokens_per_s", "comm",
    "comm_bytes_per_rank", "comm_bytes_formula", "comm_convention", "comm_observed_lo_bytes",
    "comm_observed_lo_noise_bytes", "comm_written_bytes", "memory", "memory_formula",
)
P2P_OPS = ("send", "isend", "recv", "irecv")


def comm_convention(comm: dict) -> str:
    """How the meter's figure was obtained: collectives are *accounted* by nccl-tests' convention
    (2(n-1)/n·S for an all-reduce, (n-1)/n·S for a reduce-scatter, whatever the algorithm: what
    NCCL's ring sends); point-to-point sends are counted as *sent*. Neither is observed on the
    wire: common/wire.py observes what gloo writes, which differs per collective (gloo has no
    reduce-scatter and runs a full all-reduce: CONTRIBUTING.md, "What gloo really sends")."""
    p2p = [op for op in comm if op in P2P_OPS]
    if p2p and len(p2p) == len(comm):
        return "sent (P2P)"
    return "accounted + sent (P2P)" if p2p else "accounted (nccl-tests)"


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def _ratio(measured: float | None, formula: float | None) -> str:
    if measured is None or not formula:
        return "-"
    return f"{measured / formula:.4f}"


W = 40  # the label column
COMM_LABELS = {"accounted (nccl-tests)": "accounted (nccl-tests convention)"}
OBSERVED_ROWS = (("comm_written_bytes", "comm written by gloo (wchar)"),
                 ("comm_observed_lo_bytes", "comm on loopback (gloo + TCP/IP)"))


def summary_table(report: dict, observed: bool = False) -> str:
    """The run's table: the accounted bytes and memory against their formulas; `observed` adds
    what gloo wrote and what crossed the loopback (CONTRIBUTING.md#what-gloo-really-sends)."""
    mesh = " × ".join(f"{k}={v}" for k, v in report["mesh"].items())
    losses = report["losses"]
    convention = report.get("comm_convention", "accounted (nccl-tests)")
    precision = report["dtype"] + (" + bf16 mixed" if report.get("mixed_precision") == "bf16" else "")
    lines = [
        f"chapter {report['chapter']} · {report['strategy']} · {mesh} · {report['backend']} on "
        f"{report['device']} · {precision} · {report['steps']} steps",
        f"loss {losses[0]:.4f} → {losses[-1]:.4f} · {report['tokens_per_s']:.0f} tokens/s",
        f"{'per rank':<{W}}{'measured':>14}{'formula':>14}{'ratio':>9}",
        f"{'comm ' + COMM_LABELS.get(convention, convention):<{W}}"
        f"{human_bytes(report['comm_bytes_per_rank']):>14}{human_bytes(report['comm_bytes_formula']):>14}"
        f"{_ratio(report['comm_bytes_per_rank'], report['comm_bytes_formula']):>9}",
    ]
    for key, label in OBSERVED_ROWS:
        if observed and report.get(key) is not None:
            lines.append(f"{label:<{W}}{human_bytes(report[key]):>14}"
                         f"{human_bytes(report['comm_bytes_formula']):>14}"
                         f"{_ratio(report[key], report['comm_bytes_formula']):>9}")
    for key in [k for k in report if k.startswith("comm_bytes_") and f"{k}_formula" in report]:
        label = f"  of it over the {key.removeprefix('comm_bytes_')} group"
        lines.append(f"{label:<{W}}{human_bytes(report[key]):>14}{human_bytes(report[key + '_formula']):>14}"
                     f"{_ratio(report[key], report[key + '_formula']):>9}")
    for key, value in report["memory"].items():
        formula = report["memory_formula"].get(key)
        lines.append(f"{'memory ' + key:<{W}}{human_bytes(value):>14}{human_bytes(formula):>14}"
                     f"{_ratio(value, formula):>9}")
    if report.get("cp_comm_bytes_formula") is not None:  # context parallelism: the ring's P2P
        sent = report.get("cp_comm_bytes", report["comm"].get("isend", {}).get("bytes", 0.0))
        lines.append(f"{'comm CP ring K/V, dK/dV (sent, P2P)':<{W}}{human_bytes(sent):>14}"
                     f"{human_bytes(report['cp_comm_bytes_formula']):>14}"
                     f"{_ratio(sent, report['cp_comm_bytes_formula']):>9}")
    if report.get("ep_all_to_all_bytes_formula") is not None:  # expert parallelism's dispatch
        sent = report["comm"].get("all_to_all_single", {}).get("bytes", 0.0)
        lines.append(f"{'comm EP all-to-all (rows + counts)':<{W}}{human_bytes(sent):>14}"
                     f"{human_bytes(report['ep_all_to_all_bytes_formula']):>14}"
                     f"{_ratio(sent, report['ep_all_to_all_bytes_formula']):>9}")
        lines.append(f"{'EP rows max/mean (worst layer, step)':<{W}}"
                     f"{report['ep_load_imbalance_max']:>14.4f}{'1 (ideal)':>14}")
    if report.get("cp_load_balance") is not None:
        lines.append(f"{'CP attention work max/min over ranks':<{W}}{report['cp_load_balance']:>14.4f}"
                     f"{'1 (ideal)':>14}")
    if observed and report.get("comm_written_bytes") is not None and any(op.startswith("reduce_scatter")
                                                            for op in report.get("comm", {})):
        lines.append("  written: gloo runs each reduce-scatter as a full all-reduce, 2× its accounted "
                     "bytes (CONTRIBUTING.md#what-gloo-really-sends)")
    if observed and report.get("comm_observed_lo_bytes") is not None:
        noise = report.get("comm_observed_lo_noise_bytes")
        lines.append(f"  loopback: the machine's bytes ÷ local ranks, incl. TCP/IP headers, gloo "
                     f"framing, barriers and other processes (background before training × time: "
                     f"{human_bytes(noise)})")
    if report.get("reference_losses") is not None:
        verdict = "PASS" if report["check_passed"] else "FAIL"
        lines.append(
            f"check vs single device: {verdict} (tolerance {report['tolerance']:.0e}) · max rel diff "
            f"loss {report['max_loss_diff']:.2e} · grad {report['max_grad_diff']:.2e} · "
            f"param {report['max_param_diff']:.2e} (each step from the same parameters)"
        )
        if free := report.get("free_running"):
            lines.append(
                f"  free-running float64 reference, {report['steps']} steps: loss "
                f"{free['max_loss_diff']:.2e} · grad {free['max_grad_diff']:.2e} · "
                f"param {free['max_param_diff']:.2e}"
            )
    return "\n".join(lines)


def per_step_keys(report: dict) -> list[str]:
    """The keys whose values are one number per step (a list as long as `steps`)."""
    steps = report.get("steps")
    return [k for k, v in report.items() if isinstance(v, list) and steps and len(v) == steps
            and all(x is None or isinstance(x, (int, float)) for x in v)]


def printed_line(report: dict) -> dict:
    """The report without its per-step arrays, which `per_step` names (in `--report PATH`'s file)."""
    moved = per_step_keys(report)
    return {k: v for k, v in report.items() if k not in moved} | ({"per_step": moved} if moved else {})


def emit_report(report: dict, path: str | None = None, observed: bool = False) -> None:
    """Print the table (`observed`: with gloo's own byte rows), then the JSON as the very last
    line, without the per-step arrays; write the whole report to `path` if given."""
    missing = [k for k in ("chapter", "strategy", "world_size", "mesh", "losses") if k not in report]
    if missing:
        raise ValueError(f"report lacks {missing}")
    ordered = {k: report[k] for k in REPORT_KEYS if k in report}
    ordered.update({k: v for k, v in report.items() if k not in ordered})
    print(summary_table(ordered, observed), flush=True)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(ordered) + "\n")
    print(json.dumps(printed_line(ordered)), flush=True)
