"""simcse.py: the two losses against per-row loops of the paper, and end-to-end runs on CPU."""

from __future__ import annotations

import copy
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import common
import simcse
from conftest import ROOT, assert_matches_paper
from plumbing import flags


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
    assert_matches_paper(got, loop_unsup(h.double(), h_pos.double(), tau), "simcse_loss", "SimCSE Eq. (4)",
                         rel=1e-5, abs=1e-6)


def test_simcse_loss_is_one_directional_and_handles_ties():
    g = torch.Generator().manual_seed(0)
    h, h_pos = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    # rows are anchors: swapping the roles changes the value (a transposed matrix is caught)
    swapped = float(simcse.simcse_loss(h_pos, h, 0.05))
    assert float(simcse.simcse_loss(h, h_pos, 0.05)) != pytest.approx(swapped)
    # ties: a duplicated sentence in the batch is a negative as similar as the positive
    h[3], h_pos[3] = h[1], h_pos[1]
    want = loop_unsup(h.double(), h_pos.double(), 0.05)
    assert_matches_paper(simcse.simcse_loss(h, h_pos, 0.05), want, "simcse_loss", "SimCSE Eq. (4)", rel=1e-4,
                         reference="the paper's per-row loop, with a duplicated sentence")
    # a batch of one has only its positive: loss log(1) = 0
    assert_matches_paper(simcse.simcse_loss(h[:1], h_pos[:1], 0.05), 0.0, "simcse_loss", "SimCSE Eq. (4)",
                         abs=1e-6, reference="a batch of one: -log 1")


@pytest.mark.parametrize("n", [6, 1])
def test_simcse_sup_loss_matches_per_row_loop(n):
    g = torch.Generator().manual_seed(10 + n)
    h, h_pos, h_neg = (torch.randn(n, 16, generator=g) for _ in range(3))
    got = simcse.simcse_sup_loss(h, h_pos, h_neg, 0.05)
    assert got.dim() == 0
    want = loop_sup(h.double(), h_pos.double(), h_neg.double(), 0.05)
    assert_matches_paper(got, want, "simcse_sup_loss", "SimCSE Eq. (5)", rel=1e-5, abs=1e-6)
    # without the hard-negative columns it is Eq. (4) again, and strictly smaller
    assert float(got) > float(simcse.simcse_loss(h, h_pos, 0.05))


def _run(tmp_path, tiny_bert, data, sts_dir, cache_dir, *extra):
    argv = ["--model", str(tiny_bert), "--data", str(data), "--sts_dir", str(sts_dir),
            "--output_dir", str(tmp_path / "run"), "--cache_dir", str(cache_dir),
            "--max_steps", "4", "--eval_every", "2", "--batch_size", "8", "--log_every", "1", *extra]
    return simcse.main(argv)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_mlp_starts_as_the_official_codes():
    """common.MLP as SimCSE's cl_init() leaves it (BERT's init_weights): weights N(0, 0.02^2), bias 0;
    PyTorch's default (uniform, bound 1/sqrt(d), std 0.018 at d = 768) has a non-zero bias."""
    torch.manual_seed(0)
    mlp = common.MLP(768)
    w = mlp.dense.weight.detach().double()
    assert torch.equal(mlp.dense.bias, torch.zeros(768))
    assert float(w.mean()) == pytest.approx(0, abs=1e-3) and float(w.std()) == pytest.approx(0.02, rel=0.01)
    # normal, not uniform: a uniform law of std 0.02 never reaches 3 std (its bound is sqrt(3) std)
    assert float(w.abs().max()) > 3 * 0.02
    x = torch.randn(5, 768)
    assert torch.allclose(mlp(x), torch.tanh(x @ mlp.dense.weight.T))


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
    assert set(res["test"]) == set(common.STS_TASKS) | {"avg", "alignment", "uniformity"}
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
    seen = _spy_views(monkeypatch)
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
    assert math.isfinite(res["best_dev"])
    assert set(res["test"]) == set(common.STS_TASKS) | {"avg", "alignment", "uniformity"}
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
    real = common.train_step
    calls = {"n": 0}

    def dying(*a, **k):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(common, "train_step", dying)
    part = tmp_path / "part"
    part.mkdir()
    with pytest.raises(KeyboardInterrupt):
        _run(part, tiny_bert, corpus, small_sts, cache_dir, "--max_steps", "6")
    monkeypatch.setattr(common, "train_step", real)
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
    assert r.returncode == 2 and r.stderr.startswith("error: --bogus_flag: no such flag.")
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


# -------------------------------------------------------------------------------------
# Tab. 7: alpha, the weight of each anchor's own hard negative (Sec. 6.3's weighted Eq. 5)
# -------------------------------------------------------------------------------------

def loop_sup_weighted(h, h_pos, h_neg, tau, alpha, weighs=lambda i, j: i == j):
    """Sec. 6.3, one anchor at a time: l_i = -log e^{sim(h_i,h_i^+)/tau} / sum_j (e^{sim(h_i,h_j^+)/tau}
    + alpha^{1_i^j} e^{sim(h_i,h_j^-)/tau}), 1_i^j = 1 iff i = j. `weighs(i, j)`: which hard
    negatives alpha multiplies (the paper: j = i only)."""
    n, total = h.shape[0], 0.0
    for i in range(n):
        num = math.exp(cos(h[i], h_pos[i]) / tau)
        den = sum(math.exp(cos(h[i], h_pos[j]) / tau)
                  + (alpha if weighs(i, j) else 1.0) * math.exp(cos(h[i], h_neg[j]) / tau) for j in range(n))
        total += -math.log(num / den)
    return total / n


@pytest.mark.parametrize("n,alpha", [(6, 0.5), (6, 1.0), (6, 2.0), (5, 7.5), (1, 2.0)])
def test_weighted_sup_loss_matches_per_row_loop(n, alpha):
    g = torch.Generator().manual_seed(20 + n)
    h, h_pos, h_neg = (torch.randn(n, 16, generator=g) for _ in range(3))
    got = simcse.simcse_sup_loss(h, h_pos, h_neg, 0.05, alpha)
    assert got.dim() == 0
    want = loop_sup_weighted(h.double(), h_pos.double(), h_neg.double(), 0.05, alpha)
    assert_matches_paper(got, want, "simcse_sup_loss", "SimCSE Eq. (5) weighted by alpha (its Sec. 6.3)",
                         rel=1e-5, abs=1e-6)


def test_alpha_weighs_only_the_paired_hard_negative():
    g = torch.Generator().manual_seed(3)
    h, h_pos, h_neg = (torch.randn(6, 16, generator=g) for _ in range(3))
    d = [x.double() for x in (h, h_pos, h_neg)]
    # alpha = 1 is Eq. (5) itself, to the bit, and its per-row loop
    one = simcse.simcse_sup_loss(h, h_pos, h_neg, 0.05, 1.0)
    assert torch.equal(one, simcse.simcse_sup_loss(h, h_pos, h_neg, 0.05))
    assert_matches_paper(one, loop_sup(*d, 0.05), "simcse_sup_loss", "SimCSE Eq. (5)", rel=1e-5)
    # alpha = k (an integer) is Eq. (5) over the batch's columns with row i's own hard negative
    # h_i^- counted k times: only that term of row i's denominator changes
    for k in (2, 3):
        want = 0.0
        for i in range(6):
            logits = torch.tensor([cos(d[0][i], d[1][j]) for j in range(6)] +
                                  [cos(d[0][i], d[2][j]) for j in range(6)] +
                                  [cos(d[0][i], d[2][i])] * (k - 1), dtype=torch.float64) / 0.05
            want += -float(torch.log_softmax(logits, 0)[i]) / 6
        assert_matches_paper(simcse.simcse_sup_loss(h, h_pos, h_neg, 0.05, float(k)), want, "simcse_sup_loss",
                             "SimCSE Eq. (5) weighted by alpha (its Sec. 6.3)", rel=1e-5,
                             reference=f"Eq. (5) with h_i^- counted {k} times")
    # not the reading that weighs every hard negative of the batch
    every = loop_sup_weighted(*d, 0.05, 2.0, weighs=lambda i, j: True)
    assert float(simcse.simcse_sup_loss(h, h_pos, h_neg, 0.05, 2.0)) != pytest.approx(every, rel=1e-3)
    # a larger alpha pushes harder on h_i^- alone: the gradient on h_neg[i] grows with alpha,
    # while the positives' and the unpaired rows' terms keep their weight (loop above)
    grads = []
    for alpha in (0.5, 1.0, 2.0):
        hn = h_neg.clone().requires_grad_(True)
        simcse.simcse_sup_loss(h, h_pos, hn, 0.05, alpha).backward()
        grads.append(float(hn.grad.norm()))
    assert grads[0] < grads[1] < grads[2]


def test_the_model_passes_alpha_to_the_loss(tiny_bert):
    tok, enc = common.load_encoder(str(tiny_bert))
    model = simcse.SimCSE(enc, 0.05, supervised=True, pooler="cls", alpha=2.0).eval()   # eval: no dropout
    cols = {k: dict(tok(v, padding=True, return_tensors="pt")) for k, v in
            {"sent0": ["a man plays .", "two dogs run ."], "sent1": ["someone plays music .", "dogs run ."],
             "hard_neg": ["nobody plays .", "the cats sleep ."]}.items()}
    cols = {k: {"input_ids": v["input_ids"], "attention_mask": v["attention_mask"]} for k, v in cols.items()}
    with torch.no_grad():
        loss = model(cols)
        h, h_pos, h_neg = (model.embed(cols[k]) for k in ("sent0", "sent1", "hard_neg"))
    assert float(loss) == pytest.approx(float(simcse.simcse_sup_loss(h, h_pos, h_neg, 0.05, 2.0)), rel=1e-5)
    assert float(loss) != pytest.approx(float(simcse.simcse_sup_loss(h, h_pos, h_neg, 0.05)), rel=1e-4)


# -------------------------------------------------------------------------------------
# Tab. 3: the dropout p (--dropout) and one mask for both views (--fixed_mask)
# -------------------------------------------------------------------------------------

SENTS = ["a man is playing a guitar .", "the cat sleeps on the mat .", "two dogs run in a field .",
         "a woman slices an onion ."]


def _ids(tok, sents=SENTS):
    b = tok(sents, padding=True, return_tensors="pt")
    return {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}


def test_fixed_mask_equals_two_passes_under_one_mask(tiny_bert):
    """--fixed_mask computes h once and uses it as h_pos. Two passes with the RNG set to one
    seed before each draw the same dropout mask z twice: the same loss and the same gradients."""
    tok, enc = common.load_encoder(str(tiny_bert))                         # dropout 0.1
    fixed = simcse.SimCSE(enc, 0.05, supervised=False, fixed_mask=True).train()
    two = copy.deepcopy(fixed)
    two.fixed_mask = False
    x = _ids(tok)
    with torch.random.fork_rng():
        torch.manual_seed(7)
        loss = fixed({"text": x})
        torch.manual_seed(7)
        h = two.embed(x)
        torch.manual_seed(7)
        h_pos = two.embed(x)
        torch.manual_seed(8)
        other = two.embed(x)
    assert torch.equal(h, h_pos)                             # one mask: the two views are one vector
    assert not torch.allclose(h, other, atol=1e-4)           # and dropout is on: another mask differs
    ref = simcse.simcse_loss(h, h_pos, 0.05)
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    loss.backward()
    ref.backward()
    for (name, p), (_, q) in zip(fixed.named_parameters(), two.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-7), name


def _spy_views(monkeypatch) -> list:
    """The (h, h_pos) pairs simcse_loss is given, collected as a run calls it."""
    seen = []
    real = simcse.simcse_loss

    def spy(h, h_pos, tau):
        seen.append((h.detach().clone(), h_pos.detach().clone()))
        return real(h, h_pos, tau)

    monkeypatch.setattr(simcse, "simcse_loss", spy)
    return seen


@pytest.mark.parametrize("flags,p,row", [(["--dropout", "0"], 0.0, "Tab. 3 p = 0.0"),
                                         (["--fixed_mask"], 0.1, "Tab. 3 Fixed 0.1")])
def test_table3_rows_end_to_end(tmp_path, tiny_bert, corpus, small_sts, cache_dir, monkeypatch, capsys,
                                flags, p, row):
    """p = 0 (no noise) and one mask for both views give identical views in training (the
    paper's two special variants); --dropout sets the encoder's config; the run ends with the
    row beside its figures, kept in best/test_metrics.json."""
    seen = _spy_views(monkeypatch)
    # the row's batch size (App. A's 64): a flag that changes training, so a row depends on it
    _run(tmp_path, tiny_bert, corpus, small_sts, cache_dir, "--max_steps", "2", "--batch_size", "64",
         *flags)
    assert seen and all(torch.allclose(h, hp, atol=1e-6) for h, hp in seen)
    best = tmp_path / "run" / "best"
    config = json.loads((best / "config.json").read_text())
    assert config["hidden_dropout_prob"] == config["attention_probs_dropout_prob"] == p
    label = f"{row} [paper: bert-base-uncased]"
    out = capsys.readouterr().out
    assert re.search(rf"STS-B dev: this run .*; {re.escape(label)}: ", out)
    stored = json.loads((best / "test_metrics.json").read_text())
    assert [r["label"] for r in stored["paper_rows"]] == [label]
    assert "not a model the paper trained" in stored["paper_note"]


def test_dropout_changes_the_encoders_dropout(tmp_path, tiny_bert, corpus, small_sts, monkeypatch):
    """--dropout p reaches the encoder's hidden and attention dropout (default 0.1, the tiny
    model's own, so the default run is unchanged)."""
    seen = {}
    real = common.load_encoder

    def spy(name, dropout=None, flag="--model"):
        tok, enc = real(name, dropout, flag)
        seen[dropout] = enc
        raise KeyboardInterrupt                       # the encoder is all this test needs

    monkeypatch.setattr(common, "load_encoder", spy)
    for p in ("0.3", None):
        with pytest.raises(KeyboardInterrupt):
            simcse.main(["--model", str(tiny_bert), "--data", str(corpus), "--sts_dir", str(small_sts),
                         "--output_dir", str(tmp_path / f"run{p}"), "--cache_dir", str(tmp_path / "c")]
                        + (["--dropout", p] if p else []))
    assert set(seen) == {0.3, 0.1}
    for p, enc in seen.items():
        assert enc.config.hidden_dropout_prob == enc.config.attention_probs_dropout_prob == p
        assert {m.p for m in enc.modules() if isinstance(m, torch.nn.Dropout)} == {p}


# -------------------------------------------------------------------------------------
# Tab. 7 and Tab. 4 end to end: the NLI CSV by its file name, --alpha, --no_hard_neg
# -------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags,rows", [
    (["--alpha", "0.5"], ["Tab. 7 Contradiction, alpha = 0.5"]),
    (["--no_hard_neg"], ["Tab. 7 N/A", "Tab. 4 SNLI+MNLI entailment, full"])])
def test_supervised_rows_end_to_end(tmp_path, tiny_bert, small_sts, nli_csv, cache_dir, monkeypatch, capsys,
                                    flags, rows):
    """A CSV named nli_for_simcse.csv in any folder selects the NLI rows; --alpha reaches the loss;
    --no_hard_neg trains Eq. (4) on the pairs alone."""
    nli = tmp_path / "elsewhere" / "nli_for_simcse.csv"
    nli.parent.mkdir()
    shutil.copy(nli_csv, nli)
    calls = {"sup": [], "unsup": 0}
    real_sup, real_unsup = simcse.simcse_sup_loss, simcse.simcse_loss

    def sup(h, h_pos, h_neg, tau, alpha=1.0):
        calls["sup"].append(alpha)
        return real_sup(h, h_pos, h_neg, tau, alpha)

    def unsup(h, h_pos, tau):
        calls["unsup"] += 1
        return real_unsup(h, h_pos, tau)

    monkeypatch.setattr(simcse, "simcse_sup_loss", sup)
    monkeypatch.setattr(simcse, "simcse_loss", unsup)
    _run(tmp_path, tiny_bert, nli, small_sts, cache_dir, "--max_steps", "2", "--batch_size", "512", *flags)
    if "--alpha" in flags:
        assert calls == {"sup": [0.5, 0.5], "unsup": 0}
    else:
        assert calls == {"sup": [], "unsup": 2}
    labels = [f"{r} [paper: bert-base-uncased]" for r in rows]
    out = capsys.readouterr().out
    assert all(label in out for label in labels)
    stored = json.loads((tmp_path / "run" / "best" / "test_metrics.json").read_text())
    assert [r["label"] for r in stored["paper_rows"]] == labels


# -------------------------------------------------------------------------------------
# Which rows a command selects (parsed as the script parses it; nothing is trained)
# -------------------------------------------------------------------------------------

def _labels(command: str) -> tuple[set[str], str]:
    args = common.parse_args(simcse.Args, shlex.split(command))
    picked, note = flags.select_rows(args, simcse.PAPER_ROWS)
    return {label for label, _ in picked}, note


@pytest.mark.parametrize("command,want", [
    ("", {"Tab. 5 Unsup-SimCSE-BERT_base", "Tab. 3 p = 0.1", "Tab. 6 [CLS] w/ MLP (train), Unsup."}),
    ("--tau 0.05 --dropout 0.1 --alpha 1 --max_steps 10 --seed 3", {"Tab. 5 Unsup-SimCSE-BERT_base",
     "Tab. 3 p = 0.1", "Tab. 6 [CLS] w/ MLP (train), Unsup."}),
    ("--pooler cls", {"Tab. 6 [CLS] w/ MLP, Unsup."}),
    ("--no_mlp", {"Tab. 6 [CLS] w/o MLP, Unsup."}),
    ("--dropout 0", {"Tab. 3 p = 0.0"}),
    ("--dropout 0.15", {"Tab. 3 p = 0.15"}),
    ("--fixed_mask", {"Tab. 3 Fixed 0.1"}),
    ("--data data/nli_for_simcse.csv", {"Tab. 5 Sup-SimCSE-BERT_base", "Tab. 6 [CLS] w/ MLP, Sup.",
                                        "Tab. 7 Contradiction, alpha = 1.0", "Tab. D.1 tau = 0.05",
                                        "Tab. 4 SNLI+MNLI entailment + hard neg."}),
    ("--data /some/where/nli_for_simcse.csv --alpha 2", {"Tab. 7 Contradiction, alpha = 2.0"}),
    ("--data data/nli_for_simcse.csv --no_hard_neg", {"Tab. 7 N/A", "Tab. 4 SNLI+MNLI entailment, full"}),
    ("--data data/nli_for_simcse.csv --tau 1", {"Tab. D.1 tau = 1"}),
    ("--data data/nli_for_simcse.csv --pooler cls_before_pooler --no_mlp", {"Tab. 6 [CLS] w/o MLP, Sup."}),
    ("--model roberta-base --batch_size 512 --lr 1e-5", {"Tab. 5 Unsup-SimCSE-RoBERTa_base"}),
    ("--model FacebookAI/roberta-large --batch_size 512 --lr 3e-5", {"Tab. 5 Unsup-SimCSE-RoBERTa_large"}),
    ("--model roberta-base --data data/nli_for_simcse.csv", {"Tab. 5 Sup-SimCSE-RoBERTa_base"}),
    ("--model roberta-large --data data/nli_for_simcse.csv --lr 1e-5", {"Tab. 5 Sup-SimCSE-RoBERTa_large"}),
    ("--model bert-large-uncased --lr 1e-5", {"official README unsup-simcse-bert-large-uncased"}),
    ("--model bert-large-uncased --data data/nli_for_simcse.csv --lr 1e-5",
     {"official README sup-simcse-bert-large-uncased"}),
])
def test_a_command_selects_its_rows(command, want):
    got, note = _labels(command)
    assert got == want and note == "", (command, note)


@pytest.mark.parametrize("command,named", [
    ("--tau 0.2", "--tau 0.2"),
    ("--dropout 0.3", "--dropout 0.3"),
    ("--fixed_mask --dropout 0", "--dropout 0 --fixed_mask"),
    ("--model roberta-base", "--model roberta-base"),              # without App. A's batch and lr
    ("--model bert-large-uncased", "--model bert-large-uncased"),  # App. A's lr is 1e-5
    ("--data data/my_pairs.csv --no_hard_neg", "--data my_pairs.csv"),
    ("--data data/nli_for_simcse.csv --dropout 0", "--data nli_for_simcse.csv --dropout 0"),
])
def test_a_flag_no_row_covers_prints_the_note(command, named):
    got, note = _labels(command)
    assert got == set() and note.startswith(f"the paper reports no row for {named}"), (command, note)


def test_a_model_the_paper_did_not_train_shows_bert_base_rows():
    args = common.parse_args(simcse.Args, ["--model", "sentence-transformers/all-MiniLM-L6-v2",
                                           "--fixed_mask"])
    picked, note = flags.select_rows(args, simcse.PAPER_ROWS)
    assert [label for label, _ in picked] == ["Tab. 3 Fixed 0.1 [paper: bert-base-uncased]"]
    assert "all-MiniLM-L6-v2 is not a model the paper trained" in note


def test_every_row_is_a_distinct_flag_set_of_its_table():
    """Two rows of one table never share model, data and flags (one run, one row per table),
    and every row's flags are flags of Args."""
    seen = set()
    for r in simcse.PAPER_ROWS:
        key = (r.table, r.model, r.data, tuple(sorted(r.flags.items())))
        assert key not in seen, r
        seen.add(key)
        assert set(r.flags) <= set(simcse.Args.__dataclass_fields__), r


@pytest.mark.parametrize("flags,message", [
    (["--alpha", "2"], r"--alpha 2 with --data .*corpus\.txt: it acts on the hard negatives"),
    (["--no_hard_neg"], r"--no_hard_neg with --data .*corpus\.txt"),
    (["--data", "{nli}", "--fixed_mask"], r"--fixed_mask with --data .*nli\.csv: one dropout mask"),
    (["--data", "{nli}", "--no_hard_neg", "--alpha", "2"], r"--alpha 2 with --no_hard_neg: there is no hard"),
    (["--alpha", "0"], r"--alpha 0\.0: must be > 0\. .*Tab\. 7 tries 0\.5, 1 and 2"),
    (["--dropout", "1"], r"--dropout 1\.0: must be < 1\. .*Tab\. 3 tries 0, 0\.01"),
    (["--dropout", "-0.1"], r"--dropout -0\.1: must be >= 0"),
])
def test_new_flags_are_checked_before_anything_is_written(tmp_path, tiny_bert, corpus, small_sts, nli_csv,
                                                          cache_dir, flags, message):
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("sent0,sent1\n" + "".join(f"a{i},b{i}\n" for i in range(20)))
    flags = [f.format(nli=nli_csv, pairs=pairs) for f in flags]
    with pytest.raises(common.UserError, match=message):
        _run(tmp_path, tiny_bert, corpus, small_sts, cache_dir, *flags)
    assert not (tmp_path / "run").exists()


def test_the_readme_rows_beside_the_paper_table():
    """docs/simcse.md's table of rows the contract table cannot hold (`| row | published |
    command |`): a row with figures selects them; a row without selects none and prints the note."""
    section = (ROOT / "docs" / "simcse.md").read_text(encoding="utf-8")
    table = section[section.index("| row | published | command |"):].split("\n\n")[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()[2:]]
    assert len(rows) == 3
    for row, published, command in rows:
        cmd = re.search(r"`python simcse\.py([^`]*)`", command).group(1)
        figures = [float(x) for x in re.findall(r"\d+\.\d+", published)]
        args = common.parse_args(simcse.Args, shlex.split(cmd))
        picked, note = flags.select_rows(args, simcse.PAPER_ROWS)
        if figures:
            assert figures in [r.headline() for _, r in picked], (row, cmd, picked)
        else:
            assert picked == [] and note.startswith("the paper reports no row"), (row, cmd, picked)


def test_a_csv_of_pairs_trains_eq4_and_says_so(tmp_path, capsys):
    """A CSV with no hard_neg column trains Eq. (4) on its pairs: settle() sets --no_hard_neg, so
    that args.json and the rows it selects say what trains; a CSV of triplets keeps Eq. (5)."""
    pairs, triplets = tmp_path / "pairs.csv", tmp_path / "triplets.csv"
    pairs.write_text("sent0,sent1\n" + "".join(f"a{i},b{i}\n" for i in range(20)))
    triplets.write_text("sent0,sent1,hard_neg\n" + "".join(f"a{i},b{i},c{i}\n" for i in range(20)))
    args = common.parse_args(simcse.Args, ["--data", str(pairs)])
    args.settle(20)
    assert args.no_hard_neg and "no hard_neg column" in capsys.readouterr().err
    args = common.parse_args(simcse.Args, ["--data", str(triplets)])
    args.settle(20)
    assert not args.no_hard_neg
