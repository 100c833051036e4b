"""SimCSE's files into data/: wiki1m, the NLI triplets and SentEval's STS data, from the
addresses the official repository downloads from, on first use or by `python tools/download.py`.
No checksum of them could be verified, so each file is proven whole by its content before it is
kept (wiki1m by its line count, the NLI file by its header and cells, the STS data by SentEval's
kept pair counts), written under a temporary name and renamed only once whole. A failed file
leaves nothing behind, not even the folder it made for it: the next try fetches it from the start
(a download does not continue where one stopped), and skips the files already complete."""

from __future__ import annotations

import contextlib
import csv
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path
from typing import Callable

from plumbing.errors import UserError
from plumbing.inputs import count_lines, is_sts_dir
from plumbing.progress import progress

DATA_DIR = Path("data")
UPSTREAM = "https://huggingface.co/datasets/princeton-nlp/datasets-for-simcse/resolve/main"
WIKI1M, NLI, SENTEVAL = "wiki1m_for_simcse.txt", "nli_for_simcse.csv", "senteval.tar"
WIKI1M_LINES = 1_000_000  # SimCSE's wiki1m: the papers' "10^6 sentences"
# What a refused download says after what was wrong with it: what is true of the next try, and
# what else to check (the same download may be served the same bad file again)
NOT_KEPT = ("It was not kept: the next try fetches it again from the start. If the same happens again, "
            "fetch from a mirror with `python tools/download.py --base_url URL`.")


def fetch(url: str, dest: Path, room: Path | None = None) -> None:
    """Stream `url` into `dest` with a progress bar; a failure names the address and what to check
    (the free space of `room`, by default dest's folder). A connection closed early is a failure
    too (urllib returns the bytes it got as if complete)."""
    def failed(why: str) -> UserError:
        return UserError(f"could not download {url}: {why}. Check the network (a proxy or a firewall "
                         f"may block the address) and the free disk space in {room or dest.parent}, or "
                         f"fetch from a mirror with `python tools/download.py --base_url URL`. Nothing of "
                         f"it was kept: the next try fetches it from the start, and skips the files "
                         f"already complete.")
    try:
        with urllib.request.urlopen(url, timeout=60) as r, open(dest, "wb") as f:
            size = int(r.headers.get("Content-Length") or 0) or None
            got = 0
            with progress(total=size, desc=dest.name.split(".part")[0], unit="B") as bar:
                while chunk := r.read(1 << 20):
                    got += f.write(chunk)
                    bar.update(len(chunk))
    except OSError as e:
        raise failed(str(e))
    if size is not None and got != size:
        raise failed(f"the connection closed after {got} of its {size} bytes")


def check_download(path: Path, name: str, wiki1m_lines: int | None = None) -> None:
    """No checksum of SimCSE's files could be verified, so each is proven whole by its content:
    wiki1m by its 1,000,000 lines; the NLI file by its header and three cells a row."""
    if name == WIKI1M:
        lines = count_lines(path)
        expected = wiki1m_lines or WIKI1M_LINES
        if lines != expected:
            raise UserError(f"{name}: {lines} lines where {expected} were expected: the download "
                            f"is incomplete or corrupted. {NOT_KEPT}")
        return
    try:
        with open(path, encoding="utf-8", errors="strict", newline="") as f:
            rows = csv.reader(f)
            header = next(rows, [])
            if ",".join(header) != "sent0,sent1,hard_neg":
                raise UserError(f"{name}: header {','.join(header)!r}, expected 'sent0,sent1,hard_neg': "
                                f"the download is corrupted. {NOT_KEPT}")
            for i, row in enumerate(rows, start=2):
                if len(row) != 3:
                    raise UserError(f"{name}: row {i} has {len(row)} cells, expected 3: the download "
                                    f"is incomplete. {NOT_KEPT}")
    except UnicodeDecodeError as e:
        raise UserError(f"{name}: not UTF-8 ({e.reason}): the download is corrupted. {NOT_KEPT}")


def download_file(dest: Path, name: str, base_url: str = UPSTREAM, wiki1m_lines: int | None = None) -> Path:
    """wiki1m or the NLI triplets into `dest`, unless already there: written under a temporary
    name, renamed only after its content check passes, removed if the download or the check fails."""
    final = dest / name
    part = dest / f"{name}.part"
    if final.exists():
        print(f"{final}: present, not fetched again", file=sys.stderr)
        return final
    with folder_for(dest):
        try:
            fetch(f"{base_url.rstrip('/')}/{name}", part)
            check_download(part, name, wiki1m_lines)
        except BaseException:           # a cut connection, a full disk, a bad file, Ctrl-C
            part.unlink(missing_ok=True)
            raise
        os.replace(part, final)
    return final


@contextlib.contextmanager
def folder_for(dest: Path):
    """`dest` made (with its parents) for a download; if the download fails, the folders it made
    are removed again while empty: a failed first download leaves no empty data/ behind."""
    made = [p for p in [dest, *dest.parents] if not p.exists()]
    dest.mkdir(parents=True, exist_ok=True)
    try:
        yield dest
    except BaseException:
        for p in made:                  # the deepest first; one that holds anything stays
            with contextlib.suppress(OSError):
                p.rmdir()
        raise


def download_sts(dest: Path, check_sts: Callable[[Path], None], base_url: str = UPSTREAM) -> Path:
    """SentEval's STS data into dest/sts, unless already there: unpacked and checked (`check_sts`:
    every task parses to SentEval's kept pair counts) in a temporary folder, moved into place only
    once whole."""
    final = dest / "sts"
    if is_sts_dir(final):
        print(f"{final}: present, not fetched again", file=sys.stderr)
        return final
    with folder_for(dest), tempfile.TemporaryDirectory(dir=dest, prefix=".sts-") as tmp:
        tmp = Path(tmp)
        fetch(f"{base_url.rstrip('/')}/{SENTEVAL}", tmp / SENTEVAL, room=dest)  # tmp goes on failure
        try:
            with tarfile.open(tmp / SENTEVAL) as tf:
                tf.extractall(tmp / "x", filter="data")
        except (tarfile.TarError, EOFError) as e:
            raise UserError(f"{SENTEVAL}: not a readable tar archive ({e}): the download is corrupted. "
                            f"{NOT_KEPT}")
        # the archive holds SentEval's downstream/ folder: find STS/ beside SICK/
        roots = [p.parent for p in (tmp / "x").rglob("STS12-en-test")]
        if not roots or not (roots[0].parent / "SICK").is_dir():
            raise UserError(f"{SENTEVAL}: no STS/ and SICK/ folders inside: the download is "
                            f"corrupted or not SentEval's archive. {NOT_KEPT}")
        stage = tmp / "sts"
        stage.mkdir()
        shutil.move(str(roots[0]), stage / "STS")
        shutil.move(str(roots[0].parent / "SICK"), stage / "SICK")
        check_sts(stage)
        if final.exists():
            shutil.rmtree(final)
        os.replace(stage, final)
    return final


def download(dest: str | Path, check_sts: Callable[[Path], None], base_url: str = UPSTREAM,
             what: list[str] | None = None, wiki1m_lines: int | None = None) -> dict[str, Path]:
    """Fetch wiki1m, the NLI triplets and the STS data under `dest`, skipping what is there;
    `check_sts` proves the STS data whole (common.check_sts)."""
    names = {"wiki1m": WIKI1M, "nli": NLI}
    what = what or ["wiki1m", "nli", "sts"]
    for item in what:
        if item not in (*names, "sts"):
            raise UserError(f"--what {item}: unknown; choose from wiki1m, nli, sts.")
    return {item: download_sts(Path(dest), check_sts, base_url) if item == "sts"
            else download_file(Path(dest), names[item], base_url, wiki1m_lines) for item in what}


def fetched_on_first_use(data: str | Path) -> bool:
    """Whether --data is a file the flags' defaults name that is not there yet: on_first_use
    fetches it, so it is not yet the user's to give."""
    return not Path(data).exists() and Path(data) in (DATA_DIR / WIKI1M, DATA_DIR / NLI)


def on_first_use(data: str | Path, sts_dir: str | Path, check_sts: Callable[[Path], None]) -> None:
    """The files the flags' defaults name (data/wiki1m_for_simcse.txt, data/nli_for_simcse.csv,
    data/sts), fetched when missing: `python simcse.py` on a fresh clone needs nothing else.
    Other paths are the user's own files, checked by common.start."""
    if not Path(sts_dir).exists() and Path(sts_dir) == DATA_DIR / "sts":
        download_sts(DATA_DIR, check_sts)
    if fetched_on_first_use(data):
        download_file(DATA_DIR, Path(data).name)
