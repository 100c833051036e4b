"""Tests of ifcl.py: every equation against a per-row loop written from the paper, the queue,
the fusion, the reduction to SimCSE, the German file's checks and first run, and tiny end-to-end
runs (the translation itself: tests/test_translate.py)."""

from __future__ import annotations

import copy
import json
import math
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import common
import ifcl
import simcse
from conftest import ROOT, assert_matches_paper, cpu_env, run_base
from plumbing import checkpoint, flags, inputs
from plumbing import translation as translate

TAU = 0.05


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


# -------------------------------------------------------------------------------------
# Eq. (4): forgetting coefficients
# -------------------------------------------------------------------------------------

def test_forgetting_coefficients_loop_416_of_64():
    lam, N, M = 0.002, 64, 416
    p = ifcl.forgetting_coefficients(M, N, lam)
    assert p.shape == (M,)
    for idx in range(M):
        m = idx + 1                                   # the paper counts m from 1
        assert_matches_paper(p[idx], 1 - lam * math.ceil(m / N), "forgetting_coefficients", "IFCL Eq. (4)",
                             abs=1e-7, reference=f"p_m = 1 - lambda ceil(m / N) at m = {m}")
    assert p[0].item() == pytest.approx(1 - lam)       # the newest batch: 1 - lambda
    assert p[63].item() == pytest.approx(1 - lam) and p[64].item() == pytest.approx(1 - 2 * lam)
    assert p[415].item() == pytest.approx(1 - 7 * lam)  # the half batch at the end: ceil(416/64) = 7
    assert ifcl.forgetting_coefficients(0, N, lam).shape == (0,)


# -------------------------------------------------------------------------------------
# Eq. (6), (7), (8): losses against per-row loops
# -------------------------------------------------------------------------------------

def identical_loop(h, h_pos, queue, p, tau):
    N, total = h.shape[0], 0.0
    for i in range(N):
        num = math.exp(cos(h[i], h_pos[i]) / tau)
        den = sum(math.exp(cos(h[i], h_pos[j]) / tau) for j in range(N))
        phi = sum(float(p[m]) * math.exp(cos(h[i], queue[m]) / tau) for m in range(queue.shape[0]))
        total += -math.log(num / (den + phi))
    return total / N


@pytest.mark.parametrize("N,M", [(5, 7), (4, 0), (1, 3), (1, 0)])
def test_identical_loss_matches_loop(N, M):
    g = torch.Generator().manual_seed(N * 10 + M)
    h = torch.randn(N, 6, generator=g, dtype=torch.float64)
    h_pos = torch.randn(N, 6, generator=g, dtype=torch.float64)
    queue = torch.randn(M, 6, generator=g, dtype=torch.float64)
    p = torch.rand(M, generator=g, dtype=torch.float64) * 0.9 + 0.1   # uneven: order matters
    got = ifcl.identical_loss(h, h_pos, queue, p, TAU)
    assert got.dim() == 0
    assert_matches_paper(got, identical_loop(h, h_pos, queue, p, TAU), "identical_loss", "IFCL Eq. (6)",
                         rel=1e-5, abs=1e-6)
    if M:  # the weights belong to their slots: reversing them changes the loss (a warmer tau
        # so that the queue's share is well above rounding)
        warm = float(ifcl.identical_loss(h, h_pos, queue, p, 0.5))
        assert_matches_paper(warm, identical_loop(h, h_pos, queue, p, 0.5), "identical_loss", "IFCL Eq. (6)",
                             rel=1e-6, reference="the paper's per-row loop at tau 0.5")
        assert float(ifcl.identical_loss(h, h_pos, queue, p.flip(0), 0.5)) != pytest.approx(warm, rel=1e-4)


def test_identical_loss_ties_and_zero_weight_slots():
    # ties: every similarity equal -> the loss is log(N + sum p)
    h = torch.ones(3, 4, dtype=torch.float64)
    q = torch.ones(5, 4, dtype=torch.float64)
    p = torch.tensor([1.0, 0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    assert_matches_paper(ifcl.identical_loss(h, h, q, p, TAU), math.log(3 + 2.0), "identical_loss",
                         "IFCL Eq. (6)", reference="every similarity tied: log(N + sum p)")
    # slots with p = 0 (not filled yet) count for nothing, whatever they hold
    g = torch.Generator().manual_seed(1)
    h, h_pos = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    full = ifcl.identical_loss(h, h_pos, torch.randn(8, 6, generator=g), torch.zeros(8), TAU)
    empty = ifcl.identical_loss(h, h_pos, torch.zeros(0, 6), torch.zeros(0), TAU)
    assert float(full) == pytest.approx(float(empty), rel=1e-6)
    assert_matches_paper(empty, simcse.simcse_loss(h, h_pos, TAU), "identical_loss with an empty queue",
                         "SimCSE Eq. (4) (IFCL Eq. (6) with phi = 0)", rel=1e-6, reference="simcse_loss")


def test_no_gradient_reaches_the_queue():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(4, 6, generator=g, requires_grad=True)
    queue = torch.randn(8, 6, generator=g, requires_grad=True)
    ifcl.identical_loss(h, h.detach() + 0.1, queue, torch.full((8,), 0.9), TAU).backward()
    assert queue.grad is None
    assert h.grad is not None and h.grad.abs().sum() > 0


def test_fraternal_loss_matches_loop():
    g = torch.Generator().manual_seed(3)
    for N in (1, 6):
        h = torch.randn(N, 5, generator=g, dtype=torch.float64)
        hf = torch.randn(N, 5, generator=g, dtype=torch.float64)
        want = sum(-math.log(math.exp(cos(h[i], hf[i]) / TAU)
                             / sum(math.exp(cos(h[i], hf[j]) / TAU) for j in range(N)))
                   for i in range(N)) / N
        got = ifcl.fraternal_loss(h, hf, TAU)
        assert got.dim() == 0
        assert_matches_paper(got, want, "fraternal_loss", "IFCL Eq. (7)", rel=1e-6, abs=1e-9)


def test_twins_loss_matches_loop():
    g = torch.Generator().manual_seed(4)
    N = 7
    h, hp, hf = (torch.randn(N, 5, generator=g, dtype=torch.float64) for _ in range(3))
    margin = torch.randn(N, generator=g, dtype=torch.float64) * 0.5   # both signs inside |.|
    want = sum(abs(math.exp(cos(h[i], hp[i])) - math.exp(cos(h[i], hf[i])) - float(margin[i]))
               for i in range(N)) / N
    got = ifcl.twins_loss(h, hp, hf, margin)
    assert got.dim() == 0
    assert_matches_paper(got, want, "twins_loss", "IFCL Eq. (8)", rel=1e-6)
    # swapping the identical and the fraternal view is a different loss
    assert float(ifcl.twins_loss(h, hf, hp, margin)) != pytest.approx(want)


def test_innate_margin_matches_loop():
    """Eq. (8)'s M_i = e^{sim(emb_i, emb_i^+)} - e^{sim(emb_i, emb_i^-)}, each emb the mean of the
    row's own tokens (the anchor's: the three views are one sentence), written per row."""
    g = torch.Generator().manual_seed(5)
    N, L, d = 4, 6, 5
    emb, emb_pos, emb_frat = (torch.randn(N, L, d, generator=g, dtype=torch.float64) for _ in range(3))
    lengths = [1, 3, 6, 4]                                   # a one-token row and a full row among them
    mask = torch.tensor([[int(t < n) for t in range(L)] for n in lengths])
    got = ifcl.innate_margin(emb, emb_pos, emb_frat, mask)
    assert got.shape == (N,) and not got.requires_grad
    for i in range(N):
        e, ep, ef = (sum(x[i, t] for t in range(lengths[i])) / lengths[i] for x in (emb, emb_pos, emb_frat))
        assert_matches_paper(got[i], math.exp(cos(e, ep)) - math.exp(cos(e, ef)), "innate_margin",
                             "IFCL Eq. (8)'s M_i", rel=1e-6, reference=f"the paper's M_i of row {i}")
    # what lies past a row's tokens (padding, the longer German side's positions) counts for nothing
    changed = emb_frat.clone()
    changed[mask == 0] = torch.randn(int((mask == 0).sum()), d, generator=g, dtype=torch.float64)
    assert torch.equal(ifcl.innate_margin(emb, emb_pos, changed, mask), got)
    # ties: three identical views have no margin; the fraternal view as close as the identical one too
    assert torch.equal(ifcl.innate_margin(emb, emb, emb, mask), torch.zeros(N, dtype=torch.float64))
    assert torch.allclose(ifcl.innate_margin(emb, emb_pos, emb_pos, mask), torch.zeros(N).double())
    # detached even when the inputs carry gradient
    assert not ifcl.innate_margin(emb.requires_grad_(), emb_pos, emb_frat, mask).requires_grad


@pytest.mark.parametrize("fuse", ["layer", "word"])
def test_the_models_margin_reads_the_anchors_tokens_only(fuse):
    """In the model: the German side padded out past the English sentence (the union mask grows)
    leaves M_i as it was; with eps = 1 and dropout off the three views are one, and M_i = 0."""
    enc, enc_f = tiny_encoder(dropout=0.0, seed=7), tiny_encoder(vocab=60, dropout=0.0, seed=8)
    x = ids_batch([3, 5, 2, 4], seed=5)
    short = ids_batch([3, 5, 2, 4], vocab=60, seed=6)             # as long as the English rows
    longer = ids_batch([6, 7, 5, 7], vocab=60, seed=7)            # the same rows, German tokens past them
    for i, n in enumerate([3, 5, 2, 4]):
        longer["input_ids"][i, :n] = short["input_ids"][i, :n]

    def margin(eps, xf):
        model = ifcl.IFCL(copy.deepcopy(enc), copy.deepcopy(enc_f).embeddings, make_args(fuse=fuse, eps=eps),
                          0, 0).eval()                            # eval: no dropout
        with torch.no_grad():
            return model({"text": x, "frat": xf})[1]["margin"]
    m_short, m_longer = margin(0.9, short), margin(0.9, longer)
    assert float(m_short) != pytest.approx(0, abs=1e-4)          # the fusion makes a margin
    assert float(m_longer) == pytest.approx(float(m_short), abs=1e-6)
    assert float(margin(1.0, longer)) == pytest.approx(0, abs=1e-6)


def test_fixed_margin():
    assert ifcl.fixed_margin(0.85, 0.80) == pytest.approx(math.exp(0.85) - math.exp(0.80))


@pytest.mark.parametrize("eps", [0.9, 0.0, 1.0])
def test_fuse_eq3_matches_loop(eps):
    g = torch.Generator().manual_seed(6)
    N, L, d = 3, 4, 5
    y, y_frat = (torch.randn(N, L, d, generator=g, dtype=torch.float64) for _ in range(2))
    got = ifcl.fuse(y, y_frat, eps)
    assert got.shape == (N, L, d)
    for i in range(N):
        for t in range(L):            # position by position: token t of x with token t of x^-
            for k in range(d):
                want = eps * float(y[i, t, k]) + (1 - eps) * float(y_frat[i, t, k])
                assert_matches_paper(got[i, t, k], want, "fuse", "IFCL Eq. (3)", abs=1e-12,
                                     reference=f"eps y + (1 - eps) y^- at row {i}, token {t}")
    if eps == 1.0:                    # the ends: the English input alone, the German alone
        assert torch.equal(got, y)
    if eps == 0.0:
        assert torch.equal(got, y_frat)


def test_twins_stats_match_loop_and_queue_fill():
    g = torch.Generator().manual_seed(8)
    N = 6
    h, hp, hf = (torch.randn(N, 5, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    got = ifcl.twins_stats(h, hp, hf)
    assert set(got) == {"cos_identical", "cos_fraternal", "twins_gap"}
    assert all(v.dim() == 0 and not v.requires_grad for v in got.values())
    c_pos = [cos(h[i].detach(), hp[i].detach()) for i in range(N)]
    c_frat = [cos(h[i].detach(), hf[i].detach()) for i in range(N)]
    assert float(got["cos_identical"]) == pytest.approx(sum(c_pos) / N, rel=1e-9)
    assert float(got["cos_fraternal"]) == pytest.approx(sum(c_frat) / N, rel=1e-9)
    gap = sum(math.exp(a) - math.exp(b) for a, b in zip(c_pos, c_frat)) / N
    assert float(got["twins_gap"]) == pytest.approx(gap, rel=1e-9)
    assert set(ifcl.twins_stats(h, hp)) == {"cos_identical"}             # no fraternal twins
    same = ifcl.twins_stats(h, h, h)                                     # the edge: all alike
    assert float(same["cos_identical"]) == pytest.approx(1) and float(same["twins_gap"]) == pytest.approx(0)
    for filled, share in [(0, 0.0), (208, 0.5), (416, 1.0)]:
        assert float(ifcl.queue_fill(torch.tensor(filled), 416)) == share


# -------------------------------------------------------------------------------------
# The model: queue, fusion, reduction to SimCSE (random tiny BERTs, no tokenizer needed)
# -------------------------------------------------------------------------------------

def tiny_encoder(vocab=50, hidden=16, dropout=0.15, seed=0):
    from transformers import BertConfig, BertModel
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=dropout,
                     attention_probs_dropout_prob=dropout)
    return BertModel(cfg, add_pooling_layer=True)


def make_args(**kw):
    return replace(ifcl.Args(), **kw)


def ids_batch(lengths, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.randint(5, vocab, (len(lengths), L), generator=g)
    mask = torch.tensor([[int(t < n) for t in range(L)] for n in lengths])
    return {"input_ids": ids * mask, "attention_mask": mask}


def test_queue_fifo_with_416_slots_and_batches_of_64():
    args = make_args(queue_len=416, batch_size=64, no_fraternal=True, no_twins=True)
    model = ifcl.IFCL(tiny_encoder(), None, args, 0, 0)
    assert model.queue.shape == (416, 16)
    assert float(model.queue_weights(64).abs().sum()) == 0        # step 0: the queue is empty
    for b in range(7):
        model.push(torch.full((64, 16), float(b)) + torch.arange(64.0)[:, None] / 100)
        assert int(model.filled) == min(64 * (b + 1), 416)
    q = model.queue[:, 0]
    for k in range(6):                                             # slot block k = batch 6 - k
        assert torch.allclose(q[64 * k:64 * (k + 1)], 6 - k + torch.arange(64.0) / 100)
    assert torch.allclose(q[384:416], 0 + torch.arange(32.0) / 100)  # half of the oldest batch
    p = model.queue_weights(64)
    assert torch.allclose(p, ifcl.forgetting_coefficients(416, 64, 0.002))
    assert p[415] == pytest.approx(1 - 7 * 0.002)
    # one push after the first: only the filled slots weigh
    fresh = ifcl.IFCL(tiny_encoder(), None, args, 0, 0)
    fresh.push(torch.randn(64, 16))
    w = fresh.queue_weights(64)
    assert torch.allclose(w[:64], torch.full((64,), 1 - 0.002)) and bool((w[64:] == 0).all())


def test_everything_off_is_simcse_and_the_queue_fills():
    torch.manual_seed(0)
    enc = tiny_encoder()
    stock = copy.deepcopy(enc)                                     # untouched by IFCL's hook
    args = make_args(no_fraternal=True, no_twins=True, no_queue=True, tau=TAU)
    model = ifcl.IFCL(enc, None, args, 0, 0).train()
    stock.train()
    x = ids_batch([3, 5, 4, 2])
    torch.manual_seed(7)
    loss, terms = model({"text": x})
    torch.manual_seed(7)   # the same dropout masks: the moved embedding dropout draws as BERT's did
    out = stock(**common.concat_batches([x, x]))
    z = model.mlp(out.last_hidden_state[:, 0])
    want = simcse.simcse_loss(z[:4], z[4:], TAU)
    assert_matches_paper(loss.detach(), want.detach(), "IFCL with its additions off", "SimCSE Eq. (4)",
                         rel=1e-6, reference="simcse_loss on the same dropout masks")
    assert set(terms) == {"l_identical", "cos_identical"}         # no queue: no queue_fill
    # with the queue on, step 0 is still SimCSE, and the anchors enter the queue
    model_q = ifcl.IFCL(copy.deepcopy(stock), None, replace(args, no_queue=False, queue_len=6), 0, 0)
    model_q.mlp.load_state_dict(model.mlp.state_dict())
    torch.manual_seed(7)
    loss_q, _ = model_q({"text": x})
    assert_matches_paper(loss_q.detach(), want.detach(), "IFCL with an empty queue", "SimCSE Eq. (4)",
                         rel=1e-6, reference="simcse_loss on the same dropout masks")
    assert int(model_q.filled) == 4 and torch.allclose(model_q.queue[:4], z[:4].detach(), atol=1e-6)
    assert "queue" in model_q.state_dict() and "filled" in model_q.state_dict()  # resumed with the run


@pytest.mark.parametrize("fuse", ["layer", "word"])
def test_fusion_eq3(fuse):
    enc, enc_f = tiny_encoder(dropout=0.0, seed=1), tiny_encoder(vocab=60, dropout=0.0, seed=2)
    stock_emb = copy.deepcopy(enc.embeddings)
    args = make_args(fuse=fuse, eps=0.9)
    model = ifcl.IFCL(enc, enc_f.embeddings, args, 0, 0).train()
    x, xf = ids_batch([3, 5, 2], seed=1), ids_batch([4, 2, 6], vocab=60, seed=2)
    z, emb, mask, mask_frat = model.three_views({"text": x, "frat": xf})
    N, L = 3, 6
    assert z.shape == (3 * N, 16) and emb.shape == (3 * N, L, 16)
    assert torch.equal(mask_frat, torch.maximum(F.pad(x["attention_mask"], (0, 1)), xf["attention_mask"]))
    ids = F.pad(x["input_ids"], (0, 1))
    y = stock_emb(input_ids=ids)                                   # BEL_S(x), (N, L, d)
    if fuse == "layer":   # Eq. (3) on the embedding layer's outputs
        want = 0.9 * y + 0.1 * enc_f.embeddings(input_ids=xf["input_ids"])
    else:                 # Eq. (3) on the word embeddings, then position, type and LayerNorm
        w = 0.9 * stock_emb.word_embeddings(ids) + 0.1 * enc_f.embeddings.word_embeddings(xf["input_ids"])
        want = stock_emb(inputs_embeds=w)
    assert torch.allclose(emb[:N], y, atol=1e-5) and torch.allclose(emb[N:2 * N], y, atol=1e-5)
    assert torch.allclose(emb[2 * N:], want, atol=1e-5)
    assert not torch.allclose(emb[2 * N:], y, atol=1e-3)


def test_full_model_loss_is_the_sum_of_the_three_terms():
    enc, enc_f = tiny_encoder(seed=3), tiny_encoder(vocab=60, seed=4)
    model = ifcl.IFCL(enc, enc_f.embeddings, make_args(queue_len=8), 0, 0).train()
    batch = {"text": ids_batch([3, 5, 2, 4]), "frat": ids_batch([4, 2, 6, 3], vocab=60, seed=2)}
    loss, terms = model(batch)
    assert set(terms) == {"l_identical", "l_fraternal", "l_twins", "margin", "cos_identical", "cos_fraternal",
                          "twins_gap", "queue_fill"}
    total = terms["l_identical"] + terms["l_fraternal"] + terms["l_twins"]
    assert_matches_paper(loss.detach(), total, "IFCL's loss", "IFCL Eq. (9)",
                         reference="the sum of its three terms")
    loss.backward()
    assert enc.encoder.layer[0].output.dense.weight.grad is not None
    assert enc.embeddings.word_embeddings.weight.grad is None      # BEL_S frozen (Eq. 1)
    assert all(p.grad is None for p in enc_f.embeddings.parameters())  # BEL_F frozen
    assert int(model.filled) == 4
    _, terms2 = model(batch)
    assert "l_twins" in terms2 and int(model.filled) == 8


def tiny_roberta(vocab=50, hidden=16, seed=0):
    from transformers import RobertaConfig, RobertaModel
    torch.manual_seed(seed)
    cfg = RobertaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=40, pad_token_id=1,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return RobertaModel(cfg, add_pooling_layer=True)


@pytest.mark.parametrize("arch", ["bert", "roberta"])
def test_f_theta_is_the_encoders_own_forward_after_its_embedding_layer(arch):
    """f_theta (the layers on a given embedding output, with the mask we build) equals the
    model's own forward on the token ids, padding included, in BERT and RoBERTa."""
    enc, pad = (tiny_encoder(dropout=0.0), 0) if arch == "bert" else (tiny_roberta(), 1)
    stock = copy.deepcopy(enc).eval()
    model = ifcl.IFCL(enc, None, make_args(no_fraternal=True, no_mlp=True), pad, pad).eval()
    x = ids_batch([3, 6, 1, 4])
    x["input_ids"] = x["input_ids"] * x["attention_mask"] + pad * (1 - x["attention_mask"])
    want = stock(**x).last_hidden_state[:, 0]                            # (N, d)
    got = model.f_theta(enc.embeddings(input_ids=x["input_ids"]), x["attention_mask"])
    assert torch.allclose(got, want, atol=1e-6)
    # the mask matters: attending to the padding too gives other [CLS] vectors
    ones = torch.ones_like(x["attention_mask"])
    assert not torch.allclose(model.f_theta(enc.embeddings(input_ids=x["input_ids"]), ones), want, atol=1e-4)


def per_row_reference(stock, bel_f, mlp, x, xf, eps, fuse):
    """h, h^+, h^- and emb, emb^+, emb^- of each row alone, straight from Eq. (2)-(3) with dropout
    off, through the stock encoder's own forward: for h^- its embedding layer's output is
    replaced by the fused one (--fuse layer; a hook here, in the reference only), or the fused
    word embeddings go in as inputs_embeds (--fuse word)."""
    L = max(x["input_ids"].shape[1], xf["input_ids"].shape[1])
    ids = F.pad(x["input_ids"], (0, L - x["input_ids"].shape[1]))
    ids_f = F.pad(xf["input_ids"], (0, L - xf["input_ids"].shape[1]))
    mask = F.pad(x["attention_mask"], (0, L - x["attention_mask"].shape[1]))
    mask_f = F.pad(xf["attention_mask"], (0, L - xf["attention_mask"].shape[1]))
    rows = []
    for i in range(ids.shape[0]):
        xi, fi = ids[i:i + 1], ids_f[i:i + 1]                            # (1, L)
        union = torch.maximum(mask[i:i + 1], mask_f[i:i + 1])           # (1, L)
        y = stock.embeddings(input_ids=xi)                               # (1, L, d)
        h = mlp(stock(input_ids=xi, attention_mask=mask[i:i + 1]).last_hidden_state[:, 0])
        if fuse == "layer":
            emb_frat = eps * y + (1 - eps) * bel_f(input_ids=fi)         # Eq. (3)
            hook = stock.embeddings.register_forward_hook(lambda m, inp, out: emb_frat)
            out = stock(input_ids=xi, attention_mask=union)
            hook.remove()
        else:
            w = eps * stock.embeddings.word_embeddings(xi) + (1 - eps) * bel_f.word_embeddings(fi)
            emb_frat = stock.embeddings(inputs_embeds=w)
            out = stock(inputs_embeds=w, attention_mask=union)
        rows.append((h, h, mlp(out.last_hidden_state[:, 0]), y, y, emb_frat))
    return [torch.cat(c) for c in zip(*rows)]                            # h, h+, h-, emb, emb+, emb-


@pytest.mark.parametrize("fuse", ["layer", "word"])
def test_three_views_and_loss_match_a_per_row_reference(fuse):
    enc, enc_f = tiny_encoder(dropout=0.0, seed=5), tiny_encoder(vocab=60, dropout=0.0, seed=6)
    stock = copy.deepcopy(enc).eval()
    args = make_args(fuse=fuse, eps=0.9, queue_len=8, tau=TAU)
    model = ifcl.IFCL(enc, enc_f.embeddings, args, 0, 0).train()
    # x^- longer than x in some rows (the fused rows attend over the union), shorter in others
    batch = {"text": ids_batch([3, 5, 2, 4], seed=3), "frat": ids_batch([4, 2, 6, 3], vocab=60, seed=4)}
    with torch.no_grad():
        h, h_pos, h_frat, emb, emb_pos, emb_frat = per_row_reference(
            stock, enc_f.embeddings, model.mlp, batch["text"], batch["frat"], 0.9, fuse)
        z, emb3, mask, _ = model.three_views(batch)
    assert torch.allclose(z, torch.cat([h, h_pos, h_frat]), atol=1e-5)
    assert torch.allclose(emb3, torch.cat([emb, emb_pos, emb_frat]), atol=1e-5)
    loss, terms = model(batch)                                           # step 0: the queue is empty
    margin = ifcl.innate_margin(emb, emb_pos, emb_frat, mask)
    want = (ifcl.identical_loss(h, h_pos, torch.zeros(0, 16), torch.zeros(0), TAU)
            + ifcl.fraternal_loss(h, h_frat, TAU) + ifcl.twins_loss(h, h_pos, h_frat, margin))
    assert_matches_paper(loss.detach(), want, "IFCL's loss", "IFCL Eq. (9)", rel=1e-5,
                         reference="Eq. (6) + (7) + (8) on a per-row reference's views")


def test_a_roberta_embedding_layer_serves_as_bel_f():
    """BEL_F of another architecture (RoBERTa's, as XLM-R large's for BERT-large): the German
    side is padded with its own pad id (1), and its positions are counted as RoBERTa counts them."""
    enc, enc_f = tiny_encoder(dropout=0.0, seed=1), tiny_roberta(vocab=60, seed=2)
    stock_emb = copy.deepcopy(enc.embeddings)
    model = ifcl.IFCL(enc, enc_f.embeddings, make_args(eps=0.9, queue_len=8), 0, 1).train()
    x, xf = ids_batch([3, 5, 2], seed=1), ids_batch([4, 2, 3], vocab=60, seed=2)     # L = 5 and 4
    xf["input_ids"] = xf["input_ids"] * xf["attention_mask"] + (1 - xf["attention_mask"])
    _, emb, _, _ = model.three_views({"text": x, "frat": xf})
    y = stock_emb(input_ids=x["input_ids"])                                   # (N, 5, d)
    padded = F.pad(xf["input_ids"], (0, 1), value=1)                          # (N, 5)
    assert torch.allclose(emb[6:], 0.9 * y + 0.1 * enc_f.embeddings(input_ids=padded), atol=1e-5)
    bert_padded = F.pad(xf["input_ids"], (0, 1), value=0)                     # BERT's pad id: wrong here
    assert not torch.allclose(emb[6:], 0.9 * y + 0.1 * enc_f.embeddings(input_ids=bert_padded), atol=1e-4)
    loss, terms = model({"text": x, "frat": xf})
    assert torch.isfinite(loss) and "l_twins" in terms


def test_dropout_comes_after_the_fusion():
    """Algorithm 1, line 6: emb^- = Dropout(Fusion(...)): the fused rows are the fused values,
    some zeroed and the rest scaled by 1/(1 - rho); each view has its own dropout mask."""
    rho = 0.5
    enc, enc_f = tiny_encoder(dropout=rho, seed=7), tiny_encoder(vocab=60, seed=8)
    stock_emb = copy.deepcopy(enc.embeddings).eval()                      # no dropout of its own
    model = ifcl.IFCL(enc, enc_f.embeddings, make_args(eps=0.9), 0, 0).train()
    x, xf = ids_batch([3, 5, 2], seed=1), ids_batch([3, 5, 2], vocab=60, seed=2)
    torch.manual_seed(0)
    _, emb, _, _ = model.three_views({"text": x, "frat": xf})
    N = 3
    y = stock_emb(input_ids=x["input_ids"])                               # (N, L, d)
    fused = 0.9 * y + 0.1 * enc_f.embeddings.eval()(input_ids=xf["input_ids"])
    for view, clean in [(emb[:N], y), (emb[N:2 * N], y), (emb[2 * N:], fused)]:
        kept = view != 0
        assert 0.3 < float(kept.float().mean()) < 0.7                       # about 1 - rho kept
        assert torch.allclose(view[kept], clean[kept] / (1 - rho), atol=1e-5)
    assert not torch.equal(emb[:N] != 0, emb[N:2 * N] != 0)               # z_i and z_i^+ differ


def test_no_mlp_trains_on_raw_cls_and_queues_it():
    """--no_mlp (Sentence-BERT's pipeline): no MLP parameters, the loss and the queue use the
    raw [CLS]; by default (SimCSE's recipe) the MLP is there."""
    torch.manual_seed(0)
    enc = tiny_encoder()
    stock = copy.deepcopy(enc)
    default = ifcl.IFCL(copy.deepcopy(enc), None, make_args(no_fraternal=True, no_twins=True), 0, 0)
    mlp = {k for k, _ in default.named_parameters() if k.startswith("mlp.")}
    assert mlp == {"mlp.dense.weight", "mlp.dense.bias"}
    assert common.parse_args(ifcl.Args, ["--no_mlp"]).no_mlp and not ifcl.Args().no_mlp
    args = make_args(no_fraternal=True, no_twins=True, queue_len=6, tau=TAU, no_mlp=True)
    model = ifcl.IFCL(enc, None, args, 0, 0).train()
    assert model.mlp is None and not any("mlp" in k for k, _ in model.named_parameters())
    x = ids_batch([3, 5, 4, 2])
    torch.manual_seed(7)
    loss, _ = model({"text": x})
    torch.manual_seed(7)
    z = stock.train()(**common.concat_batches([x, x])).last_hidden_state[:, 0]   # raw [CLS], (2N, d)
    want = simcse.simcse_loss(z[:4], z[4:], TAU).detach()
    assert_matches_paper(loss.detach(), want, "IFCL with --no_mlp", "SimCSE Eq. (4)", rel=1e-6,
                         reference="simcse_loss on the raw [CLS]")
    assert torch.allclose(model.queue[:4], z[:4].detach(), atol=1e-6)
    # the full model too: h, h^+, h^- are the raw [CLS] of the per-row reference
    enc, enc_f = tiny_encoder(dropout=0.0, seed=5), tiny_encoder(vocab=60, dropout=0.0, seed=6)
    stock = copy.deepcopy(enc).eval()
    full = ifcl.IFCL(enc, enc_f.embeddings, make_args(no_mlp=True), 0, 0).train()
    batch = {"text": ids_batch([3, 5, 2, 4], seed=3), "frat": ids_batch([4, 2, 6, 3], vocab=60, seed=4)}
    with torch.no_grad():
        ref = per_row_reference(stock, enc_f.embeddings, lambda v: v, batch["text"], batch["frat"], 0.9,
                                "layer")
        assert torch.allclose(full.three_views(batch)[0], torch.cat(ref[:3]), atol=1e-5)


# -------------------------------------------------------------------------------------
# The paper's rows: which ones a command selects; the fraternal model's width
# -------------------------------------------------------------------------------------

def selected(*argv: str) -> tuple[dict[str, list[float]], str]:
    """{label: headline figures} of the rows the command's flags select, and the note."""
    picked, note = flags.select_rows(common.parse_args(ifcl.Args, list(argv)), ifcl.PAPER_ROWS)
    return {label: r.headline() for label, r in picked}, note


def test_the_default_run_selects_tab1_and_the_default_of_tab2_and_tab5():
    assert selected() == ({"Tab. 1 IFCL-BERT_base": [77.80], "Tab. 2 IFCL_base": [80.27],
                           "Tab. 5 M=416": [80.27]}, "")
    row = next(r for r in ifcl.PAPER_ROWS if r.label == "Tab. 1 IFCL-BERT_base")
    assert row.figures == dict(zip(common.STS_TASKS + ["avg"],
                                   [71.57, 82.35, 75.08, 83.03, 80.17, 80.27, 72.16, 77.80]))
    # Tab. 2, Tab. 5 and Fig. 4b are on STS-B test (their full IFCL is Tab. 1's STS-B test figure)
    assert all(r.split == "test" and (r.table == "Tab. 1" or list(r.figures) == ["STSBenchmark"])
               for r in ifcl.PAPER_ROWS)
    # the German side's file, MT model and embedding layer choose no row
    assert selected("--fraternal_data", "my.de.txt", "--mt_model", "Helsinki-NLP/opus-mt-en-de",
                    "--fraternal_model", "xlm-roberta-base")[0] == selected()[0]


@pytest.mark.parametrize("argv,rows", [
    (["--no_queue"], {"Tab. 2 w/o HQ": [78.81]}),
    (["--no_twins", "--no_queue"], {"Tab. 2 w/o TL, HQ": [77.26]}),
    (["--no_fraternal"], {"Tab. 2 w/o FI, TL": [78.10]}),
    (["--no_fraternal", "--no_twins"], {"Tab. 2 w/o FI, TL": [78.10]}),
    (["--no_fraternal", "--no_queue"], {"Tab. 2 w/o FI, TL, HQ (SimCSE)": [76.83]}),
    (["--no_twins"], {"Fig. 4b IFCL w/o TL": [78.65]}),
    (["--queue_len", "320"], {"Tab. 5 M=320": [78.76]}),
    (["--queue_len", "512"], {"Tab. 5 M=512": [78.13]}),
])
def test_ablation_flags_select_their_rows(argv, rows):
    assert selected(*argv) == (rows, "")


def test_flags_no_row_covers_say_so():
    assert selected("--queue_len", "400") == ({}, "the paper reports no row for --queue_len 400")
    assert selected("--no_queue", "--queue_len", "320") == (
        {}, "the paper reports no row for --queue_len 320 --no_queue")
    # --no_fraternal parses as the run trains: without the Twins loss, so no "w/o FI" row keeps it
    assert common.parse_args(ifcl.Args, ["--no_fraternal"]).no_twins


def test_bert_large_selects_its_tab1_row():
    rows, note = selected("--model", "bert-large-uncased",
                          "--fraternal_model", "FacebookAI/xlm-roberta-large")
    assert (rows, note) == ({"Tab. 1 IFCL-BERT_large": [79.44]}, "")
    row = next(r for r in ifcl.PAPER_ROWS if r.label == "Tab. 1 IFCL-BERT_large")
    assert row.flags == {} and row.model == "bert-large-uncased" and "Tab. 6" in row.note
    assert list(row.figures.values()) == [73.88, 84.31, 76.64, 84.01, 79.56, 81.37, 76.30, 79.44]
    # the paper has no BERT-large ablation
    assert selected("--model", "bert-large-uncased", "--no_queue") == (
        {}, "the paper reports no row for --model bert-large-uncased --no_queue")


def test_a_model_the_paper_did_not_train_shows_bert_base_rows_as_a_reference():
    rows, note = selected("--model", "sentence-transformers/all-MiniLM-L6-v2", "--no_fraternal")
    assert rows == {"Tab. 2 w/o FI, TL [paper: bert-base-uncased]": [78.10]}
    assert note.startswith("sentence-transformers/all-MiniLM-L6-v2 is not a model the paper trained")


def test_every_docstring_command_parses_and_selects_a_row():
    """The training commands of the module docstring (the default, a quick CPU run, an ablation)
    each parse and select a row of the paper (the MiniLM one as a reference to BERT-base's); the
    other rows' commands are on docs/ifcl.md (tests/test_readme_rows.py)."""
    import re
    import shlex
    doc = ifcl.__doc__.replace("\\\n", " ")
    commands = re.findall(r"^\s*(python ifcl\.py[^#\n]*?)\s*(?:#.*)?$", doc, flags=re.M)
    assert len(commands) >= 3
    for cmd in commands:
        rows, note = selected(*shlex.split(cmd)[2:])
        assert rows, (cmd, note)


def test_the_fraternal_embedding_layer_must_be_as_wide_as_the_encoders():
    large = common.parse_args(ifcl.Args, ["--model", "bert-large-uncased"])
    with pytest.raises(common.UserError, match=r"--fraternal_model bert-base-multilingual-uncased: its "
                                               r"embedding layer gives 768-wide vectors, --model "
                                               r"bert-large-uncased's gives 1024.*Eq. \(3\).*"
                                               r"--fraternal_model FacebookAI/xlm-roberta-large"):
        ifcl.check_fusable(large, 1024, 768)
    # an ALBERT embeds in 128 whatever its hidden size (Sec. 4.1's German one: 1024)
    with pytest.raises(common.UserError, match=r"128-wide.*1024"):
        ifcl.check_fusable(large, 1024, 128)
    ifcl.check_fusable(large, 1024, 1024)
    ifcl.check_fusable(common.parse_args(ifcl.Args, []), 768, 768)


def test_a_fraternal_model_of_another_width_stops_before_training(tmp_path, tiny_bert, parallel, small_sts):
    from conftest import build_tiny_bert
    wide = build_tiny_bert(tmp_path / "wide", [parallel / "de.txt", parallel / "en.txt"], vocab_size=300,
                           hidden=48)
    run = tmp_path / "run"
    with pytest.raises(common.UserError, match=r"its embedding layer gives 48-wide vectors.*gives 32"):
        ifcl.main(["--model", str(tiny_bert), "--fraternal_model", str(wide),
                   "--data", str(parallel / "en.txt"), "--fraternal_data", str(parallel / "de.txt"),
                   "--sts_dir", str(small_sts), "--output_dir", str(run), "--batch_size", "8",
                   "--cache_dir", str(tmp_path / "c")])
    assert not (run / "metrics.jsonl").exists() and not (run / "best").exists()


# -------------------------------------------------------------------------------------
# Data checks and the German file: where it goes, translation, resuming, waiting ranks
# -------------------------------------------------------------------------------------

def test_missing_or_unparallel_fraternal_data_stops_before_any_model(tmp_path, parallel):
    base = run_base(tmp_path, parallel)
    with pytest.raises(common.UserError, match=r"--fraternal_data .*missing\.de\.txt: no such file.*"
                                               r"Leave the flag out.*python tools/translate.py"):
        ifcl.main(base + ["--fraternal_data", str(tmp_path / "missing.de.txt")])
    with pytest.raises(common.UserError, match=r"40 sentences .* 48.*python tools/translate.py"):
        ifcl.main(base + ["--fraternal_data", str(parallel / "de_short.txt")])
    assert not (tmp_path / "run").exists() and not (tmp_path / "c").exists()  # nothing written


def test_a_missing_data_is_named_as_data_not_blamed_on_the_mt_model(tmp_path, parallel):
    """--data is checked before the German file: a missing one stops the run with the --data
    error, not with the MT model that would translate it (offline here: t5-base cannot load),
    and nothing is written."""
    base = run_base(tmp_path, parallel)
    base[base.index("--data") + 1] = str(tmp_path / "missing.txt")
    with pytest.raises(common.UserError) as e:
        ifcl.main(base)
    assert str(e.value).startswith(f"--data {tmp_path / 'missing.txt'}: no such file"), e.value
    assert "--mt_model" not in str(e.value)
    assert not (tmp_path / "run").exists() and not (tmp_path / "c").exists()


def test_the_german_file_is_one_call():
    """ifcl.py reaches its German file through one call into plumbing/translation.py (the default
    path, the checks, the failure marker, rank 0's translation live there); of that logistics only
    Eq. (3)'s width check, check_fusable, stays (its length and main's: tools/check_house.py)."""
    import ast
    import re
    source = (ROOT / "ifcl.py").read_text(encoding="utf-8")
    assert re.findall(r"\btranslation\.\w+\(", source) == ["translation.fraternal_file("]
    names = {n.name for n in ast.parse(source).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert "check_fusable" in names
    assert not names & {"translate_command", "made_from_data", "check_fraternal_file", "read_fraternal",
                        "check_german_file"}, names
    assert callable(translate.translate_command) and callable(translate.fraternal_file)


def test_default_fraternal_path_carries_the_model(tmp_path, tiny_mt, monkeypatch):
    data = tmp_path / "d" / "wiki1m_for_simcse.txt"
    data.parent.mkdir()
    p = translate.default_fraternal_path(str(data), "t5-base")
    assert p == data.parent / "wiki1m_for_simcse.de.t5-base.txt"
    assert translate.default_fraternal_path(str(data), "Helsinki-NLP/opus-mt-en-de").name == \
        "wiki1m_for_simcse.de.Helsinki-NLP--opus-mt-en-de.txt"
    assert translate.default_fraternal_path(str(data), "t5-base", str(tmp_path / "c")) == \
        tmp_path / "c" / "wiki1m_for_simcse.de.t5-base.txt"
    # two local folders of the same name never share a file; a relative path names the same one
    other = tmp_path / "elsewhere" / tiny_mt.name
    other.mkdir(parents=True)
    a, b = (translate.default_fraternal_path(str(data), str(m)) for m in (tiny_mt, other))
    assert a != b and tiny_mt.name in a.name and tiny_mt.name in b.name
    monkeypatch.chdir(tiny_mt.parent)
    assert translate.default_fraternal_path(str(data), tiny_mt.name) == a
    # --data's folder not writable: the temporary cache (default_cache_dir's fallback)
    monkeypatch.setattr(translate.os, "access", lambda path, mode: False)
    assert translate.default_fraternal_path(str(data), "t5-base") == \
        common.default_cache_dir(str(data), "") / "wiki1m_for_simcse.de.t5-base.txt"
    # data/ before its first download: beside it all the same
    monkeypatch.undo()
    later = tmp_path / "not-yet" / "wiki1m_for_simcse.txt"
    assert translate.default_fraternal_path(str(later), "t5-base").parent == later.parent


def test_unloadable_mt_model_says_what_to_do_before_anything_is_written(tmp_path, parallel, tiny_bert):
    for bad, why in (("no-such-org/no-such-mt", "neither a folder here nor in the local Hugging Face cache"),
                     (str(tiny_bert), "could not load it as a seq2seq")):   # hub unreachable; not seq2seq
        with pytest.raises(common.UserError, match=rf"--mt_model .*{why}.*needs it once.*--fraternal_data "
                                                   rf"FILE"):
            ifcl.main(run_base(tmp_path, parallel, "--mt_model", bad))
        assert not (tmp_path / "run").exists() and not (tmp_path / "c").exists()
        out = tmp_path / "de.txt"
        with pytest.raises(common.UserError, match=r"--mt_model .*needs it once"):
            translate.main(["--data", str(parallel / "en.txt"), "--mt_model", bad, "--out", str(out)])
        assert list(tmp_path.glob("de.txt*")) == []                  # not even a .part


def test_cached_german_file_of_another_length_is_refused(tmp_path, parallel, tiny_mt):
    base = run_base(tmp_path, parallel, "--mt_model", str(tiny_mt))
    cached = translate.default_fraternal_path(str(parallel / "en.txt"), str(tiny_mt), str(tmp_path / "c"))
    cached.parent.mkdir(parents=True)
    cached.write_text((parallel / "de_short.txt").read_text(encoding="utf-8"), encoding="utf-8")
    with pytest.raises(common.UserError, match=rf"{cached.name} \(the German file made earlier.*"
                                               rf"40 sentences but --data .* 48.*Delete .*{cached.name} "
                                               rf"to translate --data again.*--fraternal_data"):
        ifcl.main(base)
    assert not (tmp_path / "run").exists()


def test_torchrun_with_the_german_file_still_to_make_is_refused_with_its_command(
        tmp_path, parallel, tiny_mt, tiny_bert, small_sts, tiny_mbert):
    """A real two-process launch with no German file yet: every rank would translate at once, so the
    launch is refused before anything is written, with the command that makes the file first."""
    env = cpu_env(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")     # two ranks: gloo on the CPU
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "2", str(ROOT / "ifcl.py"),
                        *run_base(tmp_path, parallel, "--mt_model", str(tiny_mt), "--model", str(tiny_bert),
                                  "--sts_dir", str(small_sts), "--batch_size", "8",
                                  "--fraternal_model", str(tiny_mbert))],
                       capture_output=True, text=True, timeout=300, env=env)
    german = translate.default_fraternal_path(str(parallel / "en.txt"), str(tiny_mt), str(tmp_path / "c"))
    assert r.returncode != 0
    assert f"error: --fraternal_data {german}: not made yet, and under torchrun" in r.stderr, r.stderr[-3000:]
    assert f"`python tools/translate.py --data {parallel / 'en.txt'} --out {german} --mt_model {tiny_mt}`" \
        in r.stderr
    assert not german.exists() and not (tmp_path / "run").exists()

def test_end_to_end_full_ifcl(tmp_path, tiny_bert, tiny_mbert, parallel, small_sts, monkeypatch):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer
    run = tmp_path / "run"
    monkeypatch.setattr(checkpoint, "drop_last", lambda run: None)   # its queue is read below
    res = ifcl.main(["--model", str(tiny_bert), "--fraternal_model", str(tiny_mbert),
                     "--data", str(parallel / "en.txt"), "--fraternal_data", str(parallel / "de.txt"),
                     "--sts_dir", str(small_sts), "--output_dir", str(run), "--max_steps", "4",
                     "--eval_every", "2", "--batch_size", "8", "--queue_len", "20", "--log_every", "1",
                     "--cache_dir", str(tmp_path / "cache")])
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("stsb_dev" in r for r in recs)
    train_recs = [r for r in recs if "loss" in r]
    assert train_recs and all(k in train_recs[-1]
                              for k in ("l_identical", "l_fraternal", "l_twins", "margin"))
    # what the mechanism acts on, every step (--log_every 1): the share of the queue of 20 that
    # the step's Eq. (6) used, filled by 8 a step
    assert [r["queue_fill"] for r in train_recs] == pytest.approx([0.0, 0.4, 0.8, 1.0])
    assert all(-1 <= r[k] <= 1 for r in train_recs for k in ("cos_identical", "cos_fraternal"))
    assert all(r["twins_gap"] == pytest.approx(math.exp(r["cos_identical"]) - math.exp(r["cos_fraternal"]),
                                               abs=0.2)
               for r in train_recs)
    assert res["test"] is not None
    assert {k for k in res["test"] if k not in ("avg", "alignment", "uniformity")} == set(common.STS_TASKS)
    assert res["test"]["alignment"] >= 0 and res["test"]["uniformity"] <= 0   # on STS-B test
    state = torch.load(run / "last" / "state.pt", weights_only=False)
    assert int(state["model"]["filled"]) == 20                    # 4 steps x 8, capped at 20
    best = run / "best"
    AutoModel.from_pretrained(best)
    enc = AutoModel.from_pretrained(best, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(best)
    sents = ["A man is playing a guitar.", "Zwei Hunde spielen im Schnee.", "a dog"]
    ours = common.make_encode(enc, tok, "avg")(sents)               # mean of the last layer
    st = SentenceTransformer(str(best), device="cpu").encode(sents, convert_to_numpy=True)
    assert abs(ours - st).max() < 1e-5


def test_pooler_cls_reads_and_keeps_the_cls_the_loss_trains(tmp_path, tiny_bert, tiny_mbert, parallel,
                                                            small_sts, capsys):
    """--pooler cls_before_pooler (the testbed's reading): every evaluation, the choice of best/ and
    the saved model read raw [CLS]; the paper's mean pooling stays the default, and its rows are
    not claimed for a [CLS] run."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer
    assert ifcl.Args().pooler == "avg"
    run = tmp_path / "run"
    ifcl.main(["--model", str(tiny_bert), "--fraternal_model", str(tiny_mbert),
               "--data", str(parallel / "en.txt"), "--fraternal_data", str(parallel / "de.txt"),
               "--sts_dir", str(small_sts), "--output_dir", str(run), "--max_steps", "4", "--eval_every", "2",
               "--batch_size", "8", "--queue_len", "20", "--cache_dir", str(tmp_path / "cache"),
               "--pooler", "cls_before_pooler"])
    note = capsys.readouterr().out.splitlines()[0]
    assert note.startswith("note: the paper reports no row for")
    assert note.endswith("--pooler cls_before_pooler")
    best = run / "best"
    assert json.loads((best / "test_metrics.json").read_text())["pooler"] == "cls_before_pooler"
    recorded = json.loads((best / "dev_metrics.json").read_text())["stsb_dev"]
    again = common.evaluate_encoder(str(best), "cls_before_pooler", small_sts, split="dev")
    assert again["STSBenchmark"]["spearman"] == pytest.approx(recorded, abs=1e-6)
    enc, tok = AutoModel.from_pretrained(best, dtype=torch.float32), AutoTokenizer.from_pretrained(best)
    sents = ["A man is playing a guitar.", "a dog"]
    ours = common.make_encode(enc, tok, "cls_before_pooler")(sents)
    st = SentenceTransformer(str(best), device="cpu").encode(sents, convert_to_numpy=True)
    assert abs(ours - st).max() < 1e-5
    assert abs(common.make_encode(enc, tok, "avg")(sents) - st).max() > 1e-3


def test_end_to_end_prints_and_stores_the_rows_its_flags_select(tmp_path, tiny_bert, tiny_mbert, small_sts,
                                                                  capsys):
    """The default flags (batch 64, queue 416) on 128 parallel (synthetic) sentences: the end of the run
    prints Tab. 1's row on the 7 tasks and Tab. 2's and Tab. 5's on STS-B test beside the run's,
    labelled as BERT-base's (the tiny encoder is not a model of the paper), and stores them."""
    from conftest import pseudo_german, write_corpus
    english = write_corpus(tmp_path / "train.en", n=128).read_text(encoding="utf-8").splitlines()
    (tmp_path / "train.de").write_text("\n".join(map(pseudo_german, english)) + "\n", encoding="utf-8")
    run = tmp_path / "run"
    ifcl.main(["--model", str(tiny_bert), "--fraternal_model", str(tiny_mbert),
               "--data", str(tmp_path / "train.en"), "--fraternal_data", str(tmp_path / "train.de"),
               "--sts_dir", str(small_sts), "--output_dir", str(run), "--max_steps", "2", "--eval_every", "2",
               "--cache_dir", str(tmp_path / "cache")])
    out = capsys.readouterr().out
    labels = [f"{name} [paper: bert-base-uncased]"
              for name in ("Tab. 1 IFCL-BERT_base", "Tab. 2 IFCL_base", "Tab. 5 M=416")]
    assert f"note: {tiny_bert} is not a model the paper trained" in out
    table = [line for line in out.splitlines() if line.startswith(("this run", "Tab. "))]
    assert [line.split("  ")[0] for line in table] == ["this run", *labels]
    assert table[1].split()[-8:] == ["71.57", "82.35", "75.08", "83.03", "80.17", "80.27", "72.16", "77.80"]
    assert table[2].split()[-8:] == table[3].split()[-8:] == ["-"] * 5 + ["80.27", "-", "-"]
    stored = json.loads((run / "best" / "test_metrics.json").read_text())
    assert [r["label"] for r in stored["paper_rows"]] == labels
    assert stored["paper_rows"][2]["flags"] == {"queue_len": 416}
    assert stored["paper_note"].startswith(f"{tiny_bert} is not a model the paper trained")


def test_end_to_end_simcse_row_needs_no_german(tmp_path, tiny_bert, parallel, small_sts):
    run = tmp_path / "run"
    ifcl.main(["--model", str(tiny_bert), "--fraternal_model", str(tmp_path / "never-loaded"),
               "--data", str(parallel / "en.txt"), "--sts_dir", str(small_sts), "--output_dir", str(run),
               "--max_steps", "2", "--eval_every", "2", "--batch_size", "8", "--no_fraternal",
               "--no_queue", "--cache_dir", str(tmp_path / "cache")])
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("stsb_dev" in r for r in recs)
    assert all("l_fraternal" not in r for r in recs)


def test_first_run_translates_keeps_the_file_trains_and_later_runs_reuse_it(
        tmp_path, tiny_bert, tiny_mbert, tiny_mt, parallel, small_sts, one_thread, capsys):
    """`python ifcl.py --data en.txt` with no German file: it translates (kept under --cache_dir
    here, beside --data by default), trains and evaluates; the next run trains at once, even
    with an MT model that can no longer be loaded."""
    mt = tmp_path / "mt"
    shutil.copytree(tiny_mt, mt)
    en, cache = parallel / "en.txt", tmp_path / "cache"
    flags = ["--model", str(tiny_bert), "--fraternal_model", str(tiny_mbert), "--mt_model", str(mt),
             "--data", str(en), "--sts_dir", str(small_sts), "--max_steps", "2", "--eval_every", "2",
             "--batch_size", "8", "--queue_len", "20", "--cache_dir", str(cache)]
    res = ifcl.main(flags + ["--output_dir", str(tmp_path / "run1")])
    german = translate.default_fraternal_path(str(en), str(mt), str(cache))
    assert inputs.count_lines(german) == 48 and not list(cache.glob("*.part*"))
    assert "translated 48 sentences" in capsys.readouterr().err
    args = json.loads((tmp_path / "run1" / "args.json").read_text())
    assert args["fraternal_data"] == str(german) and args["mt_model"] == str(mt)
    recs = [json.loads(line) for line in (tmp_path / "run1" / "metrics.jsonl").read_text().splitlines()]
    assert any("stsb_dev" in r for r in recs) and any("l_fraternal" in r for r in recs)
    assert res["test"] is not None
    mtime = german.stat().st_mtime_ns
    (mt / "model.safetensors").unlink()                            # unloadable from now on
    ifcl.main(flags + ["--output_dir", str(tmp_path / "run2")])
    assert german.stat().st_mtime_ns == mtime
    assert "translat" not in capsys.readouterr().err.replace(str(tmp_path), "")   # the test's name is in it
    assert (tmp_path / "run2" / "best").is_dir()
