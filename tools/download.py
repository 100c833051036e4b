"""`python tools/download.py`: SimCSE's training data and SentEval's STS data, into data/, from the
addresses the official SimCSE repository downloads from (the code: plumbing/downloads.py).

    python tools/download.py                 # data/wiki1m_for_simcse.txt, data/nli_for_simcse.csv, data/sts
    python tools/download.py --what sts      # the STS data alone: what every evaluation reads

A training script fetches what its default flags name on first use, so this is for fetching
ahead (or into another --dest). No checksum of these files could be verified, so each is proven
whole by its content before it is kept: wiki1m by its 1,000,000 lines, the NLI file by its
header and three cells a row, the STS data by SentEval's kept pair counts of every task. Each is
written under a temporary name and renamed only once whole; a file that fails leaves nothing
behind, and what is already there is not fetched again. --base_url names a mirror that serves
the same file names.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python tools/download.py` from anywhere
import plumbing.interrupts  # noqa: E402  first: a Ctrl-C or SIGTERM while torch loads ends in one line

from dataclasses import dataclass  # noqa: E402

import common  # noqa: E402
from common import arg  # noqa: E402
from plumbing import downloads  # noqa: E402
from plumbing.sts_data import check_sts  # noqa: E402


@dataclass
class DownloadArgs:
    dest: str = arg(str(downloads.DATA_DIR), "where to put wiki1m_for_simcse.txt, nli_for_simcse.csv and "
                    "sts/ (the repository's data/, from any working folder)")
    base_url: str = arg(downloads.UPSTREAM, "where the files are served (a mirror, or a local server "
                        "in tests)", "official code")
    what: list[str] = arg(["wiki1m", "nli", "sts"], "which of wiki1m, nli, sts to fetch",
                          choices=["wiki1m", "nli", "sts"])


def main(argv: list[str] | None = None) -> dict[str, Path]:
    """Fetch --what into --dest, skipping what is there; print where each one is."""
    args = common.parse_args(DownloadArgs, argv, description=__doc__, prog="python tools/download.py")
    got = downloads.download(args.dest, check_sts, args.base_url, args.what)
    for name, path in got.items():
        print(f"{name}: {path}")
    return got


if __name__ == "__main__":
    common.run_main(main)
