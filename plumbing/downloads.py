"""SimCSE's data into data/, on a run's first use (missing_pieces) or by `python tools/download.py`.

The rules, and the function that keeps each:
1. A file is kept only once proven whole by its content (check_download): the upstream publishes no
   checksum, and a download cut short parses as a smaller dataset, whose figures would look like a
   failed reproduction.
2. A failure leaves nothing (staging): each file is fetched into a temporary folder beside its place and
   moved in only once checked; the next try starts clean.
3. Offline, all that is missing is said at once (missing_pieces): the data, the STS files and every
   model a run needs, in one line, within seconds, not one piece per try.
"""

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

from plumbing import inputs
from plumbing.errors import UserError
from plumbing.progress import progress

# The repository's data/, from any working folder: relative inside the clone (as the docs read), else absolute
DATA_DIR = Path(__file__).resolve().parents[1] / "data"
with contextlib.suppress(OSError):              # the working folder was deleted: absolute
    if Path.cwd().resolve().is_relative_to(DATA_DIR.parent):
        DATA_DIR = Path(os.path.relpath(DATA_DIR))
UPSTREAM = "https://huggingface.co/datasets/princeton-nlp/datasets-for-simcse/resolve/main"
WIKI1M, NLI, SENTEVAL = "wiki1m_for_simcse.txt", "nli_for_simcse.csv", "senteval.tar"
WIKI1M_LINES = 1_000_000  # SimCSE's wiki1m: the papers' "10^6 sentences"
# What a refused download ends with: the next try, and a way out (the same bad file may come again)
NOT_KEPT = ("It was not kept: the next try fetches it again from the start. If the same happens again, "
            "fetch from a mirror with `python tools/download.py --base_url URL`.")


def fetch(url: str, dest: Path, room: Path | None = None) -> None:
    """Stream `url` into `dest` with a progress bar; a failure says what to check (free space in `room`)."""
    try:
        with urllib.request.urlopen(url, timeout=60) as r, open(dest, "wb") as f:
            size = int(r.headers.get("Content-Length") or 0) or None
            with progress(total=size, desc=dest.name, unit="B") as bar:
                while chunk := r.read(1 << 20):
                    bar.update(f.write(chunk))
            if size is not None and f.tell() != size:     # urllib returns a cut connection's bytes as all
                raise OSError(f"the connection closed after {f.tell()} of its {size} bytes")
    except OSError as e:
        raise UserError(f"could not download {url}: {e}. Check the network (a proxy or a firewall may block "
                        f"the address) and the free disk space in {room or dest.parent}, or fetch from a "
                        f"mirror with `python tools/download.py --base_url URL`. Nothing of it was kept: the "
                        f"next try fetches it from the start, and skips the files already complete.")


def check_download(path: Path, check_sts: Callable[[Path], None], wiki1m_lines: int = WIKI1M_LINES) -> None:
    """Rule 1: wiki1m by its 1,000,000 lines; the NLI file by its header and three cells a row; SentEval's
    archive by its STS/ and SICK/, moved beside it into sts/ and checked by `check_sts`."""
    name = path.name
    if name == WIKI1M:
        if (lines := inputs.count_lines(path)) != wiki1m_lines:
            raise UserError(f"{name}: {lines} lines where {wiki1m_lines} were expected: the download "
                            f"is incomplete or corrupted. {NOT_KEPT}")
        return
    if name == SENTEVAL:
        tmp = path.parent
        try:
            with tarfile.open(path) as tf:
                tf.extractall(tmp / "x", filter="data")
        except (tarfile.TarError, EOFError) as e:
            raise UserError(f"{name}: not a readable tar archive ({e}): the download is corrupted. "
                            f"{NOT_KEPT}")
        # the archive holds SentEval's downstream/ folder: find STS/ beside SICK/
        roots = [p.parent for p in (tmp / "x").rglob("STS12-en-test")]
        if not roots or not (roots[0].parent / "SICK").is_dir():
            raise UserError(f"{name}: no STS/ and SICK/ folders inside: the download is corrupted or not "
                            f"SentEval's archive. {NOT_KEPT}")
        (tmp / "sts").mkdir()
        shutil.move(str(roots[0]), tmp / "sts" / "STS")
        shutil.move(str(roots[0].parent / "SICK"), tmp / "sts" / "SICK")
        check_sts(tmp / "sts")
        return
    try:
        with open(path, encoding="utf-8", newline="") as f:
            rows = csv.reader(f)
            if (header := ",".join(next(rows, []))) != "sent0,sent1,hard_neg":
                raise UserError(f"{name}: header {header!r}, expected 'sent0,sent1,hard_neg': the download "
                                f"is corrupted. {NOT_KEPT}")
            if short := next(((i, len(row)) for i, row in enumerate(rows, start=2) if len(row) != 3), None):
                raise UserError(f"{name}: row {short[0]} has {short[1]} cells, expected 3: the download is "
                                f"incomplete. {NOT_KEPT}")
    except UnicodeDecodeError as e:
        raise UserError(f"{name}: not UTF-8 ({e.reason}): the download is corrupted. {NOT_KEPT}")


@contextlib.contextmanager
def staging(dest: Path, name: str):
    """A temporary folder in `dest` where `name` is fetched and checked, gone whatever happens (a cut
    connection, a full disk, a bad file, Ctrl-C); `dest` itself stays, empty or not."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=f".{name}-") as tmp:
        yield Path(tmp)


def download(dest: str | Path, check_sts: Callable[[Path], None], base_url: str = UPSTREAM,
             what: list[str] | None = None, wiki1m_lines: int = WIKI1M_LINES) -> dict[str, Path]:
    """--what of wiki1m, the NLI triplets and the STS data into `dest`, skipping what is there, each
    proven whole (check_download) before it is moved into place."""
    dest, got = Path(dest), {}
    for item in what or ["wiki1m", "nli", "sts"]:
        got[item] = final = dest / {"wiki1m": WIKI1M, "nli": NLI, "sts": "sts"}[item]
        if ((final / "STS").is_dir() and (final / "SICK").is_dir()) if item == "sts" else final.exists():
            print(f"{final}: present, not fetched again", file=sys.stderr)
            continue
        with staging(dest, final.name) as tmp:
            name = SENTEVAL if item == "sts" else final.name
            fetch(f"{base_url.rstrip('/')}/{name}", tmp / name, room=dest)
            check_download(tmp / name, check_sts, wiki1m_lines)
            shutil.rmtree(final, ignore_errors=True)     # an STS folder that is not whole
            os.replace(tmp / final.name, final)
    return got


def in_data(name: str) -> str:
    """A flag's default that names data/<name>: the repository's data/ from any working folder."""
    return str(DATA_DIR / name)


def fetched_on_first_use(data: str | Path) -> bool:
    """Whether --data is a file the defaults name, not there yet: missing_pieces fetches it."""
    return not Path(data).exists() and Path(data) in (DATA_DIR / WIKI1M, DATA_DIR / NLI)


def missing_pieces(data: str | Path, sts_dir: str | Path, check_sts: Callable[[Path], None],
                   models: dict[str, tuple[str, str]]) -> None:
    """Rule 3: the files the defaults name, fetched if missing; what cannot be had of them and of `models`
    ({flag: (name, one more way out)}) in ONE UserError. A --data of the user's that is not there is a
    typo, named alone by the checks that follow."""
    defaults = {DATA_DIR / "sts": "sts", DATA_DIR / WIKI1M: "wiki1m", DATA_DIR / NLI: "nli"}
    if not Path(data).exists() and Path(data) not in defaults:
        return
    pieces = [inputs.model_missing(name, flag, instead) for flag, (name, instead) in models.items()]
    for flag, path in (("--sts_dir", Path(sts_dir)), ("--data", Path(data))):
        if path.exists() or path not in defaults:
            continue
        try:
            if (why := inputs.hub_offline()) is None:
                download(DATA_DIR, check_sts, UPSTREAM, [defaults[path]])
                continue
        except UserError as e:
            why = f"its download failed ({e})"
        by_hand = "SentEval's STS/ and SICK/ folders" if path.name == "sts" else "the file"
        pieces.append(f"{flag} {path}: not there, and {why}. Run `python tools/download.py --what "
                      f"{defaults[path]}` where the network reaches huggingface.co, or put {by_hand} there.")
    if pieces := [p for p in pieces if p]:
        raise UserError(pieces[0] if len(pieces) == 1 else f"{len(pieces)} things this run needs cannot be "
                        f"had here: " + " ".join(f"({i}) {p}" for i, p in enumerate(pieces, 1)))
