"""SentEval's STS files, as its readers parse them (load_sts_pairs), and checked whole before a run writes.

common.evaluate_sts computes the figures; this module reads the pairs and their gold scores. The rules,
and the function that keeps each:
1. The pairs are SentEval's, to the pair: a pair whose gold line is empty is dropped, as SentEval drops
   it, and each sentence is split on whitespace and joined again, as SentEval does (load_sts_pairs).
   A figure from other pairs is not comparable with a paper's, however close it reads.
2. A download cut short is named before it is kept (check_sts, with SentEval's kept pair counts,
   STS_PAIR_COUNTS): a task with a missing subset still parses, and scores differently.
3. Every file a run reads, read before the run writes anything (check_sts_files): a damaged test file
   found after hours of training would lose the run's final table.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from plumbing.downloads import NOT_KEPT
from plumbing.errors import UserError

STS_TASKS = ["STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness"]
STS_SUBSETS = {
    "STS12": ["MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN", "surprise.SMTnews"],
    "STS13": ["FNWN", "headlines", "OnWN"],
    "STS14": ["deft-forum", "deft-news", "headlines", "images", "OnWN", "tweet-news"],
    "STS15": ["answers-forums", "answers-students", "belief", "headlines", "images"],
    "STS16": ["answer-answer", "headlines", "plagiarism", "postediting", "question-question"],
}
TASK_SHORT = {"STS12": "STS12", "STS13": "STS13", "STS14": "STS14", "STS15": "STS15",
              "STS16": "STS16", "STSBenchmark": "STS-B", "SICKRelatedness": "SICK-R"}
STS_PAIR_COUNTS = {  # kept pairs a subset (STS12-16) or a split (train, dev, test), asserted by check_sts
    "STS12": [750, 750, 459, 750, 399], "STS13": [189, 750, 561], "STS14": [450, 300, 750, 750, 750, 750],
    "STS15": [375, 750, 375, 750, 750], "STS16": [254, 249, 230, 244, 209],
    "STSBenchmark": [5749, 1500, 1379], "SICKRelatedness": [4500, 500, 4927]}


def _norm(s: str) -> str:
    # SentEval splits on whitespace and joins again: the files are already tokenised, and a sentence is
    # neither lowercased nor cut to the training max_len
    return " ".join(s.split())


def load_sts_pairs(data_dir: str | Path, task: str, split: str = "test") -> dict[str, tuple]:
    """{subset: (sent1 list, sent2 list, gold array)} of one task, as SentEval's readers parse it."""
    d = Path(data_dir)
    if task in STS_SUBSETS:
        out = {}
        for sub in STS_SUBSETS[task]:
            inp, gs = (d / "STS" / f"STS{task[3:]}-en-test" / f"STS.{k}.{sub}.txt" for k in ("input", "gs"))
            pairs = [line.split("\t") for line in inp.read_text(encoding="utf-8").splitlines()]
            gold = gs.read_text(encoding="utf-8").splitlines()
            if len(pairs) != len(gold) or any(len(p) != 2 for p in pairs):
                raise UserError(f"{inp}: expected one tab-separated pair per gold line of {gs}")
            # a pair whose gold line is empty is dropped (STS13-16 leave some pairs unscored)
            keep = [i for i, g in enumerate(gold) if g != ""]
            out[sub] = ([_norm(pairs[i][0]) for i in keep], [_norm(pairs[i][1]) for i in keep],
                        np.array([float(gold[i]) for i in keep]))
        return out
    if task == "STSBenchmark":   # no header; gold in column 4, the sentences in columns 5 and 6
        path, skip, cols = d / "STS" / "STSBenchmark" / f"sts-{split}.csv", 0, (5, 6, 4)
    elif task == "SICKRelatedness":   # a header; the sentences in columns 1 and 2, gold in column 3
        name = {"train": "SICK_train.txt", "dev": "SICK_trial.txt", "test": "SICK_test_annotated.txt"}[split]
        path, skip, cols = d / "SICK" / name, 1, (1, 2, 3)
    else:
        raise ValueError(f"unknown STS task {task!r}; one of {STS_TASKS}")
    rows = [line.strip().split("\t") for line in path.read_text(encoding="utf-8").splitlines()[skip:]]
    a, b, g = cols
    return {split: ([_norm(r[a]) for r in rows], [_norm(r[b]) for r in rows],
                    np.array([float(r[g]) for r in rows]))}


def check_sts(folder: Path) -> None:
    """Rule 2: the STS data are whole when every task parses to SentEval's kept pair counts (the check a
    download of them passes before it is kept: plumbing/downloads.py)."""
    for task in STS_TASKS:
        splits = ["test"] if task in STS_SUBSETS else ["train", "dev", "test"]
        try:
            got = [len(g) for split in splits for _, _, g in load_sts_pairs(folder, task, split).values()]
        except (OSError, ValueError, IndexError, UserError) as e:
            raise UserError(f"STS data in {folder}: {task} cannot be read ({e}): the download is "
                            f"incomplete or corrupted. {NOT_KEPT}")
        if got != STS_PAIR_COUNTS[task]:
            raise UserError(f"STS data in {folder}: {task} has {got} pairs, expected "
                            f"{STS_PAIR_COUNTS[task]}: the download is incomplete or corrupted. {NOT_KEPT}")


def check_sts_files(sts_dir: str | Path) -> None:
    """Rule 3: every STS file a run reads (the dev sets at each evaluation, the 7 test sets at the end),
    read now: a missing or damaged one is named before anything is written."""
    dev = [("STSBenchmark", "dev"), ("SICKRelatedness", "dev")]
    for task, split in [(t, "test") for t in STS_TASKS] + dev:
        try:
            load_sts_pairs(sts_dir, task, split)
        except (OSError, ValueError, IndexError) as e:      # UnicodeDecodeError is a ValueError
            raise UserError(f"--sts_dir {sts_dir}: {task} ({split}) cannot be read ({e}). Pass the folder "
                            f"of SentEval's STS data (`python tools/download.py --what sts` makes data/sts).")
