"""`python tools/translate.py`: IFCL's German file, --data translated line by line with any Hugging
Face seq2seq model, resumable (the code: plumbing/translation.py, which ifcl.py's first run calls).

    python tools/translate.py --data data/wiki1m_for_simcse.txt              # t5-base, the paper's T5
    python tools/translate.py --data data/wiki1m_for_simcse.txt --mt_model Helsinki-NLP/opus-mt-en-de
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python tools/translate.py` from anywhere
import plumbing.interrupts  # noqa: E402  first: a Ctrl-C or SIGTERM while torch loads ends in one line

from plumbing import command_line, translation  # noqa: E402


def main(argv: list[str] | None = None) -> Path:
    """The German file of --data (the flags: `python tools/translate.py --help`)."""
    return translation.main(argv)


if __name__ == "__main__":
    command_line.run_main(main)
