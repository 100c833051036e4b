"""`python tools/eval.py`: any Hugging Face encoder on the 7 STS tasks, as SimCSE's fork of SentEval
scores them (the protocol, point for point: docs/evaluation.md).

    python tools/eval.py --model sentence-transformers/all-MiniLM-L6-v2 --pooler avg
    python tools/eval.py --model runs/simcse/default/best --split dev     # STS-B dev and SICK-R trial

--model is a hub name or a folder (a run's best/ is one); --pooler says how a sentence vector is
read off it. The STS data are SentEval's, in --sts_dir (`python tools/download.py --what sts`
puts them in data/sts). The table goes to the screen, the full result (each STS12-16 subset too)
to --output as JSON. From Python: common.evaluate_sts(encode, data_dir, tasks=None, split="test"),
with encode(list[str]) -> np.ndarray (n, d).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python tools/eval.py` from anywhere
import plumbing.interrupts  # noqa: E402  first: a Ctrl-C or SIGTERM while torch loads ends in one line

import json  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import common  # noqa: E402
from common import POOLERS, STS_TASKS, UserError, arg  # noqa: E402
from plumbing.atomic_writes import write_text_atomic  # noqa: E402
from plumbing.inputs import check_sts_dir  # noqa: E402
from plumbing.report import format_sts_table  # noqa: E402


@dataclass
class EvalArgs:
    model: str = arg("bert-base-uncased", "hub name or local folder of any Hugging Face encoder")
    pooler: str = arg("cls_before_pooler", "how a sentence vector is read off the encoder",
                      "SimCSE official code", choices=POOLERS)
    sts_dir: str = arg(common.in_data("sts"), "folder with STS/ and SICK/ in SentEval's layout")
    split: str = arg("test", "test = the 7 tasks; dev = STS-B dev and SICK-R trial", choices=["test", "dev"])
    tasks: list[str] = arg([], "a subset of the split's tasks (default: all of them)", choices=STS_TASKS)
    batch_size: int = arg(128, "sentences per forward pass", ge=1)
    output: str = arg("", "also write the full result as JSON here")


def main(argv: list[str] | None = None) -> dict:
    """Evaluate --model on --split, print the table, keep the result in --output if given."""
    args = common.parse_args(EvalArgs, argv, description=__doc__, prog="python tools/eval.py")
    dev_tasks = ["STSBenchmark", "SICKRelatedness"]
    if args.split == "dev" and set(args.tasks) - set(dev_tasks):
        raise UserError(f"--tasks {' '.join(args.tasks)} with --split dev: only {' and '.join(dev_tasks)} "
                        f"have a dev split. Pass --tasks among those, or --split test.")
    check_sts_dir(args.sts_dir)                  # before the encoder loads
    t = time.perf_counter()
    name = f"{Path(args.model).name or args.model} [{args.pooler}]"
    res = common.evaluate_encoder(args.model, args.pooler, args.sts_dir, args.tasks or None, args.split,
                                  args.batch_size, desc=name)       # a bar on stderr, task by task
    print(format_sts_table(res, name=name))
    print(f"({args.model}, {args.split} split, {time.perf_counter() - t:.1f} s)", file=sys.stderr)
    if args.output:
        write_text_atomic(args.output, json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    common.run_main(main)
