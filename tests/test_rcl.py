"""rcl.py: Eq. (1)-(3) against per-row loops written from the paper, the reductions to SimCSE,
the models' wiring (frozen regulators, hard-negative layout, dropout on), early stopping, and
tiny end-to-end runs of both stages for both data forms, including a restart that reuses the
finished entropy models."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import common
import rcl
import simcse
from conftest import CORPUS_LINES, assert_matches_paper, departs
from plumbing import atomic_writes, export, flags, inputs, run_folder

# ------------------------------------------------------------------------------------
# Per-row references, straight from the paper's formulas (with tau, as rcl.py reads them)
# ------------------------------------------------------------------------------------

def _cos(a, b):
    return (a @ b) / (a.norm() * b.norm())


def _row_ce(x_i, cols, i, tau):
    """-log e^{cos(x_i, c_i)/tau} / sum_k e^{cos(x_i, c_k)/tau}"""
    e = [torch.exp(_cos(x_i, c) / tau) for c in cols]
    return -torch.log(e[i] / sum(e))


def ref_entropy(q, ind, phi, tau):
    """Eq. (2): J_i = CE_i - phi * sum_{j != i} s_ij log s_ij, s_ij = softmax_k cos(q_i, ind_k)/tau."""
    n, m = q.shape[0], ind.shape[0]
    total = 0.0
    for i in range(n):
        e = [torch.exp(_cos(q[i], ind[k]) / tau) for k in range(m)]
        z = sum(e)
        ce = -torch.log(e[i] / z)
        ent = sum(((e[j] / z) * torch.log(e[j] / z) for j in range(m) if j != i), torch.zeros(()))
        total = total + ce - phi * ent
    return total / n


def ref_regularized(q, ind, aug_q, aug_ind, tau):
    """Eq. (3): CE(q_i; ind) + sum_n CE(q_i; Au_q^n) + sum_n CE(ind_i; Au_ind^n), mean over i."""
    n = q.shape[0]
    total = 0.0
    for i in range(n):
        j_i = _row_ce(q[i], list(ind), i, tau)
        for a_q, a_ind in zip(aug_q, aug_ind):
            j_i = j_i + _row_ce(q[i], list(a_q), i, tau) + _row_ce(ind[i], list(a_ind), i, tau)
        total = total + j_i
    return total / n


def close(a, b, atol=1e-5):
    """The references in float64; a loss computes in its inputs' precision, at least float32."""
    return torch.allclose(a.double(), b.double(), atol=atol, rtol=1e-5)


def _rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


# ------------------------------------------------------------------------------------
# Eq. (1) and Eq. (2)
# ------------------------------------------------------------------------------------

@pytest.mark.parametrize("hard_neg", [False, True])
@pytest.mark.parametrize("tau", [0.05, 0.7])
def test_contrastive_loss_matches_loop(hard_neg, tau):
    q, ind = _rand(5, 7, seed=1), _rand(10 if hard_neg else 5, 7, seed=2)
    want = sum(_row_ce(q[i], list(ind), i, tau) for i in range(5)) / 5
    got = rcl.contrastive_loss(q, ind, tau)
    assert close(got, want), departs("contrastive_loss", "RCL Eq. (1)", got, want)


@pytest.mark.parametrize("hard_neg", [False, True])
@pytest.mark.parametrize("phi,tau", [(0.3, 0.05), (-0.2, 0.05), (2.0, 0.7)])
def test_entropy_loss_matches_loop(hard_neg, phi, tau):
    n = 6
    q, ind = _rand(n, 8, seed=3), _rand(2 * n if hard_neg else n, 8, seed=4)
    got = rcl.entropy_loss(q, ind, phi, tau)
    assert got.dim() == 0
    want = ref_entropy(q, ind, phi, tau)
    assert close(got, want), departs("entropy_loss", "RCL Eq. (2)", got, want)
    # a transposed similarity matrix (ind as rows) would give another value
    if not hard_neg:
        assert not close(got, ref_entropy(ind, q, phi, tau))


def test_entropy_loss_ties():
    """Identical rows give tied similarities (and exact duplicates of the positive)."""
    base = _rand(3, 5, seed=5)
    q = torch.cat([base, base[:1]])                                           # rows 0 and 3 tie
    ind = torch.cat([base[:2], base[:2]])                                     # columns tie pairwise
    for phi in (0.0, 0.5):
        got, want = rcl.entropy_loss(q, ind, phi, 0.1), ref_entropy(q, ind, phi, 0.1)
        assert close(got, want), departs("entropy_loss", "RCL Eq. (2)", got, want,
                                         "the paper's per-row loop, with ties")


def test_entropy_loss_batch_of_one():
    q, pos, neg = _rand(1, 4, seed=6), _rand(1, 4, seed=7), _rand(1, 4, seed=8)
    # one row, no other column: the cross-entropy is 0 and the entropy sum is empty
    assert_matches_paper(rcl.entropy_loss(q, pos, 0.5, 0.05).item(), 0.0, "entropy_loss", "RCL Eq. (2)",
                         abs=1e-12, reference="one row, no other column")
    ind = torch.cat([pos, neg])
    got, want = rcl.entropy_loss(q, ind, 0.5, 0.05), ref_entropy(q, ind, 0.5, 0.05)
    assert close(got, want), departs("entropy_loss", "RCL Eq. (2)", got, want)


def test_entropy_term_is_phi_times_row_entropy():
    """J(phi) - J(0) = phi * H, H = -sum_{j!=i} s log s >= 0: the sign of Eq. (2) and the diagonal."""
    q, ind = _rand(5, 6, seed=9), _rand(10, 6, seed=10)
    h = rcl.row_entropy(q, ind, 0.1)
    assert h.item() > 0
    for phi in (0.04, -0.03):
        diff = rcl.entropy_loss(q, ind, phi, 0.1) - rcl.entropy_loss(q, ind, 0.0, 0.1)
        assert close(diff, phi * h), departs("entropy_loss(phi) - entropy_loss(0)",
                                             "RCL Eq. (2)'s entropy term", diff, phi * h,
                                             "phi times the row entropy")


def test_entropy_loss_gradient_matches_loop():
    """The entropy term is differentiated through s_ij (nothing detached)."""
    q1, ind1 = _rand(4, 5, seed=11).requires_grad_(), _rand(8, 5, seed=12).requires_grad_()
    q2, ind2 = q1.detach().clone().requires_grad_(), ind1.detach().clone().requires_grad_()
    rcl.entropy_loss(q1, ind1, 0.7, 0.2).backward()
    ref_entropy(q2, ind2, 0.7, 0.2).backward()
    code = "entropy_loss's gradient"
    assert close(q1.grad, q2.grad), departs(code, "RCL Eq. (2)", q1.grad, q2.grad)
    assert close(ind1.grad, ind2.grad), departs(code, "RCL Eq. (2)", ind1.grad, ind2.grad)


def test_phi_zero_is_simcse():
    """Reduction: phi = 0 is supervised SimCSE (Eq. 5) and, without hard negatives, Eq. (4)."""
    q, pos, neg = _rand(6, 8, seed=13), _rand(6, 8, seed=14), _rand(6, 8, seed=15)
    for tau in (0.05, 0.5):
        got, want = rcl.entropy_loss(q, pos, 0.0, tau), simcse.simcse_loss(q, pos, tau)
        assert close(got, want), departs("entropy_loss at phi 0", "SimCSE Eq. (4)", got, want, "simcse_loss")
        got = rcl.entropy_loss(q, torch.cat([pos, neg]), 0.0, tau)
        want = simcse.simcse_sup_loss(q, pos, neg, tau)
        assert close(got, want), departs("entropy_loss at phi 0", "SimCSE Eq. (5)", got, want,
                                         "simcse_sup_loss")
        got = rcl.contrastive_loss(q, torch.cat([pos, neg]), tau)
        assert close(got, want), departs("contrastive_loss", "SimCSE Eq. (5)", got, want, "simcse_sup_loss")


# ------------------------------------------------------------------------------------
# Eq. (3)
# ------------------------------------------------------------------------------------

@pytest.mark.parametrize("hard_neg", [False, True])
@pytest.mark.parametrize("k", [1, 3])
def test_regularized_loss_matches_loop(hard_neg, k):
    n, d, tau = 5, 6, 0.05
    q, ind = _rand(n, d, seed=20), _rand(2 * n if hard_neg else n, d, seed=21)
    aug_q = [_rand(n, d, seed=30 + i) for i in range(k)]
    aug_ind = [_rand(n, d, seed=40 + i) for i in range(k)]
    got = rcl.regularized_loss(q, ind, aug_q, aug_ind, tau)
    assert got.dim() == 0
    want = ref_regularized(q, ind, aug_q, aug_ind, tau)
    assert close(got, want), departs("regularized_loss", "RCL Eq. (3)", got, want)
    # q must meet Au_q and ind meet Au_ind, not the other way round
    assert not close(got, ref_regularized(q, ind, aug_ind, aug_q, tau))
    # a missing tau (tau = 1) would give another value
    assert not close(got, ref_regularized(q, ind, aug_q, aug_ind, 1.0))


def test_regularized_loss_gradient_matches_loop():
    n, d = 4, 5
    q1, ind1 = _rand(n, d, seed=50).requires_grad_(), _rand(2 * n, d, seed=51).requires_grad_()
    q2, ind2 = q1.detach().clone().requires_grad_(), ind1.detach().clone().requires_grad_()
    aug_q, aug_ind = [_rand(n, d, seed=52)], [_rand(n, d, seed=53)]
    rcl.regularized_loss(q1, ind1, aug_q, aug_ind, 0.3).backward()
    ref_regularized(q2, ind2, aug_q, aug_ind, 0.3).backward()
    code = "regularized_loss's gradient"
    assert close(q1.grad, q2.grad), departs(code, "RCL Eq. (3)", q1.grad, q2.grad)
    assert close(ind1.grad, ind2.grad), departs(code, "RCL Eq. (3)", ind1.grad, ind2.grad)
    assert ind1.grad[n:].abs().sum() > 0    # hard negatives get gradient from the first term


def test_regularized_loss_no_regulators_is_contrastive():
    q, pos, neg = _rand(6, 8, seed=60), _rand(6, 8, seed=61), _rand(6, 8, seed=62)
    ind = torch.cat([pos, neg])
    got, want = rcl.regularized_loss(q, ind, [], [], 0.05), rcl.contrastive_loss(q, ind, 0.05)
    assert close(got, want), departs("regularized_loss without regulators", "RCL Eq. (1)", got, want,
                                     "contrastive_loss")
    got, want = rcl.regularized_loss(q, pos, [], [], 0.05), simcse.simcse_loss(q, pos, 0.05)
    assert close(got, want), departs("regularized_loss without regulators", "SimCSE Eq. (4)", got, want,
                                     "simcse_loss")
    # a batch of one with a regulator: every term is a softmax over one column, so 0
    assert_matches_paper(rcl.regularized_loss(q[:1], pos[:1], [pos[:1]], [q[:1]], 0.05).item(), 0.0,
                         "regularized_loss", "RCL Eq. (3)", reference="a batch of one: every term -log 1")


def test_regularized_loss_regulators_add():
    """Each entropy model adds its two regulators to the same contrastive term (a sum, Eq. 3)."""
    n, d = 5, 4
    q, ind = _rand(n, d, seed=70), _rand(n, d, seed=71)
    a = [_rand(n, d, seed=72 + i) for i in range(4)]
    base = rcl.contrastive_loss(q, ind, 0.1)
    one = rcl.regularized_loss(q, ind, a[:1], a[1:2], 0.1) - base
    two = rcl.regularized_loss(q, ind, a[2:3], a[3:4], 0.1) - base
    both = rcl.regularized_loss(q, ind, [a[0], a[2]], [a[1], a[3]], 0.1) - base
    assert close(both, one + two), departs("regularized_loss", "RCL Eq. (3)'s sum over the entropy models",
                                           both, one + two, "each model's regulators added")


def test_regularized_loss_mismatched_lists():
    q = _rand(3, 4)
    with pytest.raises(ValueError):
        rcl.regularized_loss(q, q, [q], [], 0.05)


# ------------------------------------------------------------------------------------
# Early stopping (App. A)
# ------------------------------------------------------------------------------------

def test_early_stop_patience():
    """Patience counted in checks; with `every` 1 each step's loss is a check of its own."""
    stop = rcl.early_stop(3, 1)
    assert stop.every == 1
    losses = [5.0, 4.0, 4.5, 4.0, 3.9, 4.2, 4.1, 3.95]
    fired = [stop(s, x) for s, x in enumerate(losses, 1)]
    # 3.9 at check 5 is the last decrease; 6, 7, 8 do not beat it -> stop at check 8
    assert fired == [False] * 7 + [True]
    stop = rcl.early_stop(1, 1)
    assert [stop(s, x) for s, x in enumerate([3.0, 2.0, 2.0], 1)] == [False, False, True]
    assert rcl.early_stop(0, 50) is None


def test_early_stop_checks_the_mean_since_its_last_check():
    """common.train asks it after every step; it checks every `every` steps, the mean loss of the
    steps since its last check (a tensor summed on the device: no wait between checks)."""
    stop = rcl.early_stop(1, 4)
    losses = [4.0, 6.0, 5.0, 5.0, 9.0, 1.0, 5.0, 5.0, 5.0, 5.0, 5.0, 6.0]   # means 5.0, 5.0, 5.25
    fired = [stop(s, torch.tensor(x)) for s, x in enumerate(losses, 1)]
    assert fired == [False] * 7 + [True] + [False] * 3 + [True]
    assert stop.best == 5.0 and stop.steps == 0


def test_early_stop_state_round_trip():
    """Its state (best, patience count, and the loss summed since its last check) goes into last/
    and back: a copy made between two checks fires where the original does."""
    losses = [5.0, 4.0, 4.5, 4.6, 4.7, 4.8]
    a = rcl.early_stop(3, 2)
    fired = [a(s, x) for s, x in enumerate(losses[:5], 1)]          # checks 2, 4 and one step since
    b = rcl.early_stop(3, 2)
    b.load_state_dict(a.state_dict())
    assert fired == [False] * 5 and b.state_dict() == a.state_dict() and a.steps == 1
    # means 4.5 | 4.55 | 4.75: 4.5 still the best after checks 4 and 6: patience 3 not yet used up
    assert [b(6, 4.8), a(6, 4.8)] == [False, False] and b.state_dict() == a.state_dict()
    assert [b(s, 9.0) for s in (7, 8)] == [False, True]
    fresh = rcl.early_stop(3, 2)
    assert not fresh(6, 4.8)


# Noisy batches: within each interval of 10 steps the single-batch losses rise and fall
# around the interval's mean (ZIG sums to 0), so the interval means are exactly BASES.
ZIG = [0.0, 0.5, 0.6, 0.7, -0.9, 0.3, 0.2, 0.1, -0.8, -0.7]
FALLING = [5.0, 4.9, 4.8, 4.7, 4.6, 4.5]        # the mean falls at every evaluation
PLATEAU = [5.0, 4.9, 4.9, 4.95, 4.9, 4.8]       # no new low at evaluations 3, 4, 5


def _batches(bases):
    return [b + z for b in bases for z in ZIG]


class Scripted(torch.nn.Module):
    """A model whose training loss is a given sequence, one value a step; the encoder is only
    evaluated and saved (it gets no gradient)."""

    def __init__(self, encoder, losses):
        super().__init__()
        self.encoder, self.losses, self.t = encoder, losses, 0
        self.w = torch.nn.Parameter(torch.zeros(()))

    def forward(self, batch):
        loss = self.w * 0 + self.losses[self.t]
        self.t += 1
        return loss



def _run(args) -> run_folder.RunFolder:
    """A bare run folder on the CPU, as common.start hands one down (without its checks and lock)."""
    return run_folder.RunFolder(args, device=torch.device("cpu"))


def _train_scripted(tiny_bert, small_sts, corpus, out, cache_dir, losses, should_stop, **flags):
    args = rcl.Args(model=str(tiny_bert), data=str(corpus), sts_dir=str(small_sts),
                    output_dir=str(out), cache_dir=str(cache_dir), batch_size=8, max_len=16,
                    max_steps=len(losses), **{"eval_every": 10, **flags})
    out.mkdir()
    tok, enc = common.load_encoder(args.model)
    data = common.tokenize_columns(args, tok, common.load_columns(args.data))
    return common.train(args, run_folder.RunFolder(args), Scripted(enc, losses), data, tok, args.pooler,
                        should_stop=should_stop, final_eval=False)


def test_should_stop_is_asked_after_every_step(tiny_bert, small_sts, corpus, tmp_path, cache_dir):
    """common.train asks should_stop after every step, with that step's loss; it fires at the last
    step here, so training ran all its steps, not "stopped early"; training records follow
    --log_every, and evaluations --eval_every and the last step."""
    losses = _batches(FALLING)[:25]
    seen = []
    res = _train_scripted(tiny_bert, small_sts, corpus, tmp_path / "run", cache_dir, losses,
                          lambda step, loss: seen.append((step, float(loss))) or step == 25, log_every=4)
    assert [s for s, _ in seen] == list(range(1, 26))
    assert [x for _, x in seen] == pytest.approx(losses)
    recs = _records(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in recs if "loss" in r] == [4, 8, 10, 12, 16, 20, 24, 25]
    assert [r["step"] for r in recs if "stsb_dev" in r] == [10, 20, 25]
    assert res["steps"] == 25 and not res["stopped_early"]


def test_noisy_batches_do_not_stop_an_entropy_model(tiny_bert, small_sts, corpus, tmp_path, cache_dir):
    """Single batches rise for 3 steps right at the start: compared batch by batch (the old
    reading of "3 steps") training stops at step 4; compared as interval means at evaluations
    it trains on while the mean falls, and still stops on a plateau."""
    old = rcl.early_stop(3, 1)
    assert next(s for s, x in enumerate(_batches(FALLING), 1) if old(s, x)) == 4
    res = _train_scripted(tiny_bert, small_sts, corpus, tmp_path / "falling", cache_dir,
                          _batches(FALLING), rcl.early_stop(3, 10))
    assert res["steps"] == 60 and not res["stopped_early"]
    # interval means 5, 4.9 | 4.9, 4.95, 4.9: three evaluations without a new low -> step 50
    res = _train_scripted(tiny_bert, small_sts, corpus, tmp_path / "plateau", cache_dir,
                          _batches(PLATEAU), rcl.early_stop(3, 10))
    assert res["steps"] == 50 and res["stopped_early"]
    assert max(r["step"] for r in _records(tmp_path / "plateau" / "metrics.jsonl")) == 50


def test_a_resume_after_an_early_stop_trains_no_further(tiny_bert, small_sts, corpus, tmp_path,
                                                       cache_dir):
    """last/ records that should_stop ended training: a run killed after that checkpoint (before
    RCL writes DONE.json, say) resumes as stopped, and trains no step more."""
    out = tmp_path / "plateau"
    res = _train_scripted(tiny_bert, small_sts, corpus, out, cache_dir, _batches(PLATEAU),
                          rcl.early_stop(3, 10))
    assert res["steps"] == 50 and res["stopped_early"]
    log = (out / "metrics.jsonl").read_text()
    args = rcl.Args(model=str(tiny_bert), data=str(corpus), sts_dir=str(small_sts), output_dir=str(out),
                    cache_dir=str(cache_dir), batch_size=8, max_len=16, max_steps=60, eval_every=10,
                    resume=True)
    tok, enc = common.load_encoder(args.model)
    data = common.tokenize_columns(args, tok, common.load_columns(args.data))
    model = Scripted(enc, _batches(PLATEAU))
    res = common.train(args, run_folder.RunFolder(args), model, data, tok, args.pooler,
                       should_stop=rcl.early_stop(3, 10), final_eval=False)
    assert res["steps"] == 50 and res["stopped_early"] and model.t == 0
    assert (out / "metrics.jsonl").read_text() == log


def test_early_stop_counter_is_restored_on_resume(tiny_bert, small_sts, corpus, tmp_path, cache_dir,
                                                   monkeypatch):
    """common.train saves should_stop's state with last/ and loads it back on --resume, so a
    restarted entropy model keeps its patience count instead of starting from zero."""
    class Count:
        def __init__(self):
            self.n = 0

        def __call__(self, step, loss):
            self.n += 1
            return False

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, state):
            self.n = state["n"]

    args = rcl.Args(model=str(tiny_bert), data=str(corpus), sts_dir=str(small_sts),
                    output_dir=str(tmp_path / "run"), cache_dir=str(cache_dir), batch_size=8,
                    max_steps=6, eval_every=2, max_len=16)
    (tmp_path / "run").mkdir()
    real, calls = common.train_step, [0]

    def step_5_stopped(*a, **k):                     # Ctrl-C in step 5: last/ holds step 4
        calls[0] += 1
        if calls[0] == 5:
            raise KeyboardInterrupt
        return real(*a, **k)
    counts = []
    for a in (args, dataclasses.replace(args, resume=True)):
        tok, enc = common.load_encoder(a.model)
        data = common.tokenize_columns(a, tok, common.load_columns(a.data))
        stop = Count()
        with monkeypatch.context() as mp:
            mp.setattr(common, "train_step", step_5_stopped)
            try:
                common.train(a, run_folder.RunFolder(a), rcl.EntropyModel(enc, a.pooler, 0.01, a.tau), data,
                             tok, a.pooler, should_stop=stop, final_eval=False)
            except KeyboardInterrupt:
                pass
        counts.append(stop.n)
    assert counts == [4, 6]      # asked at steps 1-4; 4 restored from last/ (step 4), then steps 5 and 6


# ------------------------------------------------------------------------------------
# The models: column layout, frozen regulators, dropout
# ------------------------------------------------------------------------------------

def _nli_batch(tokenizer, nli, n=4):
    cols = inputs.read_csv_columns(nli)
    toks = {k: common.tokenize(tokenizer, v[:n], 16) for k, v in cols.items()}
    return {k: t.batch(np.arange(n)) for k, t in toks.items()}


def test_models_wiring(tiny_bert, nli_csv):
    tok, enc = common.load_encoder(str(tiny_bert))
    frozen = [rcl.load_frozen(Path(tiny_bert), torch.device("cpu")) for _ in range(2)]
    torch.manual_seed(0)
    for f in frozen:  # two different "entropy models"
        for p in f.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = _nli_batch(tok, nli_csv)
    model = rcl.RCL(enc, "avg", 0.05, frozen)

    def emb(e, col):
        return rcl.embed(e, "avg", [batch[col]])

    # eval mode: the loss is Eq. (3) on q = sent0, ind = [sent1; hard_neg], Au from sent0/sent1
    model.eval()
    with torch.no_grad():
        q, ind = rcl.query_index(enc, "avg", batch)
        assert torch.allclose(q, emb(enc, "sent0"), atol=1e-5)
        assert torch.allclose(ind, torch.cat([emb(enc, "sent1"), emb(enc, "hard_neg")]), atol=1e-5)
        loss, stats = model(batch)
        want = rcl.regularized_loss(emb(enc, "sent0"), torch.cat([emb(enc, "sent1"), emb(enc, "hard_neg")]),
                                    [emb(f, "sent0") for f in frozen], [emb(f, "sent1") for f in frozen],
                                    0.05)
        assert torch.allclose(loss, want, atol=1e-5)
        assert stats["regulators"].item() > 0

    # train mode: dropout on for the trained encoder, the regulators stay frozen in eval mode
    model.train()
    assert enc.training and not any(f.training for f in frozen)
    loss, _ = model(batch)
    loss.backward()
    assert all(p.grad is None and not p.requires_grad for f in frozen for p in f.parameters())
    assert any(p.grad is not None for p in enc.parameters())
    assert all(k.startswith("encoder.") for k in model.state_dict())
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in enc.parameters())


def test_hard_negative_layout_under_ddp(tiny_bert, nli_csv, monkeypatch):
    """Under torchrun ind must hold ALL ranks' positives first, then all hard negatives, so
    that column i stays the positive of global row i: gather is faked as two ranks here."""
    tok, enc = common.load_encoder(str(tiny_bert))
    batch = _nli_batch(tok, nli_csv)
    monkeypatch.setattr(common, "gather", lambda x: torch.cat([x, x + 100.0]))
    with torch.no_grad():
        q, ind = rcl.query_index(enc, "avg", batch)
        pos, neg = (rcl.embed(enc, "avg", [batch[c]]) for c in ("sent1", "hard_neg"))
        assert q.shape == (8, 32) and ind.shape == (16, 32)
        assert torch.allclose(ind[:8], torch.cat([pos, pos + 100]), atol=1e-4)
        assert torch.allclose(ind[8:], torch.cat([neg, neg + 100]), atol=1e-4)


def test_unsupervised_views_differ_in_training(tiny_bert, corpus):
    tok, enc = common.load_encoder(str(tiny_bert))
    text = inputs.read_sentences(corpus)[:4]
    batch = {"text": common.tokenize(tok, text, 16).batch(np.arange(4))}
    model = rcl.EntropyModel(enc, "cls_before_pooler", 0.01, 0.05)
    model.train()
    q, ind = rcl.query_index(enc, "cls_before_pooler", batch)
    assert q.shape == ind.shape == (4, 32)
    assert not torch.allclose(q, ind)          # two dropout views
    loss, stats = model(batch)
    assert loss.dim() == 0 and "entropy" in stats


# ------------------------------------------------------------------------------------
# End to end: both stages, both data forms, restart
# ------------------------------------------------------------------------------------

def _common_flags(tiny_bert, sts_dir, out, cache_dir, extra=()):
    return ["--model", str(tiny_bert), "--sts_dir", str(sts_dir), "--output_dir", str(out),
            "--max_steps", "3", "--batch_size", "8", "--cache_dir", str(cache_dir), "--lr", "1e-3",
            "--phi", "0.01", "0.02", *extra]


def _records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _check_best_loads(best, pooler):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer
    enc = AutoModel.from_pretrained(best)
    tok = AutoTokenizer.from_pretrained(best)
    sents = ["A man is playing a guitar.", "Two dogs run across the snowy field."]
    ours = common.make_encode(enc, tok, pooler)(sents)
    st = SentenceTransformer(str(best), device="cpu").encode(sents, convert_to_numpy=True)
    np.testing.assert_allclose(st, ours, atol=1e-5)


def test_end_to_end_nli(tiny_bert, small_sts, nli_csv, tmp_path, cache_dir, monkeypatch, capsys):
    out = tmp_path / "run"
    nli = nli_csv
    # spy on common.train: what each stage starts from
    from safetensors.torch import load_file
    original = load_file(str(Path(tiny_bert) / "model.safetensors"))
    starts, columns, real_train = [], [], common.train

    def spy(args, run, model, data, tokenizer, pooler, **kw):
        same = all(torch.equal(v.cpu(), original[k]) for k, v in model.encoder.state_dict().items()
                   if k in original)
        starts.append((type(model).__name__, same, getattr(model, "entropy_encoders", None)))
        columns.append(sorted(data))
        res = real_train(args, run, model, data, tokenizer, pooler, **kw)
        # common.train switches the trained model to train mode; the regulators stay in eval
        assert not any(f.training for f in getattr(model, "entropy_encoders", []))
        return res

    monkeypatch.setattr(common, "train", spy)
    res = rcl.main(_common_flags(tiny_bert, small_sts, out, cache_dir,
                                 ["--data", str(nli), "--eval_every", "2", "--patience", "2"]))
    # every stage starts from --model; stage 2 holds the two entropy models' weights at their stop
    # (end/, Algorithm 1), by default
    assert [(name, same) for name, same, _ in starts] == [("EntropyModel", True)] * 2 + [("RCL", True)]
    frozen = starts[2][2]
    assert len(frozen) == 2
    for f, phi in zip(frozen, ("0.01", "0.02")):
        saved = load_file(str(out / f"entropy_phi{phi}" / "end" / "model.safetensors"))
        assert all(torch.equal(v.cpu(), saved[k]) for k, v in f.state_dict().items() if k in saved)
    assert not torch.equal(frozen[0].embeddings.word_embeddings.weight,
                           frozen[1].embeddings.word_embeddings.weight)
    # the contradictions are hard negatives of the entropy models only (App. A; Eq. 3 has none)
    assert columns == [["hard_neg", "sent0", "sent1"]] * 2 + [["sent0", "sent1"]]
    # the starting checkpoint's figures, measured as rcl.py says it measures them
    tok, enc = common.load_encoder(str(tiny_bert))
    dev0 = common.evaluate_sts(common.make_encode(enc, tok, "avg"), small_sts, split="dev")
    args = rcl.Args(model=str(tiny_bert), data=str(nli), cache_dir=str(cache_dir), batch_size=8)
    data = common.tokenize_columns(args, tok, common.load_columns(args.data))
    h0 = rcl.probe_entropy(rcl.EntropyModel(enc, "avg", 0.01, 0.05), data, args, torch.device("cpu"))
    summary = capsys.readouterr().out
    for phi in ("0.01", "0.02"):
        folder = out / f"entropy_phi{phi}"
        done = json.loads((folder / run_folder.DONE).read_text())
        # 3 steps; evaluations at 2 and 3 (the last): patience 2 cannot run out
        assert done["phi"] == float(phi) and done["steps"] == 3 and done["stopped_early"] is False
        assert (folder / "best" / "config.json").is_file()
        recs = _records(folder / "metrics.jsonl")
        assert any("entropy" in r for r in recs)
        # training records at --log_every (10), evaluations and the last step: not every step
        assert [r["step"] for r in recs if "loss" in r] == [2, 3]
        assert not (folder / "best" / "test_metrics.json").exists()   # no 7-task eval in stage 1
        assert done["dev_start"] == pytest.approx(dev0["STSBenchmark"]["spearman"])
        assert done["dev_end"] == [r["stsb_dev"] for r in recs if "stsb_dev" in r][-1]
        assert done["best_dev"] == max(r["stsb_dev"] for r in recs if "stsb_dev" in r)
        assert done["entropy_start"] == pytest.approx(h0, rel=1e-5)
        assert done["entropy_end"] != pytest.approx(h0, rel=1e-3)      # lr 1e-3: it moved
        assert (f"entropy model phi={phi}: trained its 3 steps; its end/ weights, which regulate: row "
                f"entropy {h0:.4f} -> {done['entropy_end']:.4f}" in summary)
        assert rcl.summary_table([done]).splitlines()[-1] in summary
    assert summary.count("STS-B dev start -> end") == 1
    recs = _records(out / "metrics.jsonl")
    assert any("stsb_dev" in r for r in recs)
    assert any("regulators" in r and r["regulators"] > 0 for r in recs)
    # each regulator's term in the final model's log; together they are the regulators
    train = [r for r in recs if "loss" in r]
    terms = [f"reg_{side}_phi{phi}" for phi in ("0.01", "0.02") for side in ("q", "ind")]
    assert all(set(terms) <= set(r) for r in train)
    for r in train:
        assert sum(r[t] for t in terms) == pytest.approx(r["regulators"], rel=1e-4)
        assert r["loss"] == pytest.approx(r["contrastive"] + r["regulators"], rel=1e-4)
    assert set(common.STS_TASKS) <= set(res["test"])
    _check_best_loads(out / "best", "avg")


def test_end_to_end_text(tiny_bert, small_sts, corpus, tmp_path, cache_dir):
    out = tmp_path / "run"
    res = rcl.main(_common_flags(tiny_bert, small_sts, out, cache_dir,
                                 ["--data", str(corpus), "--pooler", "cls_before_pooler"]))
    assert all((out / f"entropy_phi{phi}" / run_folder.DONE).is_file() for phi in ("0.01", "0.02"))
    assert any("stsb_dev" in r for r in _records(out / "metrics.jsonl"))
    assert res["test"]["avg"] > 0
    # --eval_every 0 (default) = 10% of an epoch: the corpus's lines / 8 per step / 10, the value
    # the run's own args.json records as well as its checkpoint's
    for f in (out / "args.json", out / "best" / "args.json"):
        assert json.loads(f.read_text())["eval_every"] == CORPUS_LINES // 8 // 10
    _check_best_loads(out / "best", "cls_before_pooler")


def test_a_phi_given_twice_trains_one_model_that_regulates_twice(tiny_bert, small_sts, corpus, tmp_path,
                                                                 cache_dir):
    """--phi 0 0, the control of a two-model run with the entropy term off: one phi = 0 entropy
    model, trained once, whose two regulator pairs are logged apart and are the same figure; the
    entropy model logs phi * H (0 here) beside its loss."""
    out = tmp_path / "run"
    flags = _common_flags(tiny_bert, small_sts, out, cache_dir, ["--data", str(corpus), "--pooler",
                                                                 "cls_before_pooler", "--eval_every", "3"])
    at = flags.index("--phi")
    rcl.main(flags[:at + 1] + ["0", "0"] + flags[at + 3:])
    assert sorted(p.name for p in out.glob("entropy_phi*")) == ["entropy_phi0"]
    stage = [r for r in _records(out / "entropy_phi0" / "metrics.jsonl") if "loss" in r]
    assert stage and all(r["phi_entropy"] == 0 and r["entropy"] > 0 for r in stage)
    final = [r for r in _records(out / "metrics.jsonl") if "loss" in r]
    assert final and all(r["reg_q_phi0"] == r["reg_q_phi0_2"] and r["reg_ind_phi0"] == r["reg_ind_phi0_2"]
                         for r in final)
    assert all(r["regulators"] == pytest.approx(2 * (r["reg_q_phi0"] + r["reg_ind_phi0"]), rel=1e-5)
               for r in final)
    assert rcl.regulator_names([0, 0.01, 0, 0.01, 0]) == ["phi0", "phi0.01", "phi0_2", "phi0.01_2", "phi0_3"]


def test_an_entropy_model_logs_phi_times_its_row_entropy(tiny_bert, corpus):
    tokenizer, encoder = common.load_encoder(str(tiny_bert))
    data = {"text": common.tokenize(tokenizer, inputs.read_sentences(corpus)[:8], 16)}
    batch = common.device_batch(data, np.arange(8), None, torch.device("cpu"))
    _, stats = rcl.EntropyModel(encoder, "cls_before_pooler", 0.04, 0.05).train()(batch)
    assert float(stats["phi_entropy"]) == pytest.approx(0.04 * float(stats["entropy"]), rel=1e-6)
    assert float(stats["entropy"]) > 0


@pytest.mark.parametrize("what", ["end", run_folder.DONE])
def test_an_entropy_model_that_cannot_be_written_ends_in_one_line_and_resume_finishes(
        what, tiny_bert, small_sts, corpus, tmp_path, cache_dir, monkeypatch, capsys):
    """A full disk when an entropy model's end/ or DONE.json is written: one line, exit 4, naming
    its intact checkpoint (last/ of its final step); --resume then completes both stages."""
    out = tmp_path / "run"
    flags = _common_flags(tiny_bert, small_sts, out, cache_dir, ["--data", str(corpus)])
    real_dir, real_text = export.save_pretrained_dir, atomic_writes.write_text_atomic

    def full(path):
        if Path(path).name == what and Path(path).parent.name == "entropy_phi0.01":
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(run_folder, "save_pretrained_dir",
                        lambda path, *a, **k: (full(path), real_dir(path, *a, **k)))
    monkeypatch.setattr(run_folder, "write_text_atomic",
                        lambda path, text: (full(path), real_text(path, text)))
    with pytest.raises(SystemExit) as e:
        common.run_main(rcl.main, flags)
    folder = out / "entropy_phi0.01"
    err = capsys.readouterr().err
    assert e.value.code == 4 and "Traceback" not in err, err[-3000:]
    assert (f"could not write {folder / what}: No space left on device. the last complete checkpoint, "
            f"step 3, is intact in {folder / 'last'}") in err, err[-3000:]
    assert not (folder / run_folder.DONE).exists()
    monkeypatch.undo()
    res = rcl.main(flags + ["--resume"])
    assert res["test"]["avg"] > 0 and (folder / run_folder.DONE).is_file() and (folder / "end").is_dir()
    assert json.loads((folder / run_folder.DONE).read_text())["steps"] == 3


def test_stage1_summary_after_early_stop_and_resume(tiny_bert, small_sts, nli_csv, tmp_path, cache_dir,
                                                    monkeypatch, capsys):
    """An entropy model that stopped early says so in DONE.json and in the summary; a resumed
    run that reuses it prints the same figures without measuring anything again."""
    out = tmp_path / "run"
    args = rcl.Args(model=str(tiny_bert), data=str(nli_csv),
                    sts_dir=str(small_sts), output_dir=str(out), cache_dir=str(cache_dir),
                    batch_size=8, max_len=16, max_steps=6, eval_every=2, lr=1e-3, phi=[0.03])
    tok, _ = common.load_encoder(args.model)
    data = common.tokenize_columns(args, tok, common.load_columns(args.data))
    monkeypatch.setattr(rcl, "early_stop", lambda patience, every: lambda step, loss: True)
    rcl.entropy_stage(args, _run(args), data)
    done = json.loads((out / "entropy_phi0.03" / run_folder.DONE).read_text())
    assert done["steps"] == 1 and done["stopped_early"] is True and done["best_step"] == 1   # asked at step 1
    assert done["dev_end"] == done["best_dev"]
    assert all(isinstance(done[k], float) for k in ("dev_start", "entropy_start", "entropy_end"))
    # the weights training stopped with are end/'s (and best/'s here: one evaluation): the same probe
    for kept in ("end", "best"):
        _, enc = common.load_encoder(str(out / "entropy_phi0.03" / kept))
        h = rcl.probe_entropy(rcl.EntropyModel(enc, "avg", 0.03, 0.05), data, args, torch.device("cpu"))
        assert done[f"entropy_{kept}"] == pytest.approx(h, rel=1e-5)
    first = capsys.readouterr().out
    row = rcl.summary_table([done]).splitlines()[-1]
    assert "stopped early at step 1 of 6" in first and row in first and "stopped early at step 1 of 6" in row

    monkeypatch.setattr(rcl, "train_entropy_model", lambda *a: pytest.fail("retrained"))
    monkeypatch.setattr(rcl, "probe_entropy", lambda *a: pytest.fail("measured again"))
    again_args = dataclasses.replace(args, resume=True)
    rcl.entropy_stage(again_args, _run(again_args), data)
    again = capsys.readouterr().out
    assert "reusing" in again and row in again and "row entropy start -> end" in again


def test_restart_reuses_entropy_models(tiny_bert, small_sts, nli_csv, tmp_path, cache_dir, monkeypatch):
    out = tmp_path / "run"
    nli = str(nli_csv)
    flags = _common_flags(tiny_bert, small_sts, out, cache_dir, ["--data", nli, "--eval_every", "3"])
    real_train = common.train

    def killed(args, run, *a, **k):
        res = real_train(args, run, *a, **k)
        if run.out.name == "entropy_phi0.02":  # after its last checkpoint, before DONE.json
            raise KeyboardInterrupt("killed")
        return res

    with monkeypatch.context() as m:
        m.setattr(common, "train", killed)
        with pytest.raises(KeyboardInterrupt):
            rcl.main(flags)
    e1, e2 = out / "entropy_phi0.01", out / "entropy_phi0.02"
    assert (e1 / run_folder.DONE).is_file() and not (e1 / "last").exists()   # finished: no optimizer state
    assert not (e2 / run_folder.DONE).exists() and (e2 / "last" / "state.pt").is_file()
    before1, before2 = (e1 / "metrics.jsonl").read_text(), (e2 / "metrics.jsonl").read_text()

    # without --resume nothing already trained is overwritten
    with pytest.raises(common.UserError, match="--resume"):
        rcl.main(flags)
    # a finished entropy model trained with other settings is not reused silently
    with pytest.raises(common.UserError, match="--tau"):
        rcl.main(flags + ["--resume", "--tau", "0.1"])

    calls = []
    real = rcl.train_entropy_model
    monkeypatch.setattr(rcl, "train_entropy_model",
                        lambda args, phi, *a: calls.append(phi) or real(args, phi, *a))
    res = rcl.main(flags + ["--resume"])
    assert calls == [0.02]                                  # phi=0.01 reused, not trained again
    assert (e1 / "metrics.jsonl").read_text() == before1
    # phi=0.02 resumed from its checkpoint at its last step: no step trained twice
    assert (e2 / run_folder.DONE).is_file() and (e2 / "metrics.jsonl").read_text() == before2
    assert res["test"] is not None and (out / "best" / "config.json").is_file()


# ------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------

def test_bad_flags(tiny_bert, small_sts, nli_csv, tmp_path, cache_dir):
    base = ["--model", str(tiny_bert), "--sts_dir", str(small_sts), "--cache_dir", str(cache_dir)]
    with pytest.raises(common.UserError, match="--tau"):
        rcl.main(base + ["--output_dir", str(tmp_path / "b"), "--tau", "0"])
    with pytest.raises(common.UserError, match="--data"):
        rcl.main(base + ["--output_dir", str(tmp_path / "c"), "--data", str(tmp_path / "missing.csv")])
    bad = tmp_path / "bad.csv"
    bad.write_text("query,index\na,b\n")
    with pytest.raises(common.UserError, match="sent0,sent1"):
        rcl.main(base + ["--output_dir", str(tmp_path / "d"), "--data", str(bad)])
    with pytest.raises(common.UserError, match="--batch_size"):
        rcl.main(base + ["--output_dir", str(tmp_path / "e"), "--data",
                         str(nli_csv), "--batch_size", "5000"])


# ------------------------------------------------------------------------------------
# What the review of the paper's rows changed: the stop, the regulating weights, stage 2
# ------------------------------------------------------------------------------------

def test_regulator_terms_match_loop():
    """Each regulator of Eq. (3) on its own, against the per-row loop; their sum is Eq. (3)
    less its contrastive term."""
    n, d, tau = 5, 6, 0.1
    q, ind = _rand(n, d, seed=80), _rand(2 * n, d, seed=81)
    aug_q = [_rand(n, d, seed=82 + i) for i in range(2)]
    aug_ind = [_rand(n, d, seed=84 + i) for i in range(2)]
    terms = rcl.regulator_terms(q, ind, aug_q, aug_ind, tau)
    for (t_q, t_ind), a_q, a_ind in zip(terms, aug_q, aug_ind):
        assert close(t_q, sum(_row_ce(q[i], list(a_q), i, tau) for i in range(n)) / n)
        assert close(t_ind, sum(_row_ce(ind[i], list(a_ind), i, tau) for i in range(n)) / n)
    assert close(sum(a + b for a, b in terms), rcl.regularized_loss(q, ind, aug_q, aug_ind, tau)
                 - rcl.contrastive_loss(q, ind, tau))


def test_the_stop_comes_at_a_check_between_evaluations(tiny_bert, small_sts, corpus, tmp_path, cache_dir):
    """App. A's early stop has its own interval: checks every 5 steps, evaluations every 20.
    Interval means 5.0, 4.9 | 4.95, 4.95, 4.92: three checks without a new low stop training at
    step 25, between two evaluations; the run is evaluated and checkpointed there, so last/ and
    the last dev figure are of the weights it stopped with. A resume trains no further."""
    means = [5.0, 4.9, 4.95, 4.95, 4.92, 4.8, 4.7, 4.6]
    losses = [m + z for m in means for z in (0.2, -0.1, 0.3, -0.3, -0.1)]        # noise summing to 0
    out = tmp_path / "run"
    checks = []
    stop = rcl.early_stop(3, 5)

    def spy(step, loss):
        fired = stop(step, loss)
        if stop.steps == 0:                               # a check came at this step
            checks.append((step, stop.best, stop.since))
        return fired
    spy.state_dict, spy.load_state_dict = stop.state_dict, stop.load_state_dict    # last/ keeps its state
    res = _train_scripted(tiny_bert, small_sts, corpus, out, cache_dir, losses, spy, eval_every=20)
    assert [s for s, _, _ in checks] == [5, 10, 15, 20, 25]
    assert [(b, n) for _, b, n in checks] == [(pytest.approx(5.0), 0), (pytest.approx(4.9), 0),
                                              (pytest.approx(4.9), 1), (pytest.approx(4.9), 2),
                                              (pytest.approx(4.9), 3)]
    assert res["steps"] == 25 and res["stopped_early"] and res["total"] == 40
    recs = _records(out / "metrics.jsonl")
    assert [r["step"] for r in recs if "stsb_dev" in r] == [20, 25]
    assert res["last_dev"] == [r["stsb_dev"] for r in recs if "stsb_dev" in r][-1]
    state = torch.load(out / "last" / "state.pt", weights_only=False)
    assert state["step"] == 25 and state["stopped_early"]
    args = rcl.Args(model=str(tiny_bert), data=str(corpus), sts_dir=str(small_sts), output_dir=str(out),
                    cache_dir=str(cache_dir), batch_size=8, max_len=16, max_steps=40, eval_every=20,
                    resume=True)
    tok, enc = common.load_encoder(args.model)
    model = Scripted(enc, losses)
    again = common.train(args, run_folder.RunFolder(args), model,
                         common.tokenize_columns(args, tok, common.load_columns(args.data)), tok,
                         args.pooler, should_stop=rcl.early_stop(3, 5), final_eval=False)
    assert again["steps"] == 25 and again["stopped_early"] and model.t == 0


def test_regulate_with_best_and_hard_negatives_in_stage_2(tiny_bert, small_sts, nli_csv, tmp_path,
                                                           cache_dir,
                                                          monkeypatch):
    """--regulate_with best: stage 2 holds each entropy model's best/ weights;
    --final_hard_negatives: the final model sees the contradictions too."""
    out = tmp_path / "run"
    frozen, columns, real_train = [], [], common.train

    def spy(args, run, model, data, *a, **kw):
        frozen.append(getattr(model, "entropy_encoders", None))
        columns.append(sorted(data))
        return real_train(args, run, model, data, *a, **kw)

    monkeypatch.setattr(common, "train", spy)
    rcl.main(_common_flags(tiny_bert, small_sts, out, cache_dir,
                           ["--data", str(nli_csv), "--eval_every", "1",
                            "--regulate_with", "best", "--final_hard_negatives"]))
    from safetensors.torch import load_file
    for f, phi in zip(frozen[2], ("0.01", "0.02")):
        best = load_file(str(out / f"entropy_phi{phi}" / "best" / "model.safetensors"))
        end = load_file(str(out / f"entropy_phi{phi}" / "end" / "model.safetensors"))
        assert all(torch.equal(v.cpu(), best[k]) for k, v in f.state_dict().items() if k in best)
        done = json.loads((out / f"entropy_phi{phi}" / run_folder.DONE).read_text())
        if done["best_step"] != done["steps"]:      # best/ and end/ differ: the test can tell them apart
            assert not all(torch.equal(best[k], end[k]) for k in best)
    assert columns == [["hard_neg", "sent0", "sent1"]] * 3


def test_final_model_without_hard_negatives_is_eq3(tiny_bert, nli_csv):
    """Stage 2's default: the batch without its hard_neg column, Eq. (3) on q = sent0 and
    ind = sent1; with the column, the contradictions are extra columns of the first term."""
    tok, enc = common.load_encoder(str(tiny_bert))
    batch = _nli_batch(tok, nli_csv)
    frozen = [rcl.load_frozen(Path(tiny_bert), torch.device("cpu"))]
    model = rcl.RCL(enc, "avg", 0.05, frozen, [0.01]).eval()
    with torch.no_grad():
        without, stats = model({k: v for k, v in batch.items() if k != "hard_neg"})
        q, pos, neg = (rcl.embed(enc, "avg", [batch[c]]) for c in ("sent0", "sent1", "hard_neg"))
        au_q, au_ind = (rcl.embed(frozen[0], "avg", [batch[c]]) for c in ("sent0", "sent1"))
        assert torch.allclose(without, rcl.regularized_loss(q, pos, [au_q], [au_ind], 0.05), atol=1e-5)
        with_neg, _ = model(batch)
        want = rcl.regularized_loss(q, torch.cat([pos, neg]), [au_q], [au_ind], 0.05)
        assert torch.allclose(with_neg, want, atol=1e-5)
    assert not torch.allclose(with_neg, without)
    assert {"contrastive", "regulators", "reg_q_phi0.01", "reg_ind_phi0.01"} == set(stats)


def test_summary_shows_each_row_entropy_beside_the_phi_zero_model():
    """phi = 0 is the control for what phi does (Sec. 3: phi > 0 lowers the row entropy)."""
    base = {"entropy_start": 1.2, "dev_start": 80.0, "best_dev": 81.0, "best_step": 10, "steps": 350,
            "total": 4306, "epoch_steps": 4306, "stopped_early": True, "dev_end": 80.5, "entropy_best": 1.0}
    recs = [{**base, "phi": 0.0, "entropy_end": 0.5}, {**base, "phi": 0.01, "entropy_end": 0.3},
            {**base, "phi": -0.01, "entropy_end": 0.9}]
    lines = rcl.summary_table(recs).splitlines()
    assert "+0.0000" in lines[2] and "-0.2000" in lines[3] and "+0.4000" in lines[4]
    assert "stopped early at step 350 of 4306 (8% of an epoch)" in lines[3]
    assert "80.00 -> 80.50" in lines[3]                      # the end/ weights' dev
    best = rcl.summary_table(recs, "best").splitlines()
    assert "1.2000 -> 1.0000" in best[3] and "80.00 -> 81.00" in best[3] and "+0.0000" in best[3]
    alone = rcl.summary_table(recs[1:]).splitlines()      # no phi = 0 model: nothing to compare with
    assert all(line.split()[4] == "-" for line in alone[2:])


# ------------------------------------------------------------------------------------
# The paper's rows a command selects (PAPER_ROWS through flags.select_rows), and a run's end
# ------------------------------------------------------------------------------------

def paper_rows(*argv: str) -> tuple[dict[str, common.PaperRow], str]:
    picked, note = flags.select_rows(common.parse_args(rcl.Args, list(argv)), rcl.PAPER_ROWS)
    return dict(picked), note


def test_paper_rows_per_phi_and_data():
    rows, note = paper_rows()                                          # the default: 4 phis on NLI
    assert note == "" and sorted(rows) == ["Tab. 3 RCL(ours)",
                                           "Tab. 4 Number of Regulator: 8 (phi = 0.01, 0.02, 0.03, 0.04)"]
    tab3 = rows["Tab. 3 RCL(ours)"].figures
    assert tab3["avg"] == 82.40 and tab3["STSBenchmark"] == 84.85
    assert np.mean([tab3[t] for t in common.STS_TASKS]) == pytest.approx(82.40, abs=0.01)
    assert all(r.headline() == [82.40] and "nli_for_simcse.csv" in r.note for r in rows.values())
    avg = {phi: {label: r.figures["avg"] for label, r in paper_rows("--phi", *phi.split())[0].items()}
           for phi in ("0.01", "0.01 0.02", "0.01 0.02 0.03", "0.01 0.02 0.03 0.04 0.05")}
    assert avg == {"0.01": {"Tab. 4 Number of Regulator: 2 (phi = 0.01)": 81.47},
                   "0.01 0.02": {"Tab. 4 Number of Regulator: 4 (phi = 0.01, 0.02)": 81.98},
                   "0.01 0.02 0.03": {"Tab. 4 Number of Regulator: 6 (phi = 0.01, 0.02, 0.03)": 82.29},
                   "0.01 0.02 0.03 0.04 0.05": {
                       "Tab. 4 Number of Regulator: 10 (phi = 0.01, 0.02, 0.03, 0.04, 0.05)": 82.42}}
    assert paper_rows("--phi", "0.02", "0.01")[0] == {}                # Tab. 4's phis, in its order
    assert paper_rows("--data", "/mnt/nli/nli_for_simcse.csv")[0].keys() == rows.keys()   # by name
    # no row: the controls the paper does not give, a text file (the unsupervised form), another CSV
    for argv in (["--phi"], ["--phi", "0", "0.01", "0.02", "0.03", "0.04"],
                 ["--data", "data/wiki1m_for_simcse.txt"], ["--data", "data/nli_sample.csv"],
                 ["--lr", "3e-5"], ["--final_hard_negatives"]):
        picked, note = paper_rows(*argv)
        assert picked == {} and note.startswith("the paper reports no row"), argv
    assert paper_rows("--phi")[1].endswith("--phi")
    # a model the paper did not train shows SRoBERTa-base's rows, labelled so
    rows, note = paper_rows("--model", "sentence-transformers/all-MiniLM-L6-v2", "--phi", "0.01")
    assert list(rows) == ["Tab. 4 Number of Regulator: 2 (phi = 0.01) [paper: "
                          "sentence-transformers/nli-roberta-base-v2]"] and "not a model" in note


def test_end_to_end_prints_its_paper_row(tiny_bert, small_sts, nli_csv, tmp_path, cache_dir, capsys):
    """A tiny run of both stages at the paper's settings (batch 64, the defaults) on a file named
    as SimCSE's NLI triplets ends with Tab. 4's row for its phi beside its own figures."""
    data = tmp_path / "nli_for_simcse.csv"                             # the rows need this CSV
    data.write_text(nli_csv.read_text(encoding="utf-8"), encoding="utf-8")
    out = tmp_path / "run"
    rcl.main(["--model", str(tiny_bert), "--data", str(data), "--sts_dir", str(small_sts),
              "--output_dir", str(out), "--cache_dir", str(cache_dir), "--max_steps", "2", "--phi", "0.01"])
    printed = capsys.readouterr().out
    label = "Tab. 4 Number of Regulator: 2 (phi = 0.01) [paper: sentence-transformers/nli-roberta-base-v2]"
    line = next(line for line in printed.splitlines() if line.startswith(label))
    assert line.split()[-1] == "81.47" and "this run" in printed
    assert f"({label}: on the NLI triplets (nli_for_simcse.csv)" in printed
    saved = json.loads((out / "best" / "test_metrics.json").read_text())
    assert [r["label"] for r in saved["paper_rows"]] == [label]
