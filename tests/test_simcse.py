"""simcse.py: the two losses against per-row loops of the paper, and end-to-end runs on CPU."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import common
import simcse
from conftest import ROOT


def cos(a, b):
    return float(torch.dot(a, b) / (a.norm() * b.norm()))


def loop_unsup(h, h_pos, tau):
    """SimCSE Eq. (4), one anchor at a time."""
    n, total = h.shape[0], 0.0
    for i in range(n):
        num = math.exp(cos(h[i], h_pos[i]) / tau)
        den = sum(math.exp(cos(h[i], h_pos[j]) / tau) for j in range(n))
        total += -math.log(num / den)
    return total / n


def loop_sup(h, h_pos, h_neg, tau):
    """SimCSE Eq. (5), one anchor at a time."""
    n, total = h.shape[0], 0.0
    for i in range(n):
        num = math.exp(cos(h[i], h_pos[i]) / tau)
        den = sum(math.exp(cos(h[i], h_pos[j]) / tau) + math.exp(cos(h[i], h_neg[j]) / tau)
                  for j in range(n))
        total += -math.log(num / den)
    return total / n


@pytest.mark.parametrize("n,tau", [(7, 0.05), (3, 0.5), (1, 0.05)])
def test_simcse_loss_matches_per_row_loop(n, tau):
    g = torch.Generator().manual_seed(n)
    h, h_pos = torch.randn(n, 16, generator=g), torch.randn(n, 16, generator=g)
    got = simcse.simcse_loss(h, h_pos, tau)
    assert got.dim() == 0
    assert float(got) == pytest.approx(loop_unsup(h.double(), h_pos.double(), tau), rel=1e-5, abs=1e-6)


def test_simcse_loss_is_one_directional_and_handles_ties():
    g = torch.Generator().manual_seed(0)
    h, h_pos = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    # rows are anchors: swapping the roles changes the value (a transposed matrix is caught)
    assert float(simcse.simcse_loss(h, h_pos, 0.05)) != pytest.approx(float(simcse.simcse_loss(h_pos, h, 0.05)))
    # ties: a duplicated sentence in the batch is a negative as similar as the positive
    h[3], h_pos[3] = h[1], h_pos[1]
    assert float(simcse.simcse_loss(h, h_pos, 0.05)) == pytest.approx(loop_unsup(h.double(), h_pos.double(), 0.05), rel=1e-4)
    # a batch of one has only its positive: loss log(1) = 0
    assert float(simcse.simcse_loss(h[:1], h_pos[:1], 0.05)) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("n", [6, 1])
def test_simcse_sup_loss_matches_per_row_loop(n):
    g = torch.Generator().manual_seed(10 + n)
    h, h_pos, h_neg = (torch.randn(n, 16, generator=g) for _ in range(3))
    got = simcse.simcse_sup_loss(h, h_pos, h_neg, 0.05)
    assert got.dim() == 0
    assert float(got) == pytest.approx(loop_sup(h.double(), h_pos.double(), h_neg.double(), 0.05), rel=1e-5, abs=1e-6)
    # without the hard-negative columns it is Eq. (4) again, and strictly smaller
    assert float(got) > float(simcse.simcse_loss(h, h_pos, 0.05))


def _run(tmp_path, tiny_bert, data, sts_dir, cache_dir, *extra):
    argv = ["--model", str(tiny_bert), "--data", str(data), "--sts_dir", str(sts_dir),
            "--output_dir", str(tmp_path / "run"), "--cache_dir", str(cache_dir),
            "--max_steps", "4", "--eval_every", "2", "--batch_size", "8", "--log_every", "1", *extra]
    return simcse.main(argv)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]


def test_unsupervised_end_to_end(tmp_path, tiny_bert, corpus, small_sts, cache_dir):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer
    res = _run(tmp_path, tiny_bert, corpus, small_sts, cache_dir)
    run = tmp_path / "run"
    recs = _metrics(run)
    train = [r for r in recs if "loss" in r]
    evals = [r for r in recs if "stsb_dev" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and r["sent_per_s"] > 0 for r in train)
    assert train[0]["lr"] > train[-1]["lr"] == 0.0            # linear decay to 0
    assert [r["step"] for r in evals] == [2, 4] and all(0 < r["stsb_dev"] < 100 for r in evals)
    assert set(res["test"]) == set(common.STS_TASKS) | {"avg"}
    best = run / "best"
    assert json.loads((best / "args.json").read_text())["tau"] == 0.05
    assert json.loads((best / "test_metrics.json").read_text())["avg"] == pytest.approx(res["test"]["avg"])
    assert list(cache_dir.glob("tok-*.npz")), "tokens are cached in --cache_dir"
    # the checkpoint loads as a plain encoder and as a sentence-transformers model
    enc, tok = AutoModel.from_pretrained(best), AutoTokenizer.from_pretrained(best)
    sents = ["a man is playing a guitar .", "the cat sleeps ."]
    ours = common.make_encode(enc, tok, "cls_before_pooler")(sents)
    st = SentenceTransformer(str(best), device="cpu")
    assert np.allclose(st.encode(sents), ours, atol=1e-5)
    # and it scores what the run reported
    again = common.evaluate_sts(common.make_encode(enc, tok, "cls_before_pooler"), small_sts,
                                tasks=["STSBenchmark"], split="dev")
    assert again["STSBenchmark"]["spearman"] == pytest.approx(res["best_dev"], abs=0.01)


def test_training_sees_two_different_dropout_views(tmp_path, tiny_bert, corpus, small_sts,
                                                   cache_dir, monkeypatch):
    """from_pretrained() returns eval mode; training must switch dropout on, or the two views
    of unsupervised SimCSE are the same vector and the loss teaches nothing."""
    seen = []
    real = simcse.simcse_loss

    def spy(h, h_pos, tau):
        seen.append((h.detach().clone(), h_pos.detach().clone()))
        return real(h, h_pos, tau)

    monkeypatch.setattr(simcse, "simcse_loss", spy)
    _run(tmp_path, tiny_bert, corpus, small_sts, cache_dir, "--max_steps", "2")
    assert seen and all(not torch.allclose(h, hp) for h, hp in seen)


def test_supervised_columns_pad_with_the_models_pad_id():
    """sent0, sent1 and hard_neg of different widths go through one forward pass: the narrow
    ones are padded with the encoder's own pad id (RoBERTa's is 1), the mask with 0."""
    from types import SimpleNamespace

    class Recorder(torch.nn.Module):
        config = SimpleNamespace(hidden_size=4, pad_token_id=1)

        def forward(self, input_ids, attention_mask):
            self.seen = input_ids, attention_mask
            return SimpleNamespace(last_hidden_state=torch.randn(*input_ids.shape, 4))

    enc = Recorder()
    cols = {k: {"input_ids": torch.full((2, w), 7), "attention_mask": torch.ones(2, w, dtype=torch.long)}
            for k, w in [("sent0", 3), ("sent1", 5), ("hard_neg", 2)]}
    simcse.SimCSE(enc, 0.05, supervised=True)(cols)
    ids, mask = enc.seen
    assert ids.shape == (6, 5)
    assert ids[:2, 3:].eq(1).all() and ids[4:, 2:].eq(1).all() and ids[2:4].eq(7).all()
    assert mask.sum() == 2 * (3 + 5 + 2)


def test_roberta_end_to_end(tmp_path, corpus, small_sts, cache_dir):
    """RoBERTa (byte-level BPE, positions offset by the padding index) trains and saves too."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer
    from conftest import build_tiny_roberta
    rob = build_tiny_roberta(tmp_path / "rob", [corpus])
    res = _run(tmp_path, rob, corpus, small_sts, cache_dir)
    assert math.isfinite(res["best_dev"]) and set(res["test"]) == set(common.STS_TASKS) | {"avg"}
    best = tmp_path / "run" / "best"
    enc, tok = AutoModel.from_pretrained(best), AutoTokenizer.from_pretrained(best)
    sents = ["a man is playing a guitar .", "the cat sleeps ."]
    ours = common.make_encode(enc, tok, "cls_before_pooler")(sents)
    assert np.allclose(SentenceTransformer(str(best), device="cpu").encode(sents), ours, atol=1e-5)


def test_supervised_end_to_end_keeps_mlp(tmp_path, tiny_bert, nli_csv, small_sts, cache_dir):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer
    _run(tmp_path, tiny_bert, nli_csv, small_sts, cache_dir)
    run = tmp_path / "run"
    args = json.loads((run / "args.json").read_text())
    assert args["pooler"] == "cls" and args["lr"] == 5e-5 and args["epochs"] == 3   # CSV defaults
    assert args["batch_size"] == 8                                                # the flag wins
    best = run / "best"
    enc, tok = AutoModel.from_pretrained(best), AutoTokenizer.from_pretrained(best)
    sents = ["two women are embracing .", "the men are fighting outside a deli ."]
    b = tok(sents, padding=True, return_tensors="pt")
    with torch.no_grad():
        pooled = enc(**b).pooler_output.numpy()              # the MLP, as BERT's pooler
    st = SentenceTransformer(str(best), device="cpu")
    assert np.allclose(st.encode(sents), pooled, atol=1e-5)


@pytest.mark.parametrize("pooler,mlp", [("cls_before_pooler", True), ("cls", True),
                                        ("cls_before_pooler", False), ("avg_first_last", True)])
def test_table6_poolers_train_on_the_vector_the_row_names(tiny_bert, pooler, mlp):
    """SimCSE Tab. 6, one row a flag: "w/ MLP (train)" and "w/ MLP" train [CLS] through the MLP
    (they differ at evaluation); "w/o MLP" (--no_mlp) trains raw [CLS]; "First-last avg."
    trains the mean of the first and last layers, with no MLP."""
    tok, enc = common.load_encoder(str(tiny_bert))
    model = simcse.SimCSE(enc, 0.05, supervised=False, pooler=pooler, mlp=mlp).eval()
    ids = tok(["a man is playing a guitar .", "the cat sleeps on the mat ."], padding=True,
              return_tensors="pt")
    ids = {"input_ids": ids["input_ids"], "attention_mask": ids["attention_mask"]}
    with torch.no_grad():
        out = enc(**ids, output_hidden_states=True)
        got = model.embed(ids)
    cls = out.last_hidden_state[:, 0]
    m = ids["attention_mask"].unsqueeze(-1).float()
    first_last = ((out.hidden_states[1] + out.hidden_states[-1]) / 2 * m).sum(1) / m.sum(1)
    want = {("cls_before_pooler", True): None, ("cls", True): None,
            ("cls_before_pooler", False): cls, ("avg_first_last", True): first_last}[(pooler, mlp)]
    if want is None:
        assert model.mlp is not None and torch.allclose(got, model.mlp(cls), atol=1e-6)
    else:
        assert model.mlp is None and torch.allclose(got, want, atol=1e-5)
        assert not any("mlp" in k for k in model.state_dict())


@pytest.mark.parametrize("flags,pooler", [(["--no_mlp"], "cls_before_pooler"),
                                          (["--pooler", "avg_first_last"], "avg_first_last")])
def test_table6_rows_end_to_end(tmp_path, tiny_bert, corpus, small_sts, cache_dir, flags, pooler):
    from transformers import AutoModel, AutoTokenizer
    res = _run(tmp_path, tiny_bert, corpus, small_sts, cache_dir, "--max_steps", "2", *flags)
    best = tmp_path / "run" / "best"
    assert json.loads((best / "test_metrics.json").read_text())["pooler"] == pooler
    enc, tok = AutoModel.from_pretrained(best), AutoTokenizer.from_pretrained(best)
    again = common.evaluate_sts(common.make_encode(enc, tok, pooler), small_sts, tasks=["STSBenchmark"],
                                split="dev")
    assert again["STSBenchmark"]["spearman"] == pytest.approx(res["best_dev"], abs=0.01)


def test_no_mlp_with_the_cls_pooler_is_refused(tmp_path, tiny_bert, corpus, small_sts, cache_dir):
    with pytest.raises(common.UserError, match="--no_mlp with --pooler cls"):
        _run(tmp_path, tiny_bert, corpus, small_sts, cache_dir, "--no_mlp", "--pooler", "cls")
    assert not (tmp_path / "run").exists()


def test_resume_redoes_nothing_and_matches_uninterrupted(tmp_path, tiny_bert, corpus, small_sts,
                                                         cache_dir, monkeypatch):
    full = tmp_path / "full"
    full.mkdir()
    _run(full, tiny_bert, corpus, small_sts, cache_dir, "--max_steps", "6")
    ref = {r["step"]: r["loss"] for r in _metrics(full / "run") if "loss" in r}

    # kill the second run inside step 4 (after the checkpoint of step 2; step 3 is logged)
    real = common.make_step
    calls = {"n": 0}

    def dying(*a, **k):
        step = real(*a, **k)

        def wrapped(batch):
            calls["n"] += 1
            if calls["n"] == 4:
                raise KeyboardInterrupt
            return step(batch)
        return wrapped

    monkeypatch.setattr(common, "make_step", dying)
    part = tmp_path / "part"
    part.mkdir()
    with pytest.raises(KeyboardInterrupt):
        _run(part, tiny_bert, corpus, small_sts, cache_dir, "--max_steps", "6")
    monkeypatch.setattr(common, "make_step", real)
    with pytest.raises(common.UserError, match="already holds a run"):
        _run(part, tiny_bert, corpus, small_sts, cache_dir, "--max_steps", "6")
    assert [r["step"] for r in _metrics(part / "run") if "loss" in r] == [1, 2, 3]
    with open(part / "run" / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')                       # a line cut short by the kill
    _run(part, tiny_bert, corpus, small_sts, cache_dir, "--max_steps", "6", "--resume")
    # step 3 was trained again: the log holds it once, as if the run had not been interrupted
    assert [(r["step"], "loss" in r) for r in _metrics(part / "run")] == \
        [(r["step"], "loss" in r) for r in _metrics(full / "run")]
    got = {r["step"]: r["loss"] for r in _metrics(part / "run") if "loss" in r}
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for s in ref:
        assert got[s] == pytest.approx(ref[s], rel=1e-5), s


def test_nan_loss_stops_and_keeps_best(tmp_path, tiny_bert, corpus, small_sts, cache_dir, monkeypatch):
    real = simcse.simcse_loss
    calls = {"n": 0}

    def bad(h, h_pos, tau):
        calls["n"] += 1
        loss = real(h, h_pos, tau)
        return loss * float("nan") if calls["n"] >= 3 else loss

    monkeypatch.setattr(simcse, "simcse_loss", bad)
    with pytest.raises(common.UserError, match="NaN") as e:
        _run(tmp_path, tiny_bert, corpus, small_sts, cache_dir, "--max_steps", "6")
    assert "best checkpoint so far is kept" in str(e.value)
    assert (tmp_path / "run" / "best" / "config.json").exists()     # saved at step 2


def test_bad_inputs_are_clear_errors(tmp_path, tiny_bert, corpus, small_sts, cache_dir):
    with pytest.raises(common.UserError, match="no such file"):
        _run(tmp_path, tiny_bert, tmp_path / "missing.txt", small_sts, cache_dir)
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(common.UserError, match="no sentences"):
        _run(tmp_path / "e", tiny_bert, tmp_path / "empty.txt", small_sts, cache_dir)
    (tmp_path / "bad.txt").write_bytes(b"fine\n\xff\xfe broken\n")
    with pytest.raises(common.UserError, match="line 2 is not UTF-8"):
        _run(tmp_path / "b", tiny_bert, tmp_path / "bad.txt", small_sts, cache_dir)
    (tmp_path / "small.txt").write_text("one\ntwo\nthree\n")
    with pytest.raises(common.UserError, match="--batch_size 8 is larger than the data"):
        _run(tmp_path / "s", tiny_bert, tmp_path / "small.txt", small_sts, cache_dir)


def test_command_line_errors_exit_2_with_a_message(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "simcse.py"), "--bogus_flag", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unrecognized arguments: --bogus_flag" in r.stderr
    r = subprocess.run([sys.executable, str(ROOT / "simcse.py"), "--data", str(tmp_path / "nope.txt"),
                        "--output_dir", str(tmp_path / "o"), "--sts_dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "error: --data" in r.stderr and "no such file" in r.stderr
    assert "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, str(ROOT / "simcse.py"), "--help"], capture_output=True,
                       text=True, timeout=120)
    help_text = " ".join(r.stdout.split())       # argparse wraps the lines
    assert r.returncode == 0 and "--resume" in help_text
    assert "[SimCSE paper App. A]" in help_text and "[paper Tab. D.1]" in help_text   # shared and own flags
