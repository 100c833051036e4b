"""Repeated SIGKILL and --resume: the run folder must still hold one run.

Real runs (simcse.py, rcl.py's stage 1 and 2) are killed with SIGKILL at chosen points (a
record half written, between the two renames of a checkpoint commit, between last/ and best/,
before the first checkpoint, during a resume's own start-up, ...), each resumed with
--resume, the last one to the end. Then metrics.jsonl must hold every training record at
most once, every evaluation record exactly once, in order, nothing a finished step logged
may be missing, best/ and last/ must load, and everything must equal an uninterrupted run's
(on CPU in fp32 the resumed run reproduces it bit for bit: weights, losses, dev scores).

The kills are deterministic: a kill point is (kind, file name, n), e.g. ("before-replace",
"last", 2) = SIGKILL just before the 2nd rename onto a folder named last. The hooks are
installed by monkeypatching inside the killed process, so common.py carries none of them.
To pay the import of torch and transformers once, a fresh interpreter imports the scripts
and forks one child per run (it runs no tensor code itself, so the children start clean).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the driver forks one child per run")


# ------------------------------------------------------------------------------------
# The driver: runs in its own interpreter (python tests/test_kill_resume.py plan.json)
# ------------------------------------------------------------------------------------

def _arm(kind: str, name: str | None, n: int) -> None:
    """Make this process SIGKILL itself at the n-th occurrence of `kind`:
    record / half-record: right after the n-th metrics.jsonl record is written (or half of it);
    before-replace / after-replace: around the n-th os.replace onto a path named `name`;
    after-truncate: right after the n-th os.ftruncate (a resume's cut of the log);
    step: before the n-th training step."""
    import common

    hits = [0]

    def due() -> bool:
        hits[0] += 1
        return hits[0] == n

    def die() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    if kind in ("record", "half-record"):
        real_write = common.RunFolder.write

        def write(self, record):
            if self.main and due():
                line = json.dumps(record) + "\n"
                with open(self.log, "a") as f:
                    f.write(line if kind == "record" else line[: len(line) // 2])
                die()
            real_write(self, record)
        common.RunFolder.write = write
    elif kind in ("before-replace", "after-replace"):
        real_replace = os.replace

        def replace(src, dst, *a, **k):
            hit = Path(dst).name == name and due()
            if hit and kind == "before-replace":
                die()
            real_replace(src, dst, *a, **k)
            if hit:
                die()
        os.replace = replace
    elif kind == "after-truncate":
        real_truncate = os.ftruncate

        def truncate(fd, length):
            real_truncate(fd, length)
            if due():
                die()
        os.ftruncate = truncate
    elif kind == "step":
        real_step = common.train_step

        def dying(*a, **k):
            if due():
                die()
            return real_step(*a, **k)
        common.train_step = dying
    else:
        raise ValueError(kind)


def _driver(plan_path: str) -> None:
    """Run plan["runs"] one after another, each in a forked child; write each exit status
    (-9 for a SIGKILL) to plan["codes"]."""
    sys.path.insert(0, str(ROOT))
    # what transformers imports lazily on the first load of a BERT: once here, not per child
    from transformers import AutoModel, AutoTokenizer, BertModel, BertTokenizerFast  # noqa: F401

    import common
    import rcl
    import simcse
    mains = {"simcse": simcse.main, "rcl": rcl.main}
    plan = json.loads(Path(plan_path).read_text())
    codes = []
    for run in plan["runs"]:
        sys.stdout.flush()
        sys.stderr.flush()
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                if run["kill"]:
                    _arm(*run["kill"])
                common.run_main(mains[run["script"]], run["argv"])
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        codes.append(-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
        print(f"[driver] {run['script']} kill={run['kill']}: exit {codes[-1]} after "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    Path(plan["codes"]).write_text(json.dumps(codes))


def _play(tmp_path: Path, runs: list[dict]) -> tuple[list[int], str]:
    # imported here, not above: the driver (this file run as a script) has no conftest on its path
    from conftest import ENV
    plan = {"runs": runs, "codes": str(tmp_path / "codes.json")}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    # one thread (ENV): the reference and the resumed runs compute alike
    r = subprocess.run([sys.executable, __file__, str(tmp_path / "plan.json")], env=ENV,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    codes = json.loads((tmp_path / "codes.json").read_text())
    assert len(codes) == len(runs), r.stderr[-3000:]
    return codes, r.stderr


# ------------------------------------------------------------------------------------
# Checks
# ------------------------------------------------------------------------------------

def _records(path: Path) -> list[dict]:
    """Every line of a metrics.jsonl; a line cut short fails json.loads."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def _same_run(got: Path, ref: Path, log_every: int, eval_every: int) -> None:
    """metrics.jsonl of `got` reads as one run, and as the uninterrupted run `ref`."""
    recs, want = _records(got / "metrics.jsonl"), _records(ref / "metrics.jsonl")
    train = [r["step"] for r in recs if "loss" in r]
    evals = [r["step"] for r in recs if "stsb_dev" in r]
    assert train == sorted(set(train)), f"a training record twice or out of order: {train}"
    assert evals == sorted(set(evals)), f"an evaluation record twice or out of order: {evals}"
    total = max(r["step"] for r in want)
    assert train == [s for s in range(1, total + 1)
                     if s % log_every == 0 or s % eval_every == 0 or s == total], train
    assert evals == [s for s in range(1, total + 1) if s % eval_every == 0 or s == total], evals
    # the very same run: losses, learning rates, dev scores (throughput aside)
    def strip(rs):
        return [{k: v for k, v in r.items() if k != "sent_per_s"} for r in rs]
    assert strip(recs) == strip(want)


def _same_weights(got: Path, ref: Path) -> None:
    """best/ loads (AutoModel) and holds the reference's weights; so does last/ if kept."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModel
    AutoModel.from_pretrained(got / "best")
    a = load_file(str(got / "best" / "model.safetensors"))
    b = load_file(str(ref / "best" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((got / "best" / "dev_metrics.json").read_text()) == \
        json.loads((ref / "best" / "dev_metrics.json").read_text())
    if (ref / "last").exists():
        a = torch.load(got / "last" / "state.pt", weights_only=False)
        b = torch.load(ref / "last" / "state.pt", weights_only=False)
        assert a["step"] == b["step"] and a["best_step"] == b["best_step"]
        assert all(torch.equal(v, b["model"][k]) for k, v in a["model"].items())


# ------------------------------------------------------------------------------------
# The runs
# ------------------------------------------------------------------------------------

@pytest.fixture
def sentences(corpus, tmp_path) -> Path:
    p = tmp_path / "sentences.txt"
    p.write_text("\n".join(corpus.read_text(encoding="utf-8").splitlines()[:400]) + "\n",
                 encoding="utf-8")
    return p


# Each kill is (kind, file name, n); the comment says where it lands with the flags below
# (--max_steps 12 --eval_every 3 --log_every 2: records at steps 2, 3, 3 (eval), 4, 6, 6, ...).
SIMCSE_KILLS = [
    ("record", None, 1),                 # step 2 logged, no checkpoint yet: the resume starts at 0
    ("half-record", None, 3),            # the evaluation record of step 3 cut in half
    ("after-replace", "last", 1),        # last/ of step 3 written, best/ not yet
    ("before-replace", "best", 1),       # the resume's re-save of best/ (behind last/), not swapped in
    ("after-truncate", None, 1),         # the resume's start-up, right after the log is cut
    ("before-replace", "last", 1),       # between the two renames of last/ (step 6)
    ("before-replace", ".last.old", 2),  # last/ of step 9 written whole, not yet swapped in
    ("step", None, 3),                   # inside training: step 8 logged after the checkpoint
]


def test_simcse_killed_and_resumed_reads_as_one_run(tmp_path, tiny_bert, sentences, small_sts, cache_dir):
    def argv(out, resume=False):
        return ["--model", str(tiny_bert), "--data", str(sentences), "--sts_dir", str(small_sts),
                "--output_dir", str(out), "--cache_dir", str(cache_dir), "--batch_size", "8",
                "--max_steps", "12", "--eval_every", "3", "--log_every", "2", "--lr", "1e-3",
                "--max_len", "16"] + (["--resume"] if resume else [])

    ref, run = tmp_path / "ref", tmp_path / "run"
    runs = [{"script": "simcse", "argv": argv(ref), "kill": None}]
    runs += [{"script": "simcse", "argv": argv(run, i > 0), "kill": k} for i, k in enumerate(SIMCSE_KILLS)]
    runs += [{"script": "simcse", "argv": argv(run, True), "kill": None}]
    codes, err = _play(tmp_path, runs)
    # every kill point was reached (a schedule that no longer fits the code fails here)
    assert codes == [0] + [-signal.SIGKILL] * len(SIMCSE_KILLS) + [0], (codes, err[-3000:])
    _same_run(run, ref, log_every=2, eval_every=3)
    _same_weights(run, ref)
    # args.json is written once, when the run starts: the flags it was started with
    assert json.loads((run / "args.json").read_text())["resume"] is False
    assert not list(run.glob(".*")), "a temporary folder or file left behind"


# rcl: two entropy models (entropy_phi0.01/, entropy_phi0.02/), then the final model in the
# run folder; --max_steps 6 --eval_every 2 --log_every 1: per model 6 training records and 3
# evaluation records (steps 2, 4, 6), no early stopping.
RCL_KILLS = [
    ("half-record", None, 5),            # phi 0.01: step 4's training record cut in half
    ("before-replace", "last", 1),       # phi 0.01: between the two renames of last/ (step 4)
    ("before-replace", "end", 1),        # phi 0.01 trained to the end: its end/ not swapped in
    ("before-replace", "DONE.json", 1),  # phi 0.01 trained to the end, not marked finished
    ("after-replace", "DONE.json", 1),   # phi 0.01 marked finished, its last/ not yet removed
    ("before-replace", "best", 1),       # phi 0.02: last/ of step 2 written, best/ not swapped in
    ("after-truncate", None, 1),         # phi 0.02: the resume's start-up
    ("record", None, 7),                 # phi 0.02 finished (steps 3-6); the final model logged step 1
    ("half-record", None, 3),            # the final model, again before its first checkpoint
    ("before-replace", "last", 2),       # the final model: between the renames of last/ (step 4)
]


def test_rcl_killed_and_resumed_reads_as_one_run(tmp_path, tiny_bert, sentences, small_sts, cache_dir):
    def argv(out, resume=False):
        return ["--model", str(tiny_bert), "--data", str(sentences), "--sts_dir", str(small_sts),
                "--output_dir", str(out), "--cache_dir", str(cache_dir), "--batch_size", "8",
                "--max_steps", "6", "--eval_every", "2", "--log_every", "1", "--lr", "1e-3",
                "--max_len", "16", "--phi", "0.01", "0.02", "--patience", "0",
                "--pooler", "cls_before_pooler"] + (["--resume"] if resume else [])

    ref, run = tmp_path / "ref", tmp_path / "run"
    runs = [{"script": "rcl", "argv": argv(ref), "kill": None}]
    runs += [{"script": "rcl", "argv": argv(run, i > 0), "kill": k} for i, k in enumerate(RCL_KILLS)]
    runs += [{"script": "rcl", "argv": argv(run, True), "kill": None}]
    codes, err = _play(tmp_path, runs)
    assert codes == [0] + [-signal.SIGKILL] * len(RCL_KILLS) + [0], (codes, err[-3000:])
    # phi 0.01 killed between the renames of last/ resumes from its step-2 checkpoint again
    # (twice in all), rather than being trained anew
    assert err.count(f"resuming {run / 'entropy_phi0.01'} at step 2 ") == 2, err[-3000:]
    for phi in ("0.01", "0.02"):
        folder = f"entropy_phi{phi}"
        _same_run(run / folder, ref / folder, log_every=1, eval_every=2)
        _same_weights(run / folder, ref / folder)
        assert json.loads((run / folder / "DONE.json").read_text()) == \
            json.loads((ref / folder / "DONE.json").read_text())
        assert not (run / folder / "last").exists()
    _same_run(run, ref, log_every=1, eval_every=2)
    _same_weights(run, ref)
    assert not list(run.rglob(".*")), "a temporary folder or file left behind"


# ------------------------------------------------------------------------------------
# One process per run folder
# ------------------------------------------------------------------------------------

def test_a_second_process_on_a_live_run_stops_and_a_killed_one_does_not_block(
        tmp_path, tiny_bert, sentences, small_sts, cache_dir):
    """A --resume started while the run is still alive (a job restarted, a second terminal)
    stops before it writes anything, exit 2, naming the folder and the process that holds it;
    once that process is killed (-9: no chance to clean up), --resume continues the run, and
    the log reads as one run."""
    from conftest import Held, script
    out = tmp_path / "run"
    argv = ["--model", str(tiny_bert), "--data", str(sentences), "--sts_dir", str(small_sts),
            "--output_dir", str(out), "--cache_dir", str(cache_dir), "--batch_size", "8",
            "--max_steps", "30", "--eval_every", "2", "--log_every", "1", "--lr", "1e-3", "--max_len", "16"]
    with Held(tmp_path / "held", "simcse.py", argv) as first:
        first.wait()                                         # before step 3: step 2's checkpoint is kept
        args_before = (out / "args.json").read_text()
        second = script("simcse.py", [*argv, "--resume"])
        assert first.proc.poll() is None, "the first run ended before the second one tried its folder"
        assert second.returncode == 2, second.stderr[-3000:]
        err = [line for line in second.stderr.splitlines() if line.startswith("error: ")]
        assert len(err) == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
        assert f"--output_dir {out} is in use by another process ({out / 'run.lock'} says which)" in err[0], \
            err[0]
        assert f"process {first.proc.pid} " in (out / "run.lock").read_text()
        assert "--resume" in err[0]
        assert (out / "args.json").read_text() == args_before      # still the first run's
        first.proc.kill()                                          # SIGKILL
        first.proc.wait()
    assert first.proc.returncode == -signal.SIGKILL
    third = script("simcse.py", [*argv, "--resume"])
    assert third.returncode == 0, third.stderr[-3000:]
    recs = _records(out / "metrics.jsonl")
    train = [r["step"] for r in recs if "loss" in r]
    evals = [r["step"] for r in recs if "stsb_dev" in r]
    assert train == list(range(1, 31)) and evals == list(range(2, 31, 2))
    # the lock file names its last holder, for the message a second process prints
    assert "simcse.py" in (out / "run.lock").read_text()


if __name__ == "__main__":
    _driver(sys.argv[1])
