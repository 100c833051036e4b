"""tools/translate.py: IFCL's German file, batched by length, resumable after any kill (a tiny seq2seq
model stands in for t5-base)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import common
from conftest import ROOT, run_base
from plumbing import inputs
from plumbing import translation as translate


def translate_flags(parallel, tiny_mt, out=None, chunk=16, batch=4):
    f = ["--data", str(parallel / "en.txt"), "--mt_model", str(tiny_mt),
         "--chunk_size", str(chunk), "--batch_size", str(batch)]
    return f + (["--out", str(out)] if out else [])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, parallel, tiny_mt):
    """An uninterrupted translation of the 48 sentences one at a time (no batch, no padding)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("ref") / "ref.de.txt"
    translate.main(translate_flags(parallel, tiny_mt, out, chunk=1, batch=1))
    torch.set_num_threads(n)
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 48 and all(l.strip() for l in lines)
    assert len(set(lines)) > 40                  # distinct enough that a swap of lines shows
    return lines


def record_generate(monkeypatch, die_at=None):
    """Record the lengths of each generate() call's sentences; raise KeyboardInterrupt at
    call number `die_at`."""
    from transformers import BartForConditionalGeneration
    calls, real = [], BartForConditionalGeneration.generate

    def generate(self, **kw):
        calls.append(kw["attention_mask"].sum(1).tolist())
        if len(calls) == die_at:
            raise KeyboardInterrupt
        return real(self, **kw)
    monkeypatch.setattr(BartForConditionalGeneration, "generate", generate)
    return calls


def test_translate_sorts_batches_by_length_and_writes_in_input_order(tmp_path, parallel, tiny_mt,
                                                                     reference, monkeypatch, one_thread,
                                                                     capsys):
    calls = record_generate(monkeypatch)
    out = translate.main(translate_flags(parallel, tiny_mt, tmp_path / "de.txt"))
    assert out.read_text(encoding="utf-8").splitlines() == reference
    assert not Path(str(out) + ".part").exists() and not Path(str(out) + ".part.json").exists()
    assert len(calls) == 12 and all(len(c) == 4 for c in calls)      # 3 chunks of 16, batches of 4
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_mt)
    src = (parallel / "en.txt").read_text(encoding="utf-8").splitlines()
    for k in range(3):                           # each chunk: its own sentences, longest first
        lengths = [n for c in calls[4 * k:4 * k + 4] for n in c]
        assert lengths == sorted(lengths, reverse=True)
        assert sorted(lengths) == sorted(len(tok(s)["input_ids"]) for s in src[16 * k:16 * (k + 1)])
    err = capsys.readouterr().err
    assert "sent" in err and "translated 48 sentences in" in err and "sentences/s" in err
    # complete: a second call is a no-op; another --data of other length for it is refused
    calls.clear()
    assert translate.main(translate_flags(parallel, tiny_mt, out)) == out and calls == []
    with pytest.raises(common.UserError, match="exists with 48 lines"):
        translate.main(["--data", str(parallel / "de_short.txt"), "--mt_model", str(tiny_mt),
                   "--out", str(out)])


def test_translate_interrupted_resumes_with_the_remaining_chunks(tmp_path, parallel, tiny_mt,
                                                                 reference, monkeypatch, one_thread):
    out = tmp_path / "de.txt"
    part = Path(str(out) + ".part")
    calls = record_generate(monkeypatch, die_at=6)                   # in chunk 2's second batch
    with pytest.raises(KeyboardInterrupt):
        translate.main(translate_flags(parallel, tiny_mt, out))
    assert not out.exists() and part.read_text(encoding="utf-8").splitlines() == reference[:16]
    with open(part, "ab") as f:                                      # a line cut by the kill
        f.write("halb geschrieb".encode())
    calls = record_generate(monkeypatch)
    translate.main(translate_flags(parallel, tiny_mt, out))
    assert sum(map(len, calls)) == 32                                # chunks 2 and 3 only
    assert out.read_text(encoding="utf-8").splitlines() == reference
    assert not part.exists()
    # an unfinished file whose .part.json is missing (or says other settings) is refused
    other = tmp_path / "other.de.txt"
    Path(str(other) + ".part").write_text("x\n")
    with pytest.raises(common.UserError, match="unfinished translation of other input or settings"):
        translate.main(translate_flags(parallel, tiny_mt, other))


def test_empty_translation_keeps_the_english_line_and_is_counted(tmp_path, parallel, tiny_mt,
                                                                 reference, monkeypatch, one_thread,
                                                                 capsys):
    from transformers import BartForConditionalGeneration
    real = BartForConditionalGeneration.generate

    calls = []

    def generate(self, **kw):
        gen = real(self, **kw)
        calls.append(1)
        if len(calls) in (1, 5):                     # first batch of chunks 1 and 2
            gen[0, 1:] = self.config.pad_token_id    # only the start token: decodes to ""
        return gen
    monkeypatch.setattr(BartForConditionalGeneration, "generate", generate)
    out = translate.main(translate_flags(parallel, tiny_mt, tmp_path / "de.txt"))
    got = out.read_text(encoding="utf-8").splitlines()
    src = (parallel / "en.txt").read_text(encoding="utf-8").splitlines()
    assert len(got) == 48
    changed = [i for i in range(48) if got[i] != reference[i]]
    assert len(changed) == 2 and all(got[i] == src[i] for i in changed)
    assert changed[0] < 16 <= changed[1] < 32
    assert "2 of 48 translations came back empty" in capsys.readouterr().err


def test_running_out_of_gpu_memory_halves_the_batch(tmp_path, parallel, tiny_mt, reference,
                                                    monkeypatch, one_thread, capsys):
    from transformers import BartForConditionalGeneration
    real, sizes = BartForConditionalGeneration.generate, []

    def generate(self, **kw):
        sizes.append(kw["input_ids"].shape[0])
        if sizes[-1] > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, **kw)
    monkeypatch.setattr(BartForConditionalGeneration, "generate", generate)
    out = translate.main(translate_flags(parallel, tiny_mt, tmp_path / "de.txt", chunk=16, batch=8))
    assert sizes[:3] == [8, 4, 2] and set(sizes[3:]) == {2}          # halved twice, then kept
    assert out.read_text(encoding="utf-8").splitlines() == reference
    assert capsys.readouterr().err.count("out of GPU memory") == 2
    sizes.clear()                                                    # one sentence does not fit
    monkeypatch.setattr(BartForConditionalGeneration, "generate",
                        lambda self, **kw: (_ for _ in ()).throw(torch.cuda.OutOfMemoryError("oom")))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        translate.main(translate_flags(parallel, tiny_mt, tmp_path / "de2.txt", batch=1))


KILLED = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads(1)
import ifcl
from plumbing import translation as translate
from transformers import BartForConditionalGeneration
point, n, which, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
real_generate, real_replace, calls = BartForConditionalGeneration.generate, os.replace, [0]

def generate(self, **kw):
    calls[0] += 1
    if point == "generate" and calls[0] == n:       # during the n-th batch
        os.kill(os.getpid(), signal.SIGKILL)
    if point == "slow":                             # for a kill from outside
        time.sleep(0.5)
    return real_generate(self, **kw)

def replace(src, dst):
    if point == "rename" and str(dst).endswith("de.txt"):    # every line written, not renamed
        os.kill(os.getpid(), signal.SIGKILL)
    return real_replace(src, dst)

BartForConditionalGeneration.generate = generate
os.replace = replace
(translate.main if which == "translate" else ifcl.main)(argv)
"""


def run_killed(tmp_path, point, n, which, argv, wait_for=None):
    """Run translate.main(argv) (which="translate") or ifcl.main(argv) in a subprocess that gets
    SIGKILL at `point`: from itself, or (point 'slow') from here once `wait_for()` holds."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    p = subprocess.Popen([sys.executable, "-c", KILLED.format(root=str(ROOT)), point, str(n), which, *argv],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    if wait_for:
        t0 = time.time()
        while not wait_for() and p.poll() is None and time.time() - t0 < 300:
            time.sleep(0.05)
        p.send_signal(signal.SIGKILL)
    _, err = p.communicate(timeout=300)
    assert p.returncode == -signal.SIGKILL, err[-3000:]
    return err


@pytest.mark.parametrize("point,n,finished", [("generate", 1, 0), ("generate", 6, 16),
                                              ("generate", 12, 32), ("rename", 0, 48)])
def test_translation_killed_with_sigkill_resumes_from_the_finished_lines(
        point, n, finished, tmp_path, parallel, tiny_mt, reference, monkeypatch, one_thread):
    out = tmp_path / "de.txt"
    part = Path(str(out) + ".part")
    run_killed(tmp_path, point, n, "translate", translate_flags(parallel, tiny_mt, out))
    assert not out.exists()                                          # never a partial final file
    assert part.read_text(encoding="utf-8").splitlines() == reference[:finished]
    if finished == 16:   # a kill while the next chunk was being appended: 2 lines and a half
        with open(part, "a", encoding="utf-8") as f:
            f.write("KEPT 16\nKEPT 17\nhalb geschr")
    calls = record_generate(monkeypatch)
    translate.main(translate_flags(parallel, tiny_mt, out))
    got = out.read_text(encoding="utf-8").splitlines()
    if finished == 16:   # finished lines are kept; the chunk they belong to is redone whole
        assert got[16:18] == ["KEPT 16", "KEPT 17"]
        got[16:18] = reference[16:18]
    assert got == reference and not part.exists()
    assert sum(map(len, calls)) == 48 - finished


def test_training_run_killed_from_outside_while_translating_resumes(tmp_path, parallel, tiny_mt,
                                                                   tiny_bert, small_sts, tiny_mbert):
    """`python ifcl.py` (training) killed during its first-run translation, which comes after
    every flag is checked; `python tools/translate.py` with the same --data, --mt_model and
    --cache_dir finishes the same file."""
    cache = tmp_path / "c"
    final = translate.default_fraternal_path(str(parallel / "en.txt"), str(tiny_mt), str(cache))
    part = Path(str(final) + ".part")
    argv = run_base(tmp_path, parallel, "--mt_model", str(tiny_mt), "--model", str(tiny_bert),
                    "--sts_dir", str(small_sts), "--batch_size", "8", "--fraternal_model", str(tiny_mbert))
    err = run_killed(tmp_path, "slow", 0, "ifcl", argv, wait_for=lambda: part.exists())
    assert "translating" in err and not final.exists() and part.exists()
    translate.main(["--data", str(parallel / "en.txt"), "--mt_model", str(tiny_mt),
                    "--cache_dir", str(cache)])
    assert inputs.count_lines(final) == 48 and not part.exists()
