"""What a command shows while it works: a progress bar over every long loop, on stderr, and a
stderr that a closed terminal or a full disk cannot turn into a failed run."""

from __future__ import annotations

import contextlib
import sys

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
