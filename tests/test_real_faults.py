"""Real faults, not raised by hand: what a user reads when the disk, the system or a signal stops a run.

Each test runs a script as a user does (a subprocess on the tiny BERT, --no-compile) into a place
that really fails:
- a small tmpfs, sized from a reference run's files so that the disk fills inside the chosen
  write (simcse.py's last/ and best/; rcl.py's entropy model's best/ and end/, and its final
  model's best/), then made larger (a live remount) so that --resume finishes the run;
- `ulimit -f` (EFBIG) under last/state.pt;
- an ext4 image forced read-only in the middle of a run (its trigger_fs_error, as a disk error
  does it), then checked (e2fsck) and mounted again for --resume;
- a tmpfs with one or two pages free: the run's record (run.json, args.json) at the start;
- SIGINT and SIGTERM while the script still imports torch;
- rcl.py: an entropy folder that cannot be made mid-run (played: no size of disk
  makes that one write fail), a second start while the first still runs.
Each ends in exactly one line with its exit status (4 for a failed write, 130/143 for a signal, 2
for a refusal), no traceback, and the command that line names then finishes the run.
Mounting needs root (CAP_SYS_ADMIN): without it those tests are skipped, saying why.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import rcl
import simcse
from conftest import ENV, ROOT, Held
from conftest import script as _script
from plumbing import atomic_writes, checkpoint, command_line, run_folder

PAGE = os.sysconf("SC_PAGE_SIZE")     # tmpfs counts whole pages
ENOSPC, EROFS, EFBIG, EIO = (os.strerror(e) for e in (errno.ENOSPC, errno.EROFS, errno.EFBIG, errno.EIO))
# checkpoints (last/, and best/ when the best) at steps 2 and 4, a training record every step
FLAGS = ["--batch_size", "8", "--max_steps", "4", "--eval_every", "2", "--log_every", "1", "--lr", "1e-3",
         "--max_len", "16", "--no-compile"]
# rcl: one entropy model and the final model, one checkpoint each (step 2), no early stop
RCL_FLAGS = [*FLAGS, "--max_steps", "2", "--phi", "0.01", "--patience", "0", "--pooler", "cls_before_pooler"]
SMALL = 10   # pages for the small files: run.lock, run.json, args.json, metrics.jsonl, a checksum, ...
# (and the pages of code/, the copies of the script and common.py: sizes["code"])


# ------------------------------------------------------------------------------------
# Helpers: mounts, the scripts as a user runs them, the one line they end with
# ------------------------------------------------------------------------------------

def _need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the test mounts a filesystem (tmpfs, a loop-mounted ext4)")


def _mount(*args: str) -> None:
    r = subprocess.run(["mount", *args], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount here (a container without CAP_SYS_ADMIN?): {r.stderr.strip()}")


def _umount(path: Path) -> None:
    subprocess.run(["umount", str(path)], capture_output=True)
    if os.path.ismount(path):                  # still busy: let the system detach it when it can
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def _tmpfs(path: Path, pages: int):
    """A tmpfs of `pages` pages at `path`, unmounted at the end."""
    _need_root()
    path.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={pages * PAGE}", "tmpfs", str(path))
    try:
        yield path
    finally:
        _umount(path)


def _resize(path: Path, pages: int) -> None:
    """A live tmpfs made larger: the files on it stay, the disk has room again."""
    subprocess.run(["mount", "-o", f"remount,size={pages * PAGE}", str(path)], check=True)


def _pages(folder: Path) -> int:
    return sum(-(-p.stat().st_size // PAGE) for p in folder.rglob("*") if p.is_file())


def _line(r: subprocess.CompletedProcess, code: int) -> str:
    """The one line a run ended with, exit status `code`: no traceback, nothing after it but the
    progress bars it closed."""
    assert r.returncode == code, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.count("error: ") == 1, r.stderr[-3000:]
    tail = r.stderr[r.stderr.index("error: "):]
    lines = [x for x in re.split(r"\r|\n", tail) if x.strip() and not re.match(r"\w+:\s+\d+%\|", x)]
    assert len(lines) == 1, r.stderr[-3000:]
    return lines[0]


def _finished(r: subprocess.CompletedProcess, out: Path, total: int) -> None:
    """The command the line named finished the run, and its log reads as one run."""
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs if "loss" in x] == list(range(1, total + 1)), recs
    assert [x["step"] for x in recs if "stsb_dev" in x] == list(range(2, total + 1, 2)), recs
    assert (out / "best" / "test_metrics.json").is_file()
    assert not list(out.rglob(".*")), "a temporary file or folder left behind"


@pytest.fixture
def argv(tiny_bert, data, small_sts, tmp_path):
    """The flags of a run into `out`, its tokens cached off the faulty disk."""
    def make(out: Path, *extra: str, flags: list[str] = FLAGS) -> list[str]:
        return ["--model", str(tiny_bert), "--data", str(data), "--sts_dir", str(small_sts),
                "--output_dir", str(out), "--cache_dir", str(tmp_path / "cache"), *flags, *extra]
    return make


@pytest.fixture(scope="module")
def sizes(tmp_path_factory, tiny_bert, data, small_sts) -> dict[str, int]:
    """Pages of what the runs here write, from runs of the same flags on an ordinary disk."""
    ref = tmp_path_factory.mktemp("reference")
    common_argv = ["--model", str(tiny_bert), "--data", str(data), "--sts_dir", str(small_sts),
                   "--cache_dir", str(ref / "cache")]
    mp = pytest.MonkeyPatch()
    mp.setattr(checkpoint, "drop_last", lambda run: None)      # last/'s size is measured too
    try:
        simcse.main([*common_argv, "--output_dir", str(ref / "simcse"), *FLAGS])
        rcl.main([*common_argv, "--output_dir", str(ref / "rcl"), *RCL_FLAGS])
    finally:
        mp.undo()
        command_line.let_go()
    entropy = ref / "rcl" / "entropy_phi0.01"
    return {"code": _pages(ref / "simcse" / "code"), "rcl_code": _pages(ref / "rcl" / "code"),
            "last": _pages(ref / "simcse" / "last"), "best": _pages(ref / "simcse" / "best"),
            "rcl_last": _pages(ref / "rcl" / "last"), "rcl_best": _pages(ref / "rcl" / "best"),
            "entropy_best": _pages(entropy / "best"), "entropy_end": _pages(entropy / "end")}


# ------------------------------------------------------------------------------------
# A full disk, a file size limit, a disk gone read-only: last/ and best/
# ------------------------------------------------------------------------------------

@pytest.mark.parametrize("place", ["last", "best"])
def test_a_full_disk_at_last_or_best_ends_in_one_line_and_resume_finishes(place, tmp_path, argv, sizes):
    """The largest writes, where a disk fills: last/ of step 4 (written while step 2's is still
    there) or best/ of step 2 (after last/ of step 2)."""
    L, B = sizes["last"], sizes["best"]
    small = SMALL + sizes["code"]
    pages = small + L + B + L // 2 if place == "last" else small + L + B // 2
    with _tmpfs(tmp_path / "disk", pages) as disk:
        out = disk / "run"
        line = _line(_script("simcse.py", argv(out)), 4)
        assert line.startswith(f"error: could not write {out / place}: {ENOSPC}. the last complete "
                               f"checkpoint, step 2, is intact in {out / 'last'}; once it can be written "
                               f"again (free space"), line
        assert line.endswith("the same command plus --resume continues."), line
        assert not list(out.glob(".*")), "the partial copy is left behind, holding the space"
        _resize(disk, 4 * pages)
        r = _script("simcse.py", argv(out, "--resume"))
        assert f"resuming {out} at step 2 " in r.stderr, r.stderr[-3000:]
        _finished(r, out, 4)


def test_a_file_size_limit_at_last_ends_in_one_line_and_resume_finishes(tmp_path, argv, sizes):
    """`ulimit -f` below last/state.pt (the largest file; best/'s files and the token cache fit):
    the first checkpoint fails with EFBIG."""
    out, limit = tmp_path / "run", sizes["last"] * PAGE // 2
    assert limit > sizes["best"] * PAGE // 2

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)      # the write returns EFBIG, no signal kills it
    line = _line(_script("simcse.py", argv(out), preexec_fn=limited), 4)
    assert line == (f"error: could not write {out / 'last'}: {EFBIG}. no checkpoint was written yet; once "
                    f"it can be written again (a larger file size limit: ulimit -f), the same command plus "
                    f"--resume continues."), line
    r = _script("simcse.py", argv(out, "--resume"))
    assert f"no checkpoint in {out / 'last'} yet: training starts from step 0" in r.stderr, r.stderr[-3000:]
    _finished(r, out, 4)


def _loop_device(mountpoint: Path) -> str:
    for row in Path("/proc/self/mounts").read_text().splitlines():
        source, target = row.split()[:2]
        if target == str(mountpoint):
            return Path(source).name
    raise AssertionError(f"{mountpoint} is not mounted")


def test_a_disk_forced_read_only_mid_run_ends_in_one_line_and_resume_finishes(tmp_path, argv):
    """An ext4 disk that the kernel turns read-only under a running run (errors=remount-ro and a
    disk error, here its trigger_fs_error): whichever write comes next fails with EROFS."""
    _need_root()
    if not (shutil.which("mkfs.ext4") and shutil.which("e2fsck")):
        pytest.skip("needs mkfs.ext4 and e2fsck (e2fsprogs)")
    img, disk = tmp_path / "disk.img", tmp_path / "disk"
    disk.mkdir()
    with open(img, "wb") as f:
        f.truncate(32 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True, capture_output=True)
    _mount("-o", "loop,errors=remount-ro", str(img), str(disk))
    out = disk / "run"
    flags = [*FLAGS, "--max_steps", "30"]       # 15 checkpoints: the disk turns read-only among them
    try:
        trigger = Path("/sys/fs/ext4") / _loop_device(disk) / "trigger_fs_error"
        if not trigger.exists():
            pytest.skip(f"{trigger} is missing: this kernel cannot force ext4 read-only")
        run = subprocess.Popen([sys.executable, str(ROOT / "simcse.py"), *argv(out, flags=flags)], env=ENV,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            t0 = time.time()
            while not (out / "last" / "state.pt").exists():
                assert run.poll() is None and time.time() - t0 < 120, run.stderr.read()[-3000:]
                time.sleep(0.05)
            trigger.write_text("a disk error\n")
            stderr = run.communicate(timeout=120)[1]
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
        line = _line(subprocess.CompletedProcess(run.args, run.returncode, "", stderr), 4)
        assert line.startswith(f"error: could not write {out}"), line
        # what the system says: EROFS, or EIO from a write it had taken before (fsync tells it)
        assert f": {EROFS}. " in line or f": {EIO}. " in line, line
        assert "the same command plus --resume continues." in line, line
    finally:
        _umount(disk)
    subprocess.run(["e2fsck", "-fy", str(img)], capture_output=True)    # what a user's fsck does
    _mount("-o", "loop", str(img), str(disk))
    try:
        _finished(_script("simcse.py", argv(out, "--resume", flags=flags)), out, 30)
    finally:
        _umount(disk)


# ------------------------------------------------------------------------------------
# The run's record at the start: run.json (the data's fingerprint) and args.json
# ------------------------------------------------------------------------------------

@pytest.mark.parametrize("free", [1, 2])
def test_a_record_that_cannot_be_written_is_named_and_no_run_goes_on_without_its_fingerprint(
        free, tmp_path, argv, data):
    """A disk with `free` pages left: the lock's line takes one, then the run's record fails
    (run.json, the data's and the code's fingerprints, is written first, then code/: there is no
    args.json without them). The line names the file; --resume with other content in --data is
    refused; the same command runs."""
    mine = tmp_path / "sentences.txt"
    shutil.copy(data, mine)
    with _tmpfs(tmp_path / "disk", 16) as disk:
        (disk / "filler").write_bytes(b"\0" * (16 - free) * PAGE)
        assert os.statvfs(disk).f_bavail == free
        out = disk / "run"
        args = [*argv(out)[:2], "--data", str(mine), *argv(out)[4:]]
        line = _line(_script("simcse.py", args), 4)
        written = "run.json" if free == 1 else "code/simcse.py"
        assert line == (f"error: could not write {out / written}: {ENOSPC}. no checkpoint was written yet; "
                        f"once it can be written again (free space), the same command starts the run."), line
        assert not list(out.glob(".*")), "a temporary file left behind"
        (disk / "filler").unlink()
        _resize(disk, 4096)                     # room for the whole run
        text = mine.read_text(encoding="utf-8")
        mine.write_text("\n".join(text.splitlines()[:200]) + "\n", encoding="utf-8")   # other content
        r = _script("simcse.py", [*args, "--resume"])
        assert r.returncode == 2, r.stderr[-3000:]
        assert "--resume" in _line(r, 2)
        mine.write_text(text, encoding="utf-8")
        _finished(_script("simcse.py", args), out, 4)
        assert json.loads((out / "run.json").read_text())["data_sha256"] == atomic_writes.sha256_file(mine)


# ------------------------------------------------------------------------------------
# Signals while the script imports torch (seconds): one line, nothing to resume
# ------------------------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_script_starts_ends_in_one_line(sig, tmp_path, argv):
    out = tmp_path / "run"
    run = subprocess.Popen([sys.executable, str(ROOT / "simcse.py"), *argv(out)], env=ENV,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)                         # torch, transformers and scipy take seconds to import
    run.send_signal(sig)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 128 + sig, err[-3000:]
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    what = "terminated (SIGTERM)" if sig == signal.SIGTERM else "interrupted (Ctrl-C)"
    assert lines[0].startswith(what) and lines[0].endswith("Run the same command again."), lines[0]
    assert "plus --resume" not in lines[0] and not out.exists()
    _finished(_script("simcse.py", argv(out)), out, 4)


def test_a_program_that_imports_a_script_keeps_its_own_signal_handlers():
    """plumbing/interrupts.py takes the signals only in a process started as a script: the tests (which
    import the scripts) and a user's notebook keep Python's Ctrl-C."""
    probe = (f"import signal, sys; sys.path.insert(0, {str(ROOT)!r}); import plumbing.interrupts; "
             f"print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, "
             f"signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)")
    r = subprocess.run([sys.executable, "-c", probe], env=ENV, capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["True", "True"], r.stdout + r.stderr


# ------------------------------------------------------------------------------------
# rcl.py: its stages' writes on a full disk, its entropy folders' locks
# ------------------------------------------------------------------------------------

def test_rcl_a_full_disk_at_each_stage_ends_in_one_line_and_resume_finishes(tmp_path, argv, sizes):
    """One run, its disk made larger after each failure: the entropy model's best/ (step 2), its
    end/ (the weights it stopped with), the final model's best/; then --resume finishes it."""
    L, EB, E, FB = sizes["rcl_last"], sizes["entropy_best"], sizes["entropy_end"], sizes["rcl_best"]
    small = SMALL + sizes["rcl_code"]
    with _tmpfs(tmp_path / "disk", small + L + EB // 2) as disk:
        out = disk / "run"
        entropy = out / "entropy_phi0.01"
        # a model folder's save needs about twice its size for a moment: sentence-transformers' save()
        # writes the weights again over the ones written first
        stages = [(entropy / "best", entropy, small + L + 2 * EB + E // 2),
                  (entropy / "end", entropy, small + L + EB + 2 * E + FB // 2),
                  (out / "best", out, 4 * (small + L + EB + E + FB))]
        resume = []
        for failed, folder, room in stages:
            line = _line(_script("rcl.py", argv(out, *resume, flags=RCL_FLAGS)), 4)
            assert line.startswith(f"error: could not write {failed}: {ENOSPC}. the last complete "
                                   f"checkpoint, step 2, is intact in {folder / 'last'}"), line
            assert line.endswith("the same command plus --resume continues."), line
            assert not list(folder.glob(".*")), "the partial copy is left behind, holding the space"
            _resize(disk, room)
            resume = ["--resume"]
        r = _script("rcl.py", argv(out, "--resume", flags=RCL_FLAGS))
        _finished(r, out, 2)
        assert (entropy / run_folder.DONE).is_file() and (entropy / "end").is_dir()


# rcl.py as `python rcl.py ARGV` runs it, with one write played as a full disk: the folder of its
# second entropy model (a stage's folder, made mid-run)
STAGE_FAILS = """
import errno, os, runpy, sys
real = os.mkdir
def full(path, *a, **k):
    if str(path).endswith("entropy_phi0.02"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real(path, *a, **k)
os.mkdir = full
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_rcl_an_entropy_folder_that_cannot_be_made_ends_as_a_failed_write(tmp_path, argv):
    out = tmp_path / "run"
    flags = [*RCL_FLAGS, "--phi", "0.01", "0.02"]
    r = subprocess.run([sys.executable, "-c", STAGE_FAILS, str(ROOT / "rcl.py"), *argv(out, flags=flags)],
                       env=ENV, capture_output=True, text=True, timeout=300)
    line = _line(r, 4)
    assert line.startswith(f"error: could not write {out / 'entropy_phi0.02'}: {ENOSPC}. no "
                           f"checkpoint was written yet in entropy_phi0.02; finished and kept: "
                           f"entropy_phi0.01; "), line
    assert line.endswith("the same command plus --resume continues."), line
    _finished(_script("rcl.py", argv(out, "--resume", flags=flags)), out, 2)


def test_rcl_a_second_start_while_the_first_runs_names_the_process(tmp_path, argv):
    """A second plain start (a job scheduler's retry, another terminal) while stage 1 runs: refused
    in one line (exit 2) that names the process holding the folder, as for any run folder."""
    out = tmp_path / "run"
    flags = [*RCL_FLAGS, "--max_steps", "6"]
    with Held(tmp_path / "held", "rcl.py", argv(out, flags=flags)) as first:
        first.wait()                    # inside the entropy model, after its first checkpoint
        assert (out / "entropy_phi0.01" / "last" / "state.pt").is_file()
        line = _line(_script("rcl.py", argv(out, flags=flags)), 2)
        assert first.proc.poll() is None, "the first run ended before the second one tried its folder"
        assert f"is in use by another process ({out / 'run.lock'} says which)" in line, line
        assert f"process {first.proc.pid} " in (out / "run.lock").read_text()


# ------------------------------------------------------------------------------------
# Signals mid-run: never dropped, one line each, a commit never half done
# ------------------------------------------------------------------------------------

def _stop_line(r: subprocess.CompletedProcess, code: int) -> str:
    """The one line a run stopped by a signal ended with, exit status `code`: no traceback, no
    exception Python reports as dropped."""
    assert r.returncode == code, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr[-3000:]
    said = [x for x in r.stderr.splitlines() if x.startswith(("interrupted (", "terminated (", "hung up ("))]
    assert len(said) == 1, r.stderr[-3000:]
    return said[0]


def test_sighup_ends_the_run_in_one_line_with_its_status(tmp_path, argv):
    """The terminal or the ssh session closed: 129 and a line (in a log, if stderr went to one)."""
    out = tmp_path / "run"
    with Held(tmp_path / "held", "simcse.py", argv(out)) as run:
        run.wait()
        run.proc.send_signal(signal.SIGHUP)
        r = run.end()
    line = _stop_line(r, 129)
    assert line.startswith("hung up (SIGHUP") and "--resume" in line, line
    _finished(_script("simcse.py", argv(out, "--resume")), out, 4)


# before the run: SIGTERM right after the first rename of last/'s second commit (step 4), when
# last/ is .last.old and the new one not yet in its place
TERM_BETWEEN_RENAMES = """
import os, signal
from pathlib import Path
real_replace = os.replace
def replace(src, dst, *a, **k):
    real_replace(src, dst, *a, **k)
    if Path(dst).name == ".last.old":
        os.kill(os.getpid(), signal.SIGTERM)
os.replace = replace
"""


def test_a_signal_between_the_two_renames_of_a_commit_leaves_the_old_checkpoint(tmp_path, argv):
    """SIGTERM between the renames that swap step 4's last/ in: the stop line; step 2's checkpoint
    waits beside the folder (.last.old), and the --resume the line names puts it back and goes on."""
    out = tmp_path / "run"
    with Held(tmp_path / "held", "simcse.py", argv(out), at=0, before=TERM_BETWEEN_RENAMES) as run:
        r = run.end()
    _stop_line(r, 143)
    assert not (out / "last").exists()
    assert torch.load(out / ".last.old" / "state.pt", weights_only=True)["step"] == 2
    r = _script("simcse.py", argv(out, "--resume"))
    assert f"resuming {out} at step 2 " in r.stderr, r.stderr[-3000:]
    _finished(r, out, 4)


def test_a_deleted_run_lock_lets_no_second_process_in(tmp_path, argv):
    """`rm R/run.lock` under a live run: a --resume started then stops (exit 2) instead of training
    beside it (the log held steps 21-37 twice); the first run finishes as one run."""
    out = tmp_path / "run"
    with Held(tmp_path / "held", "simcse.py", argv(out)) as first:
        first.wait()
        (out / run_folder.LOCK).unlink()
        line = _line(_script("simcse.py", argv(out, "--resume")), 2)
        assert line.startswith(f"error: --output_dir {out} is in use by another process ("), line
        assert first.proc.poll() is None
        first.go()
        _finished(first.end(), out, 4)


def test_sigterm_while_python_shuts_down_after_the_run_ends_no_other_way(tmp_path, argv):
    """The run has finished (best/test_metrics.json, its last write, is there) and Python is shutting
    down, which takes a second or two: a SIGTERM then killed the process without a word (-15). It
    ends as the run did (0), or, if it came before run_main's end, in its one line (143)."""
    out = tmp_path / "run"
    run = subprocess.Popen([sys.executable, str(ROOT / "simcse.py"), *argv(out)], env=ENV,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.time()
        while not (out / "best" / "test_metrics.json").exists():
            assert run.poll() is None and time.time() - t0 < 300, run.stderr.read()[-3000:]
            time.sleep(0.01)
        run.send_signal(signal.SIGTERM)
        err = run.communicate(timeout=120)[1]
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode in (0, 143), err[-3000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]


def test_a_file_size_limit_on_stderr_too_ends_as_a_failed_write(tmp_path, argv, sizes):
    """`ulimit -f` below last/state.pt, stderr sent to a file already at the limit (so that no line
    can be written): exit 4 all the same, not a traceback nobody sees (exit 1)."""
    out, limit, log = tmp_path / "run", sizes["last"] * PAGE // 2, tmp_path / "stderr.txt"
    log.write_bytes(b"." * limit)

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    with open(log, "a") as stderr:
        r = subprocess.run([sys.executable, str(ROOT / "simcse.py"), *argv(out)], env=ENV, stderr=stderr,
                           stdout=subprocess.DEVNULL, preexec_fn=limited, timeout=300)
    assert r.returncode == 4 and log.stat().st_size == limit
    _finished(_script("simcse.py", argv(out, "--resume")), out, 4)


def test_a_full_disk_at_the_lock_leaves_no_folder(tmp_path, argv):
    """No page free: the lock's line, the run's first write, fails; refused in one line (exit 2),
    and no empty folder with an empty run.lock is left behind."""
    with _tmpfs(tmp_path / "disk", 16) as disk:
        (disk / "filler").write_bytes(b"\0" * 16 * PAGE)
        out = disk / "run"
        line = _line(_script("simcse.py", argv(out)), 2)
        assert line.startswith(f"error: --output_dir {out}: cannot be written ({ENOSPC})"), line
        assert not out.exists()


def test_a_full_disk_at_the_token_cache_names_cache_dir_and_leaves_no_temporary_file(tmp_path, argv):
    """--cache_dir on a disk with one page: the cache's write fails (exit 4); the line names
    --cache_dir, and the partial file is removed."""
    with _tmpfs(tmp_path / "cache_disk", 1) as disk:
        out = tmp_path / "run"
        args = argv(out)
        args[args.index("--cache_dir") + 1] = str(disk)
        line = _line(_script("simcse.py", args), 4)
        assert f"could not write the token cache {disk}" in line and "--cache_dir" in line, line
        assert ENOSPC in line, line
        assert not list(disk.iterdir())
