"""What a command shows while it works: a progress bar over every long loop (progress), on
stderr, and a stderr that a closed terminal or a full disk cannot turn into a failed run (Screen); the
training log's running means (Meter), which cost the step no wait for the GPU."""

from __future__ import annotations

import contextlib
import sys
import time

import torch
from tqdm.auto import tqdm  # comes with transformers


def progress(total: int | None, desc: str, unit: str = "it", **options):
    """The bar of every long loop (tokenising, downloading, training, translating, evaluating) on stderr:
    the screen's, never the results' (stdout); bytes (unit "B") read as kB, MB, GB; `options`: tqdm's
    (disable, initial, leave, delay). Used as a `with` block, so that a stop closes it (the innermost
    first) before the line that says what next."""
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", dynamic_ncols=True,
                mininterval=1.0, file=sys.stderr, **options)


class Screen:
    """stderr while run_main runs a command: a write that fails (a closed terminal: EIO; a file over
    `ulimit -f`: EFBIG) is dropped, not raised: the screen stops no run and changes no exit status."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        with contextlib.suppress(OSError):
            return self.stream.write(text)
        return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError):
            self.stream.flush()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


class Meter:
    """The log's running sums, kept on the device (read once a log line: the only wait): loss and
    terms since the last log line, and whether any loss was NaN or infinite."""

    def __init__(self, device: torch.device):
        self.zero = torch.zeros((), device=device)
        self.bad = self.zero.bool()
        self.loss = self.zero
        self.steps = 0
        self.stats = {}
        self.t0 = time.perf_counter()

    def add(self, loss: torch.Tensor, stats: dict[str, torch.Tensor]) -> None:
        self.bad |= ~torch.isfinite(loss)
        self.loss = self.loss + loss
        self.steps += 1
        self.stats = {k: self.stats.get(k, 0) + v for k, v in stats.items()}

    def finite(self) -> bool:
        return not bool(self.bad)

    def record(self, step: int, lr: float, epoch: int, batch_size: int) -> dict:
        """The training record of metrics.jsonl: means since the last one; then starts again."""
        seconds = time.perf_counter() - self.t0
        record = {"step": step, "loss": float(self.loss) / self.steps, "lr": lr, "epoch": epoch,
                  "sent_per_s": batch_size * self.steps / seconds if seconds > 0 else 0.0,
                  **{k: float(v) / self.steps for k, v in self.stats.items()}}
        self.loss, self.steps, self.stats, self.t0 = self.zero, 0, {}, time.perf_counter()
        return record
