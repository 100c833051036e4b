"""common.py: flags, data checks, the token cache, the STS evaluator, checkpoints (the downloads:
tests/test_download.py)."""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import SafetensorError
from scipy.stats import spearmanr

import common
from common import UserError, arg
from conftest import STS_KEPT_PAIRS, STS_TOTALS
from plumbing import (
    atomic_writes,
    errors,
    export,
    inputs,
    kept_rows,
    report,
    run_folder,
    sts_data,
)

# ------------------------------------------------------------------ flags


@dataclasses.dataclass
class _Args:
    data: str = arg("x.txt", "data file")
    batch_size: int = arg(64, "batch", "paper Tab. 1")
    lr: float = arg(3e-5, "lr", "official code")
    phi: list[float] = arg([0.01, 0.02], "values")
    flag: bool = arg(False, "a switch")
    on: bool = arg(True, "on by default")


def test_parse_args_types_lists_bools_and_csv_defaults():
    a = common.parse_args(_Args, ["--phi", "0.1", "0.2", "0.3", "--flag", "--no-on"])
    assert a.phi == [0.1, 0.2, 0.3] and a.flag is True and a.on is False
    assert a.batch_size == 64 and isinstance(a.lr, float)
    @dataclasses.dataclass
    class _CsvArgs(_Args):
        CSV_DEFAULTS: typing.ClassVar[dict] = {"batch_size": 512, "lr": 5e-5}

    b = common.parse_args(_CsvArgs, ["--data", "nli.csv"])
    assert (b.batch_size, b.lr) == (512, 5e-5)
    # a flag the user gave wins over the CSV default
    c = common.parse_args(_CsvArgs, ["--data", "nli.csv", "--batch_size", "8"])
    assert (c.batch_size, c.lr) == (8, 5e-5)
    d = common.parse_args(_CsvArgs, ["--data", "x.txt"])
    assert d.batch_size == 64


def test_help_shows_text_and_source(capsys):
    with pytest.raises(SystemExit):
        common.parse_args(_Args, ["--help"])
    out = capsys.readouterr().out
    assert "--batch_size" in out and "[paper Tab. 1]" in out and "[official code]" in out


def test_unknown_flag_is_an_error():
    with pytest.raises(UserError, match=r"^--bogus: no such flag\."):
        common.parse_args(_Args, ["--bogus", "1"])


# ------------------------------------------------------------------ data


def test_read_sentences_errors(tmp_path, capsys):
    with pytest.raises(UserError, match="no such file"):
        inputs.read_sentences(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserError, match="no sentences"):
        inputs.read_sentences(tmp_path / "empty.txt")
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    with pytest.raises(UserError, match="no sentences"):
        inputs.read_sentences(tmp_path / "blank.txt")
    (tmp_path / "latin.txt").write_bytes("ok line\nna\xefve caf\xe9\n".encode("latin-1"))
    with pytest.raises(UserError, match=r"line 2 is not UTF-8"):
        inputs.read_sentences(tmp_path / "latin.txt")
    (tmp_path / "gaps.txt").write_text("a b\n\nc d\n   \ne f\n")
    assert inputs.read_sentences(tmp_path / "gaps.txt") == ["a b", "c d", "e f"]
    assert "skipped 2 blank lines of 5" in capsys.readouterr().err


def test_read_csv_columns(tmp_path):
    p = tmp_path / "nli.csv"
    p.write_text('sent0,sent1,hard_neg\n"a, b",c,d\ne,f,\ng,h,i\n')
    cols = common.load_columns(p)
    assert cols == {"sent0": ["a, b", "g"], "sent1": ["c", "h"], "hard_neg": ["d", "i"]}
    p.write_text("premise,hypothesis\nx,y\n")
    with pytest.raises(UserError, match="header"):
        common.load_columns(p)


def test_a_file_is_read_once_until_it_changes(tmp_path, monkeypatch):
    """read_once: the checks and the script read the same files (--data, IFCL's German file);
    a later call for an unchanged file returns the first call's result, a changed file is read
    again."""
    reads, real = [], Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: reads.append(self.name) or real(self))
    txt, pairs = tmp_path / "s.txt", tmp_path / "p.csv"
    txt.write_text("a b\nc d\n")
    pairs.write_text("sent0,sent1\nx,y\n")
    first = inputs.read_sentences(txt)
    assert common.load_columns(txt)["text"] is first and len(inputs.read_columns(txt)["text"]) == 2
    assert common.load_columns(pairs) == common.load_columns(pairs) == {"sent0": ["x"], "sent1": ["y"]}
    assert reads == ["s.txt", "p.csv"]
    txt.write_text("a b\nc d\ne f\n")
    assert len(inputs.read_columns(txt)["text"]) == 3 and reads == ["s.txt", "p.csv", "s.txt"]


def ref_plain(tok):
    return tok.backend_tokenizer.encode("a b c").ids


def test_tokenize_pads_counts_and_caches(tiny_bert, tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_bert)
    texts = ["the cat sat on the mat .", "a", "one two three four five six seven eight nine ten"]
    t = common.tokenize(tok, texts, 8, tmp_path)
    ref = tok(texts, truncation=True, max_length=8)["input_ids"]
    assert t.ids.shape == (3, 8) and t.ids.dtype == np.uint16
    for i, r in enumerate(ref):
        assert t.lengths[i] == len(r) and t.ids[i, :len(r)].tolist() == r
        assert (t.ids[i, len(r):] == tok.pad_token_id).all()
    b = t.batch(np.array([1, 0]))
    assert b["input_ids"].shape == (2, max(len(ref[0]), len(ref[1])))
    assert b["attention_mask"].sum(1).tolist() == [len(ref[1]), len(ref[0])]
    assert t.batch(np.array([1]), pad_to=8)["input_ids"].shape == (1, 8)
    assert tok.truncation_side == "right" and tok("a b c")["input_ids"] == ref_plain(tok)  # untouched
    files = list(tmp_path.glob("tok-*.npz"))
    assert len(files) == 1
    t2 = common.tokenize(tok, texts, 8, tmp_path)   # served from the cache
    assert np.array_equal(t2.ids, t.ids) and len(list(tmp_path.glob("tok-*.npz"))) == 1
    common.tokenize(tok, texts, 6, tmp_path)         # another max_len is another key
    common.tokenize(tok, texts[:2], 8, tmp_path)     # other content is another key
    assert len(list(tmp_path.glob("tok-*.npz"))) == 3


def test_token_cache_written_by_two_ranks_at_once(tiny_bert, tmp_path, monkeypatch):
    """Under torchrun every rank tokenises and writes the same cache file: another process
    finishing its write while this one writes must leave both runs going (each writes a
    temporary file of its own, then renames it into place)."""
    from transformers import AutoTokenizer
    tok, texts = AutoTokenizer.from_pretrained(tiny_bert), ["one line", "another line"]
    real_savez, other_rank_done = np.savez, []

    def savez_while_another_rank_writes(path, **arrays):
        real_savez(path, **arrays)
        if not other_rank_done:
            other_rank_done.append(True)
            with monkeypatch.context() as m:               # the other rank, whole, in between
                m.setattr(inputs.os, "getpid", lambda: 999_999)
                common.tokenize(tok, texts, 8, tmp_path)

    monkeypatch.setattr(inputs.np, "savez", savez_while_another_rank_writes)
    t = common.tokenize(tok, texts, 8, tmp_path)
    assert other_rank_done and t.lengths.tolist() == [len(tok(s)["input_ids"]) for s in texts]
    assert [p.name.startswith("tok-") for p in tmp_path.iterdir()] == [True]   # no temporary left


def test_batch_plan_and_batch_size_checks():
    p0, p1 = common.batch_plan(10, 3, seed=1, epoch=0), common.batch_plan(10, 3, seed=1, epoch=1)
    assert p0.shape == (3, 3) and len(set(p0.ravel())) == 9
    assert not np.array_equal(p0, p1)
    assert np.array_equal(p0, common.batch_plan(10, 3, seed=1, epoch=0))
    with pytest.raises(UserError, match="larger than the data"):
        inputs.check_batch(5, 8, "x.txt")
    with pytest.raises(UserError, match="divide evenly over 2 GPUs"):
        inputs.check_batch(9, 5, "x.txt", world_size=2)


def test_concat_batches_pads_to_widest():
    a = {k: torch.ones(2, 3, dtype=torch.long) for k in ("input_ids", "attention_mask")}
    b = {k: torch.ones(2, 5, dtype=torch.long) for k in ("input_ids", "attention_mask")}
    c = common.concat_batches([a, b])
    assert c["input_ids"].shape == (4, 5) and c["attention_mask"][:2, 3:].sum() == 0
    r = common.concat_batches([a, b], pad_id=1)       # RoBERTa's <pad>; the mask still pads with 0
    assert (r["input_ids"][:2, 3:] == 1).all() and r["attention_mask"][:2, 3:].sum() == 0
    assert common.pad_batch(a, 3, 7)["input_ids"].equal(a["input_ids"])   # already wide enough


# ------------------------------------------------------------------ STS evaluator


def _write_fixture(root: Path) -> dict:
    """A tiny SentEval layout. Every sentence is 'w<k> ...' and encodes to a vector whose cosine
    with its partner we choose, so the expected Spearman is computed independently."""
    sts = root / "STS"
    gold_by_task = {}
    for task, subs in common.STS_SUBSETS.items():
        folder = sts / f"STS{task[3:]}-en-test"
        folder.mkdir(parents=True)
        gold_by_task[task] = {}
        for si, sub in enumerate(subs):
            rng = np.random.default_rng(hash((task, sub)) % 2**32)
            n = 6 + si
            gold = [f"{g:.1f}" for g in rng.uniform(0, 5, n)]
            gold[1] = ""  # an unannotated pair: dropped
            lines = [f"{task} {sub}  a{i}\t{task} {sub} b{i} " for i in range(n)]
            (folder / f"STS.input.{sub}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
            (folder / f"STS.gs.{sub}.txt").write_text("\n".join(gold) + "\n", encoding="utf-8")
            gold_by_task[task][sub] = gold
    (sts / "STSBenchmark").mkdir()
    for split, n in (("train", 4), ("dev", 5), ("test", 7)):
        rows = [f"g\tsrc\tyr\t{i:04d}\t{(i * 7) % 5 + 0.5}\tstsb {split} a{i}\tstsb {split} b{i}\textra"
                for i in range(n)]
        (sts / "STSBenchmark" / f"sts-{split}.csv").write_text("\n".join(rows) + "\n")
    (root / "SICK").mkdir()
    for name, n in (("SICK_train.txt", 3), ("SICK_trial.txt", 4), ("SICK_test_annotated.txt", 6)):
        rows = ["pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment"]
        rows += [f"{i}\tsick {name} a{i}\tsick {name} b{i}\t{1 + (i * 3) % 4}.5\tNEUTRAL" for i in range(n)]
        (root / "SICK" / name).write_text("\n".join(rows) + "\n")
    return gold_by_task


def _angle(s: str) -> float:
    """A deterministic pseudo-random angle for a pair key."""
    return (sum(map(ord, s)) * 0.37) % 1.5


def _fixture_encode(sentences, on_batch=None):
    """a<i> -> (1, 0); b<i> -> (cos t, sin t) with t from the pair's key, so cos = cos t.
    Sentences whose key ends in 'a0' of SICK trial encode to zero (similarity 0, not NaN)."""
    out = []
    for s in sentences:
        assert "  " not in s and s == s.strip(), "sentences are whitespace-normalised"
        *key, last = s.split()
        if last.startswith("a"):
            out.append([0.0, 0.0] if s == "sick SICK_trial.txt a0" else [1.0, 0.0])
        else:
            t = _angle(" ".join(key) + " " + last[1:])
            out.append([np.cos(t), np.sin(t)])
    return np.array(out)


def test_evaluator_on_synthetic_fixture(tmp_path):
    gold = _write_fixture(tmp_path)
    res = common.evaluate_sts(_fixture_encode, tmp_path)
    for task, subs in common.STS_SUBSETS.items():
        sims_all, gold_all, per = [], [], []
        for sub in subs:
            g = gold[task][sub]
            keep = [i for i, x in enumerate(g) if x != ""]
            sims = [np.cos(_angle(f"{task} {sub} {i}")) for i in keep]
            gs = [float(g[i]) for i in keep]
            r = spearmanr(sims, gs)[0] * 100
            assert res[task]["subsets"][sub]["spearman"] == pytest.approx(r)
            assert res[task]["subsets"][sub]["n"] == len(keep)
            per.append((r, len(keep)))
            sims_all += sims
            gold_all += gs
        assert res[task]["spearman"] == pytest.approx(spearmanr(sims_all, gold_all)[0] * 100)
        assert res[task]["mean"] == pytest.approx(np.mean([r for r, _ in per]))
        assert res[task]["wmean"] == pytest.approx(sum(r * n for r, n in per) / sum(n for _, n in per))
        assert res[task]["n"] == len(gold_all)
    # STS-B test: gold column 4, sentences 5 and 6, the trailing column ignored
    sims = [np.cos(_angle(f"stsb test {i}")) for i in range(7)]
    gs = [(i * 7) % 5 + 0.5 for i in range(7)]
    assert res["STSBenchmark"]["spearman"] == pytest.approx(spearmanr(sims, gs)[0] * 100)
    assert res["STSBenchmark"]["n"] == 7 and res["SICKRelatedness"]["n"] == 6
    assert res["avg"] == pytest.approx(np.mean([res[t]["spearman"] for t in common.STS_TASKS]))
    dev = common.evaluate_sts(_fixture_encode, tmp_path, split="dev")
    assert set(dev) == {"STSBenchmark", "SICKRelatedness", "avg"}
    assert dev["STSBenchmark"]["n"] == 5 and dev["SICKRelatedness"]["n"] == 4
    # the zero vector of SICK trial pair 0 gives similarity 0, not NaN
    sims = [0.0] + [np.cos(_angle(f"sick SICK_trial.txt {i}")) for i in range(1, 4)]
    gs = [1 + (i * 3) % 4 + 0.5 for i in range(4)]
    assert dev["SICKRelatedness"]["spearman"] == pytest.approx(spearmanr(sims, gs)[0] * 100)


def test_cosine_rows_zero_vector():
    u = np.array([[0.0, 0.0], [1.0, 0.0], [1.0, 1.0]])
    v = np.array([[1.0, 0.0], [0.0, 0.0], [2.0, 2.0]])
    assert common.cosine_rows(u, v).tolist() == pytest.approx([0.0, 0.0, 1.0])


def test_evaluator_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="STS/ and SICK/"):
        common.evaluate_sts(_fixture_encode, tmp_path / "nope")


def test_real_sts_pair_counts(real_sts):
    """The real data against the protocol's table of kept pairs (conftest.STS_KEPT_PAIRS), a
    subset at a time, and sts_data.STS_PAIR_COUNTS against both."""
    for task in common.STS_SUBSETS:
        subs = common.load_sts_pairs(real_sts, task)
        assert [len(g) for _, _, g in subs.values()] == sts_data.STS_PAIR_COUNTS[task]
        assert {k: len(v[2]) for k, v in subs.items()} == STS_KEPT_PAIRS[task]
        assert sum(len(g) for _, _, g in subs.values()) == STS_TOTALS[task]
    for task in ("STSBenchmark", "SICKRelatedness"):
        for split in ("train", "dev", "test"):
            assert len(common.load_sts_pairs(real_sts, task, split)[split][2]) == STS_KEPT_PAIRS[task][split]
    sts_data.check_sts(real_sts)


def test_alignment_uniformity_definition(tmp_path):
    _write_fixture(tmp_path)
    rng = np.random.default_rng(0)
    table = {}

    def enc(sents, on_batch=None):
        return np.stack([table.setdefault(s, rng.normal(size=4)) for s in sents])

    r = common.alignment_uniformity(enc, tmp_path, split="test")
    a, b, gold = common.load_sts_pairs(tmp_path, "STSBenchmark", "test")["test"]
    f = {s: v / np.linalg.norm(v) for s, v in table.items()}
    align = np.mean([np.sum((f[x] - f[y]) ** 2) for x, y, g in zip(a, b, gold) if g > 4])
    sents = sorted(set(a) | set(b))
    d = [np.sum((f[x] - f[y]) ** 2) for i, x in enumerate(sents) for y in sents[i + 1:]]
    assert r["alignment"] == pytest.approx(align)
    assert r["uniformity"] == pytest.approx(np.log(np.mean(np.exp(-2 * np.array(d)))))


def test_minilm_avg_matches_mteb(real_sts, minilm):
    """An external check: all-MiniLM-L6-v2 with avg pooling against its MTEB figures."""
    tok, enc = common.load_encoder(str(minilm))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tasks = ["STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark"]
    res = common.evaluate_sts(common.make_encode(enc, tok, "avg"), real_sts, tasks=tasks)
    mteb = {"STS12": 72.37, "STS13": 80.60, "STS14": 75.59, "STS15": 85.39, "STS16": 78.99,
            "STSBenchmark": 82.03}
    for t, v in mteb.items():
        assert abs(res[t]["spearman"] - v) < 0.05, (t, res[t]["spearman"], v)


# ------------------------------------------------------------------ checkpoints


def test_atomic_dir_keeps_old_until_commit_and_recovers(tmp_path):
    final = tmp_path / "best"
    final.mkdir()
    (final / "v").write_text("old")
    with atomic_writes.atomic_dir(final) as tmp:
        (tmp / "v").write_text("new")
        assert (final / "v").read_text() == "old"     # a kill here leaves the old folder whole
    assert (final / "v").read_text() == "new" and not list(tmp_path.glob(".best*"))
    # a kill between the two renames: only .best.old is there; recover_dir restores it
    final.rename(tmp_path / ".best.old")
    assert (atomic_writes.recover_dir(final) / "v").read_text() == "new"
    # a kill before the swap: the temporary folder (a full copy) is dropped, best/ stays
    tmp = tmp_path / ".best.tmp-killed"
    tmp.mkdir()
    (tmp / "v").write_text("newer")
    assert (atomic_writes.recover_dir(final) / "v").read_text() == "new" and not tmp.exists()


# what the libraries raise for a write the system refused (seen on a full tmpfs, under `ulimit -f`,
# on a read-only mount): (the error, what it was raised while handling, the system's words told)
TORCH_POS = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
LIBRARY_WRITE_ERRORS = {
    "torch.save to a path": (RuntimeError(TORCH_POS), RuntimeError("basic_ios::clear: iostream error"),
                             "an I/O error (the library did not say which)"),
    "torch.save to a file": (RuntimeError(TORCH_POS), OSError(27, "File too large"), "File too large"),
    "safetensors": (SafetensorError("Error while serializing: I/O error: Read-only file system (os error 30) "
                                    "at path \"/x/.tmpN8NdUJ\""), None, "Read-only file system"),
    "the tokenizer": (Exception("No space left on device (os error 28)"), None, "No space left on device"),
}


@pytest.mark.parametrize("library", list(LIBRARY_WRITE_ERRORS))
def test_a_library_s_own_error_for_a_refused_write_is_a_failed_write(library):
    e, context, reason = LIBRARY_WRITE_ERRORS[library]
    with pytest.raises(errors.WriteFailed, match=rf"^could not write best: {re.escape(reason)}\. kept; "):
        with errors.writing("best", "kept"):
            try:
                if context is not None:
                    raise context
            finally:
                raise e


@pytest.mark.parametrize("bug", [RuntimeError("The size of tensor a (4) must match the size of tensor b (3)"),
                                 ValueError("pooler 'cls' is saved with its MLP"), KeyError("model")])
def test_a_bug_inside_a_write_keeps_its_traceback(bug):
    with pytest.raises(type(bug)):
        with errors.writing("best", "kept"):
            raise bug


def test_output_dir_guard(tmp_path, corpus):
    """RunFolder.open: a --resume of nothing is refused and makes nothing; a new folder is made,
    held and recorded; a second start there is refused; a run stopped before its first checkpoint
    resumes (train() starts it from step 0)."""
    import simcse
    out = tmp_path / "run"

    def opened(resume: bool) -> run_folder.RunFolder:
        run = run_folder.RunFolder.named(simcse.Args(data=str(corpus), output_dir=str(out), resume=resume))
        try:
            run.open()
        finally:
            run.release()
        return run
    with pytest.raises(UserError, match="--resume: no run in .* to continue"):
        opened(True)
    assert not out.exists()
    assert opened(False).record["script"] == "simcse.py"
    assert sorted(p.name for p in out.iterdir()) == ["args.json", "code", "run.json", "run.lock"]
    with pytest.raises(UserError, match="already holds a run. Add --resume"):
        opened(False)
    assert opened(True).record["code"] == json.loads((out / "run.json").read_text())["code"]


@pytest.mark.parametrize("pooler", ["cls_before_pooler", "avg", "cls"])
def test_checkpoint_loads_in_automodel_and_sentence_transformers(tiny_bert, tmp_path, pooler):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer
    tok, enc = common.load_encoder(str(tiny_bert))
    torch.manual_seed(0)
    mlp = common.MLP(enc.config.hidden_size) if pooler == "cls" else None
    export.save_pretrained_dir(tmp_path / "ckpt", enc, tok, pooler, mlp, extra={"x.json": {"a": 1}})
    sents = ["the cat sat on the mat .", "a short one", "yet another sentence , longer than the rest ."]
    ours = common.make_encode(enc, tok, pooler, mlp)(sents)
    back = AutoModel.from_pretrained(tmp_path / "ckpt")
    tok2 = AutoTokenizer.from_pretrained(tmp_path / "ckpt")
    if pooler == "cls":   # the MLP is BERT's own pooler in the saved model
        b = tok2(sents, padding=True, return_tensors="pt")
        with torch.no_grad():
            po = back(**b).pooler_output.numpy()
        assert np.allclose(po, ours, atol=1e-5)
    st = SentenceTransformer(str(tmp_path / "ckpt"), device="cpu")
    assert np.allclose(st.encode(sents, convert_to_numpy=True), ours, atol=1e-5)
    assert json.loads((tmp_path / "ckpt" / "x.json").read_text()) == {"a": 1}


@pytest.mark.parametrize("arch,pooler", [("bert", "cls"), ("roberta", "avg")])
def test_checkpoint_is_what_sentence_transformers_itself_writes(tiny_bert, corpus, tmp_path, arch, pooler):
    """The folder holds what sentence-transformers' own save() writes, in the schema of the version
    installed, not an older one it reads through its compatibility code: loaded and saved again, every
    JSON file is the same (modules.json, config_sentence_transformers.json, each module's config).
    Its length limit is the encoder's positions (RoBERTa's: 2 fewer than its table)."""
    from sentence_transformers import SentenceTransformer

    from conftest import build_tiny_roberta
    model = tiny_bert if arch == "bert" else build_tiny_roberta(tmp_path / "rob", [corpus])
    tok, enc = common.load_encoder(str(model))
    mlp = common.MLP(enc.config.hidden_size) if pooler == "cls" else None
    export.save_pretrained_dir(tmp_path / "ckpt", enc, tok, pooler, mlp)
    st = SentenceTransformer(str(tmp_path / "ckpt"), device="cpu")
    st.save(str(tmp_path / "again"), create_model_card=False)
    ours, again = ({p.relative_to(d).as_posix(): json.loads(p.read_text()) for p in d.rglob("*.json")}
                   for d in (tmp_path / "ckpt", tmp_path / "again"))
    assert "config_sentence_transformers.json" in again
    assert ours == again, [name for name in sorted(ours | again) if ours.get(name) != again.get(name)]
    assert st.max_seq_length == inputs.max_positions(enc.config) == 256   # RoBERTa: 258 in its table
    assert "SentenceTransformer(" in export.what_next(tmp_path / "ckpt", str(model), pooler, "data/sts")


def test_a_pooler_sentence_transformers_has_no_module_for_saves_for_transformers(tiny_bert, tmp_path, capsys):
    from transformers import AutoModel
    tok, enc = common.load_encoder(str(tiny_bert))
    folder = tmp_path / "ckpt"
    export.save_pretrained_dir(folder, enc, tok, "avg_first_last", extra={"x.json": {"a": 1}})
    assert "sentence-transformers has no 'avg_first_last' pooling" in capsys.readouterr().err
    assert not (folder / "modules.json").exists() and json.loads((folder / "x.json").read_text()) == {"a": 1}
    AutoModel.from_pretrained(folder)
    assert "AutoModel.from_pretrained" in export.what_next(folder, "m", "avg_first_last", "data/sts")


def test_ctrl_c_says_how_to_continue(capsys):
    def main(argv):
        raise KeyboardInterrupt
    with pytest.raises(SystemExit) as e:
        common.run_main(main, [])
    assert e.value.code == 130 and "--resume" in capsys.readouterr().err


# ------------------------------------------------------------------ the house
# (its shape, the lengths and caps, is `python tools/check_house.py`, not a test: tests/test_check_house.py)

def test_common_is_a_module_not_a_command():
    """common.py has no command line: no `if __name__ == "__main__":`, no cli(), no argument
    dataclasses of commands (evaluation and download are tools/eval.py and tools/download.py),
    and which paper rows a run's flags select is plumbing.flags.select_rows."""
    import ast

    from conftest import ROOT
    from plumbing import flags
    tree = ast.parse((ROOT / "common.py").read_text(encoding="utf-8"))
    mains = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert mains == []
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert not defined & {"cli", "EvalArgs", "DownloadArgs", "select_rows", "_same"}, defined
    assert not hasattr(common, "ROW_FREE") and flags.ROW_FREE
    assert report.select_rows is flags.select_rows            # what report.final calls


def test_no_text_a_user_reads_names_python_common_py():
    """README, docs/, the scripts, common.py, plumbing/, tools/ and the tests' skip reasons (their --help,
    docstrings, comments and errors) name `python tools/eval.py` and `python tools/download.py`, never the old
    `python common.py eval | download`."""
    from conftest import ROOT
    files = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("*.py"), *ROOT.glob("plumbing/*.py"),
             *ROOT.glob("tools/*.py"), ROOT / "tests" / "conftest.py"]      # conftest: its skip reasons
    hits = [f"{f.relative_to(ROOT)}:{n}: {line.strip()}" for f in files
            for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
            if re.search(r"python common\.py", line)]
    assert len(files) > 20 and not hits, "\n".join(hits)


def _import_graph() -> dict[str, list[str]]:
    """Each file of the house (scripts, common, plumbing/, tools/) -> the files of it that it imports."""
    import ast

    from conftest import ROOT
    files = {p.stem: p for p in ROOT.glob("*.py")}
    files |= {f"plumbing.{p.stem}": p for p in (ROOT / "plumbing").glob("*.py") if p.stem != "__init__"}
    files |= {f"tools.{p.stem}": p for p in (ROOT / "tools").glob("*.py") if p.stem != "__init__"}
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module:
                found |= {n.module} | {f"{n.module}.{a.name}" for a in n.names}
        graph[name] = sorted(found & set(files))
    return graph


def test_the_house_has_no_import_circle():
    """Arrows run one way, down: tools/ over the method scripts, the scripts over common.py,
    common.py over plumbing/. common imports no script or tool; plumbing/ imports nothing above
    it; no method script imports another or a tool; no two files import each other, directly or
    through others."""
    graph = _import_graph()
    methods = {"simcse", "focal_infonce", "ifcl", "conisi", "rcl"}
    assert all(m.startswith("plumbing.") for m in graph["common"]), graph["common"]
    assert all(m.startswith("plumbing.") for p in graph if p.startswith("plumbing.") for m in graph[p]), graph
    assert all(not {x for x in graph[m] if x in methods or x.startswith("tools.")} for m in methods), graph

    def reach(start, seen):
        for nxt in graph[start]:
            if nxt not in seen:
                seen.add(nxt)
                reach(nxt, seen)
        return seen
    circles = [n for n in graph if n in reach(n, set())]
    assert circles == [], graph


# ------------------------------------------------------------- evaluation done once; the untrained row kept

def _encode_as_at_664f320(encoder, tokenizer, pooler: str, batch_size: int = 128):
    """make_encode as it was before it tokenised with the Rust tokenizer and each list once."""
    @torch.no_grad()
    def encode(sentences, on_batch=lambda k: None):
        encoder.eval()
        limit = inputs.max_positions(encoder.config, tokenizer)
        ids = tokenizer(common.clip(sentences, limit), truncation=True, max_length=limit,
                        return_attention_mask=False, return_token_type_ids=False)["input_ids"]
        order = np.argsort([len(x) for x in ids], kind="stable")
        out = np.zeros((len(sentences), encoder.config.hidden_size), np.float32)
        for s in range(0, len(order), batch_size):
            rows = order[s:s + batch_size]
            batch = tokenizer.pad({"input_ids": [ids[i] for i in rows]}, return_tensors="pt")
            out[rows] = common.pool(encoder(**batch), batch["attention_mask"], pooler).numpy()
        return out
    return encode


def _counting(encode, counts: list):
    def counted(sentences, on_batch=lambda k: None):
        counts.append(len(sentences))
        return encode(sentences, on_batch)
    return counted


def test_encode_gives_the_earlier_path_embeddings_bit_for_bit(tiny_bert, small_sts):
    """The Rust tokenizer called directly gives tokenizer(...)'s ids, and the embeddings are those of
    the path before it, to the bit; asked twice, the same list is tokenised once."""
    tok, enc = common.load_encoder(str(tiny_bert))
    a, b, _ = common.load_sts_pairs(small_sts, "STSBenchmark", "test")["test"]
    sents = sorted(set(a) | set(b)) + ["x " * 3000, "ünïcödé ﬁ  spaces\there", ""]
    new = common.make_encode(enc, tok, "avg", batch_size=16)
    assert np.array_equal(new(sents), _encode_as_at_664f320(enc, tok, "avg", 16)(sents))
    assert np.array_equal(new(sents), new(sents))


def test_final_figures_encode_sts_b_test_once_with_the_same_figures(tiny_bert, small_sts):
    """Alignment and uniformity read the STS-B test embeddings the 7 tasks computed: the figures
    are those of encoding them again, to the bit, and STS-B test is encoded once."""
    tok, enc = common.load_encoder(str(tiny_bert))
    encode = common.make_encode(enc, tok, "cls_before_pooler")
    old = {**common.evaluate_sts(encode, small_sts), **common.alignment_uniformity(encode, small_sts)}
    counts = []
    new = common.final_figures(_counting(encode, counts), small_sts, "final")
    assert new == old
    a, b, _ = common.load_sts_pairs(small_sts, "STSBenchmark", "test")["test"]
    assert len(counts) == 7 and sum(counts) == sum(
        len({s for x, y, _ in common.load_sts_pairs(small_sts, t, "test").values() for s in x + y})
        for t in common.STS_TASKS)


def _untrained(model, sts, cache, pooler="avg"):
    import types
    args = types.SimpleNamespace(model=str(model), sts_dir=str(sts), cache_dir=str(cache))
    return kept_rows.untrained(args, pooler, common.saved_figures)


@pytest.fixture
def evaluations(monkeypatch):
    """How many times the untrained encoder was evaluated (final_figures called)."""
    calls = []
    real = common.final_figures
    monkeypatch.setattr(common, "final_figures", lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


def test_the_untrained_row_is_kept_and_reused_by_the_weights_not_the_name(tiny_bert, small_sts, tmp_path,
                                                                        evaluations, capsys):
    first = _untrained(tiny_bert, small_sts, tmp_path / "c")
    kept = Path(first["kept_in"])
    assert kept.parent == tmp_path / "c" and kept.name.startswith("untrained-") and not first["reused"]
    copy = tmp_path / "elsewhere" / "renamed"          # the same files under another name: reused
    import shutil
    shutil.copytree(tiny_bert, copy)
    again = _untrained(copy, small_sts, tmp_path / "c")
    assert len(evaluations) == 1 and again["reused"] and again["kept_in"] == str(kept)
    assert {k: again[k] for k in (*common.STS_TASKS, "avg", "alignment", "uniformity")} == \
        {k: first[k] for k in (*common.STS_TASKS, "avg", "alignment", "uniformity")}
    assert again["model"] == str(copy) and again["label"] == "untrained renamed [avg]"
    shown = report.paper_report(first, [], "", None, again)
    assert f"(untrained renamed [avg]: kept from an earlier run of the same weights, pooler, STS data and " \
           f"evaluation code: {kept})" in shown
    assert "evaluated now, kept for the next run of this model in" in report.paper_report(first, [], "", None,
                                                                                           first)


def test_the_untrained_row_is_evaluated_again_when_what_made_it_differs(tiny_bert, small_sts, tmp_path,
                                                                       evaluations, monkeypatch):
    import shutil

    from safetensors.torch import load_file, save_file
    _untrained(tiny_bert, small_sts, tmp_path / "c")
    assert _untrained(tiny_bert, small_sts, tmp_path / "c")["reused"] and len(evaluations) == 1
    assert not _untrained(tiny_bert, small_sts, tmp_path / "c", pooler="cls_before_pooler")["reused"]
    assert len(evaluations) == 2
    other = tmp_path / "other"                          # one weight changed, the name kept
    shutil.copytree(tiny_bert, other)
    weights = load_file(other / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 1e-3
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    assert not _untrained(other, small_sts, tmp_path / "c")["reused"] and len(evaluations) == 3
    monkeypatch.setattr(kept_rows, "EVAL_CODE", "an edited common.py")
    assert not _untrained(tiny_bert, small_sts, tmp_path / "c")["reused"] and len(evaluations) == 4


@pytest.mark.parametrize("damage", ["truncated", "not json", "a list"])
def test_a_damaged_kept_row_is_evaluated_again_never_trusted(tiny_bert, small_sts, tmp_path, evaluations,
                                                            capsys, damage):
    first = _untrained(tiny_bert, small_sts, tmp_path / "c")
    path = Path(first["kept_in"])
    text = path.read_text()
    path.write_text({"truncated": text[:len(text) // 2],
                     "not json": "\x00\xff garbage", "a list": "[1, 2]"}[damage])
    assert path.read_text() != text
    again = _untrained(tiny_bert, small_sts, tmp_path / "c")
    assert len(evaluations) == 2 and not again["reused"] and again["avg"] == first["avg"]
    assert f"note: {path}: damaged; the untrained row is evaluated again" in capsys.readouterr().err
    assert json.loads(path.read_text()) == json.loads(text)           # written whole again
