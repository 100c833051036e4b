"""The token cache is trusted only when it is whole and its own, and is only a cache.

Its name is a SHA-256 of all that decides the ids: two tokenizers that differ in two ids (the
real BERT vocabulary with "the" and "of" swapped) never share a file. A file that is not whole and
this key's (cut short, pickled arrays, a link, another cache under its name) is tokenised again and
replaced, with a note; a pickle in it never runs; what a killed process left is removed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import common
from conftest import ENV, ROOT, EnglishLike, Shell


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return EnglishLike(11).sentences(60)


def _fresh(tokenizer, texts: list[str]) -> np.ndarray:
    return common.tokenize(tokenizer, texts, 16).ids              # no cache


def test_two_tokenizers_that_differ_in_two_ids_do_not_share_a_cache(minilm, texts, tmp_path):
    """The real BERT vocabulary (30,522 pieces), "the" and "of" swapped: an earlier key hashed only
    the first 2,000 sorted pieces (all but three of them ##-pieces), and the second tokenizer read
    the first one's ids."""
    from transformers import AutoTokenizer
    swapped = tmp_path / "swapped"
    shutil.copytree(minilm, swapped, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    spec = json.loads((swapped / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    vocab["the"], vocab["of"] = vocab["of"], vocab["the"]
    (swapped / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    first, second = AutoTokenizer.from_pretrained(str(minilm)), AutoTokenizer.from_pretrained(str(swapped))
    assert second.convert_tokens_to_ids("the") == first.convert_tokens_to_ids("of")
    a = common.tokenize(first, texts, 16, tmp_path / "cache")
    b = common.tokenize(second, texts, 16, tmp_path / "cache")
    assert np.array_equal(b.ids, _fresh(second, texts)) and not np.array_equal(a.ids, b.ids)
    assert len(list((tmp_path / "cache").glob("tok-*.npz"))) == 2


def _cut(cache: Path, other: Path, tmp_path: Path) -> None:
    cache.write_bytes(cache.read_bytes()[: cache.stat().st_size // 2])


def _pickled(cache: Path, other: Path, tmp_path: Path) -> None:
    payload = np.array([Shell(f"touch {tmp_path / 'marker'}")], dtype=object)
    np.savez(cache, ids=payload, lengths=payload, pad_id=0)


DAMAGES = {"cut short": _cut, "pickled arrays": _pickled}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_cache_that_is_not_whole_is_tokenised_again(tiny_bert, texts, tmp_path, capsys, damage):
    from transformers import AutoTokenizer
    tok, cache_dir = AutoTokenizer.from_pretrained(str(tiny_bert)), tmp_path / "cache"
    common.tokenize(tok, texts[:30], 16, cache_dir)                 # another cache, of other texts
    other = next(cache_dir.glob("tok-*.npz"))
    common.tokenize(tok, texts, 16, cache_dir)
    cache = next(p for p in cache_dir.glob("tok-*.npz") if p != other)
    DAMAGES[damage](cache, other, tmp_path)
    kept = other.read_bytes()
    capsys.readouterr()
    again = common.tokenize(tok, texts, 16, cache_dir)
    assert np.array_equal(again.ids, _fresh(tok, texts))
    assert f"note: the token cache {cache} is not whole" in capsys.readouterr().err
    assert not (tmp_path / "marker").exists(), "loading the cache ran the code it carries"
    assert other.read_bytes() == kept                                     # the other cache untouched
    assert np.array_equal(common.tokenize(tok, texts, 16, cache_dir).ids, again.ids)   # read back whole


def test_the_cache_is_written_through_write_atomic_and_leaves_no_temporary(tiny_bert, texts, tmp_path,
                                                                          monkeypatch):
    """The cache is written through atomic_writes.write_atomic (a temporary name of this process's,
    renamed over): a write that completes leaves one cache file and nothing beside it."""
    from transformers import AutoTokenizer

    from plumbing import inputs
    tok, cache_dir = AutoTokenizer.from_pretrained(str(tiny_bert)), tmp_path / "cache"
    written, write_atomic = [], inputs.write_atomic
    monkeypatch.setattr(inputs, "write_atomic", lambda path, write: (written.append(path),
                                                                     write_atomic(path, write)))
    common.tokenize(tok, texts, 16, cache_dir)
    assert written == list(cache_dir.glob("tok-*.npz")) and len(written) == 1
    assert not list(cache_dir.glob(".*"))


# the steps of a run that read --data and the STS sentences, in a process of their own: --data read,
# tokenised (through the cache) and encoded as the STS evaluation encodes (make_encode)
READ_AND_ENCODE = """
import sys
sys.path.insert(0, sys.argv[1])
import common
from plumbing import inputs
from transformers import AutoModel, AutoTokenizer
tok, enc = AutoTokenizer.from_pretrained(sys.argv[2]), AutoModel.from_pretrained(sys.argv[2])
texts = inputs.read_sentences(sys.argv[3])
common.tokenize(tok, texts, 32, sys.argv[4])
common.make_encode(enc, tok, "cls_before_pooler")(texts)
"""
# its peak memory (KB), measured from outside: the process that waited for it
PEAK = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def test_one_huge_line_costs_memory_of_its_size_not_of_its_tokens(tiny_bert, tiny_mt, texts, tmp_path):
    """A 50 MB line in --data, or among the STS sentences, is tokenised as at most 64 characters a
    token the model keeps (common.clip; a translation's source the same way): its run takes memory
    of the line's size (read, hashed for the cache), not the 7 GB its millions of tokens took."""
    words = " ".join(texts).split()
    huge = " ".join(words[i % len(words)] for i in range(9_000_000))[:50_000_000]     # one 50 MB line
    peaks = {}
    for name, lines in (("small", texts), ("huge", [*texts, huge])):
        data = tmp_path / f"{name}.txt"
        data.write_text("\n".join(lines) + "\n")
        for step, argv in (("read and encode", ["-c", READ_AND_ENCODE, str(ROOT), str(tiny_bert), str(data),
                                                str(tmp_path / name)]),
                           ("translate", [str(ROOT / "tools" / "translate.py"), "--data", str(data),
                                          "--mt_model", str(tiny_mt), "--out", str(data) + ".de"])):
            r = subprocess.run([sys.executable, "-c", PEAK, sys.executable, *argv], capture_output=True,
                               text=True, timeout=600, env=ENV)
            assert r.returncode == 0, r.stderr
            peaks[step, name] = int(r.stdout) / 1024                  # MB
    for step in ("read and encode", "translate"):    # 50 MB of text; unclipped, 7 GB more each
        assert peaks[step, "huge"] - peaks[step, "small"] < 250, peaks
