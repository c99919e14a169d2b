"""Bytes observed on the wire, beside the comm meter's accounted figure (gloo on CPU only).

`CommMeter` (common/comm.py) charges each `dist.*` collective by nccl-tests' convention, a number
derived from the tensor's size, and counts point-to-point sends as sent: nothing there is observed.
On one host gloo moves every byte through the kernel's TCP loopback, where two counters see it:

* `lo` in /proc/net/dev: the bytes the loopback interface carried, for the whole machine. Around a
  window that every local rank enters and leaves together (a barrier on each side), its growth
  divided by the local ranks is the traffic per rank, including TCP/IP headers and ACKs, gloo's
  framing, the closing barrier, and whatever other processes on the machine sent meanwhile. That
  last part is noise, large on a shared machine: `calibrate()` measures the loopback's background
  rate in empty windows before training, and the report states rate × the windows' duration.
* `wchar` in /proc/self/io: the bytes this process passed to write()/writev(); gloo writes its
  sends to the socket with writev, so this is the rank's own sent bytes plus gloo's headers,
  untouched by other processes (read inside the barriers, and no file is written in a window).

Neither counter sees NCCL (GPU traffic never passes through the kernel), nor `lo` a job that spans
machines: those figures are None.

The report labels them "comm written by gloo (wchar)" and "comm on loopback (gloo + TCP/IP)". They
match the accounted bytes for all-reduce, all-gather and sends, not for reduce-scatter (gloo runs a
full all-reduce: 2× the accounted bytes) nor broadcast (a tree: (n-1)/n·S per rank on average);
`common/gloo_bytes.py` measures each collective, CONTRIBUTING.md's "What gloo really sends" explains.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

NET_DEV, SELF_IO = Path("/proc/net/dev"), Path("/proc/self/io")


def loopback_bytes() -> int | None:
    """Bytes transmitted on `lo` since boot (= received: loopback delivers what it sends)."""
    try:
        for line in NET_DEV.read_text().splitlines():
            name, _, fields = line.partition(":")
            if name.strip() == "lo":
                return int(fields.split()[8])
    except OSError:
        return None
    return None


def written_bytes() -> int | None:
    """`wchar` of this process: bytes passed to write(), writev() and friends, all threads."""
    try:
        for line in SELF_IO.read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "wchar":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


class WireMeter:
    """`open()` … `close()` around each metered block of the training loop, outside its timing.
    Every rank makes the same calls (the `lo` windows end in barriers)."""

    def __init__(self, backend: str, device: torch.device, world_size: int, group=None):
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        cpu_gloo = backend == "gloo" and device.type == "cpu"
        self.use_lo = cpu_gloo and local == world_size and loopback_bytes() is not None
        self.use_wchar = cpu_gloo and written_bytes() is not None
        self.ranks, self.group = local, group
        self.lo = self.wchar = self.windows = 0
        self.seconds, self.background_rate = 0.0, None  # lo bytes/s with nothing of ours running
        self._lo_start = self._wchar_start = 0
        self._t0 = 0.0

    def open(self) -> None:
        if self.use_lo:
            dist.barrier(group=self.group)
            self._lo_start, self._t0 = loopback_bytes(), time.perf_counter()
        if self.use_wchar:
            self._wchar_start = written_bytes()

    def close(self) -> None:
        if self.use_wchar:
            self.wchar += written_bytes() - self._wchar_start
        if self.use_lo:
            dist.barrier(group=self.group)
            self.lo += loopback_bytes() - self._lo_start
            self.seconds += time.perf_counter() - self._t0
        self.windows += 1

    def calibrate(self, windows: int = 3, seconds: float = 0.05) -> None:
        """The bytes per second `lo` carries while our ranks only wait (`windows` empty windows of
        `seconds`, the median): the barriers plus every other process's loopback traffic."""
        if not self.use_lo:
            return
        rates = []
        for _ in range(windows):
            dist.barrier(group=self.group)
            start, t0 = loopback_bytes(), time.perf_counter()
            time.sleep(seconds)
            dist.barrier(group=self.group)
            rates.append((loopback_bytes() - start) / (time.perf_counter() - t0))
        self.background_rate = statistics.median(rates)

    def report(self, accounted: float) -> dict:
        """The report's keys: per rank `lo` bytes (all local ranks' ÷ their number), its noise
        (the background rate × the windows' duration, per rank), and this rank's written bytes
        (None where gloo's socket writes were not counted: accounted traffic but no wchar)."""
        written = self.wchar if self.use_wchar and (self.wchar > 0 or not accounted) else None
        return {
            "comm_observed_lo_bytes": self.lo / self.ranks if self.use_lo else None,
            "comm_observed_lo_noise_bytes": (self.background_rate * self.seconds / self.ranks
                                             if self.use_lo and self.background_rate is not None else None),
            "comm_written_bytes": written,
        }
