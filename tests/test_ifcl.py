"""Tests of ifcl.py: every equation against a per-row loop written from the paper, the queue,
the fusion, the reduction to SimCSE, the translate command, and tiny end-to-end runs."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import common
import ifcl
import simcse
from conftest import need_shared

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
        assert p[idx].item() == pytest.approx(1 - lam * math.ceil(m / N), abs=1e-7)
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
    h, h_pos = torch.randn(N, 6, generator=g, dtype=torch.float64), torch.randn(N, 6, generator=g, dtype=torch.float64)
    queue = torch.randn(M, 6, generator=g, dtype=torch.float64)
    p = torch.rand(M, generator=g, dtype=torch.float64) * 0.9 + 0.1   # uneven: order matters
    got = ifcl.identical_loss(h, h_pos, queue, p, TAU)
    assert got.dim() == 0
    assert float(got) == pytest.approx(identical_loop(h, h_pos, queue, p, TAU), rel=1e-5, abs=1e-6)
    if M:  # the weights belong to their slots: reversing them changes the loss (a warmer tau
        # so that the queue's share is well above rounding)
        warm = float(ifcl.identical_loss(h, h_pos, queue, p, 0.5))
        assert warm == pytest.approx(identical_loop(h, h_pos, queue, p, 0.5), rel=1e-6)
        assert float(ifcl.identical_loss(h, h_pos, queue, p.flip(0), 0.5)) != pytest.approx(warm, rel=1e-4)


def test_identical_loss_ties_and_zero_weight_slots():
    # ties: every similarity equal -> the loss is log(N + sum p)
    h = torch.ones(3, 4, dtype=torch.float64)
    q = torch.ones(5, 4, dtype=torch.float64)
    p = torch.tensor([1.0, 0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    assert float(ifcl.identical_loss(h, h, q, p, TAU)) == pytest.approx(math.log(3 + 2.0))
    # slots with p = 0 (not filled yet) count for nothing, whatever they hold
    g = torch.Generator().manual_seed(1)
    h, h_pos = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    full = ifcl.identical_loss(h, h_pos, torch.randn(8, 6, generator=g), torch.zeros(8), TAU)
    empty = ifcl.identical_loss(h, h_pos, torch.zeros(0, 6), torch.zeros(0), TAU)
    assert float(full) == pytest.approx(float(empty), rel=1e-6)
    assert float(empty) == pytest.approx(float(simcse.simcse_loss(h, h_pos, TAU)), rel=1e-6)


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
        h, hf = torch.randn(N, 5, generator=g, dtype=torch.float64), torch.randn(N, 5, generator=g, dtype=torch.float64)
        want = sum(-math.log(math.exp(cos(h[i], hf[i]) / TAU)
                             / sum(math.exp(cos(h[i], hf[j]) / TAU) for j in range(N)))
                   for i in range(N)) / N
        got = ifcl.fraternal_loss(h, hf, TAU)
        assert got.dim() == 0 and float(got) == pytest.approx(want, rel=1e-6, abs=1e-9)


def test_twins_loss_matches_loop():
    g = torch.Generator().manual_seed(4)
    N = 7
    h, hp, hf = (torch.randn(N, 5, generator=g, dtype=torch.float64) for _ in range(3))
    margin = torch.randn(N, generator=g, dtype=torch.float64) * 0.5   # both signs inside |.|
    want = sum(abs(math.exp(cos(h[i], hp[i])) - math.exp(cos(h[i], hf[i])) - float(margin[i]))
               for i in range(N)) / N
    got = ifcl.twins_loss(h, hp, hf, margin)
    assert got.dim() == 0 and float(got) == pytest.approx(want, rel=1e-6)
    # swapping the identical and the fraternal view is a different loss
    assert float(ifcl.twins_loss(h, hf, hp, margin)) != pytest.approx(want)


def test_innate_margin_matches_loop():
    g = torch.Generator().manual_seed(5)
    N, L, d = 4, 6, 5
    emb, emb_pos, emb_frat = (torch.randn(N, L, d, generator=g, dtype=torch.float64) for _ in range(3))
    lengths, lengths_frat = [1, 3, 6, 4], [2, 5, 6, 4]       # the fused mask is the longer one
    mask = torch.tensor([[int(t < n) for t in range(L)] for n in lengths])
    mask_frat = torch.tensor([[int(t < n) for t in range(L)] for n in lengths_frat])
    got = ifcl.innate_margin(emb, emb_pos, emb_frat, mask, mask_frat)
    assert got.shape == (N,) and not got.requires_grad
    for i in range(N):
        e = sum(emb[i, t] for t in range(lengths[i])) / lengths[i]
        ep = sum(emb_pos[i, t] for t in range(lengths[i])) / lengths[i]
        ef = sum(emb_frat[i, t] for t in range(lengths_frat[i])) / lengths_frat[i]
        assert float(got[i]) == pytest.approx(math.exp(cos(e, ep)) - math.exp(cos(e, ef)), rel=1e-6)
    # detached even when the inputs carry gradient
    assert not ifcl.innate_margin(emb.requires_grad_(), emb_pos, emb_frat, mask, mask_frat).requires_grad


def test_fixed_margin():
    assert ifcl.fixed_margin(0.85, 0.80) == pytest.approx(math.exp(0.85) - math.exp(0.80))


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
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-6)
    assert set(terms) == {"l_identical"}
    # with the queue on, step 0 is still SimCSE, and the anchors enter the queue
    model_q = ifcl.IFCL(copy.deepcopy(stock), None, replace(args, no_queue=False, queue_len=6), 0, 0)
    model_q.mlp.load_state_dict(model.mlp.state_dict())
    torch.manual_seed(7)
    loss_q, _ = model_q({"text": x})
    assert float(loss_q.detach()) == pytest.approx(float(want.detach()), rel=1e-6)
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
    assert set(terms) == {"l_identical", "l_fraternal", "l_twins", "margin"}
    assert float(loss.detach()) == pytest.approx(float(terms["l_identical"] + terms["l_fraternal"] + terms["l_twins"]))
    loss.backward()
    assert enc.encoder.layer[0].output.dense.weight.grad is not None
    assert enc.embeddings.word_embeddings.weight.grad is None      # BEL_S frozen (Eq. 1)
    assert all(p.grad is None for p in enc_f.embeddings.parameters())  # BEL_F frozen
    assert int(model.filled) == 4
    _, terms2 = model(batch)
    assert "l_twins" in terms2 and int(model.filled) == 8


# -------------------------------------------------------------------------------------
# Data checks and the translate command
# -------------------------------------------------------------------------------------

def test_missing_or_unparallel_fraternal_data_stops_before_any_model(tmp_path, parallel):
    base = ["--model", str(tmp_path / "no-such-model"), "--data", str(parallel / "en.txt"),
            "--output_dir", str(tmp_path / "run"), "--cache_dir", str(tmp_path / "c"),
            "--sts_dir", str(tmp_path / "no-sts")]
    with pytest.raises(common.UserError, match=r"python ifcl.py translate --data .*en\.txt"):
        ifcl.main(base)
    assert not (tmp_path / "run").exists()                         # nothing written either
    with pytest.raises(common.UserError, match=r"no such file.*python ifcl.py translate"):
        ifcl.main(base + ["--fraternal_data", str(tmp_path / "missing.de.txt")])
    with pytest.raises(common.UserError, match=r"40 sentences .* 48.*python ifcl.py translate"):
        ifcl.main(base + ["--fraternal_data", str(parallel / "de_short.txt")])
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def stub_mt(tmp_path_factory, tiny_bert):
    """A tiny seq2seq model with random weights and the tiny BERT tokenizer: real generate()."""
    from transformers import AutoTokenizer, BartConfig, BartForConditionalGeneration
    folder = tmp_path_factory.mktemp("stub_mt")
    tok = AutoTokenizer.from_pretrained(tiny_bert)
    torch.manual_seed(0)
    cfg = BartConfig(vocab_size=len(tok), d_model=16, encoder_layers=1, decoder_layers=1,
                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                     decoder_ffn_dim=32, max_position_embeddings=300, pad_token_id=tok.pad_token_id,
                     bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id,
                     decoder_start_token_id=tok.cls_token_id, forced_eos_token_id=None)
    BartForConditionalGeneration(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_translate_batched_resumable_and_atomic(tmp_path, parallel, stub_mt, monkeypatch):
    from transformers import BartForConditionalGeneration
    src = parallel / "en.txt"
    flags = ["--data", str(src), "--mt_model", str(stub_mt), "--batch_size", "8", "--max_new_tokens", "6"]
    ref = ifcl.main(["translate", *flags, "--out", str(tmp_path / "ref.de.txt")])
    ref_lines = ref.read_text(encoding="utf-8").splitlines()
    assert len(ref_lines) == 48 and all(l.strip() for l in ref_lines)
    assert not Path(str(ref) + ".part").exists() and not Path(str(ref) + ".part.json").exists()

    # a run killed after 3 batches: only <out>.part exists, never <out>
    calls, real = [], BartForConditionalGeneration.generate

    def dying(self, **kw):
        calls.append(kw["input_ids"].shape[0])
        if len(calls) > 3:
            raise KeyboardInterrupt
        return real(self, **kw)
    monkeypatch.setattr(BartForConditionalGeneration, "generate", dying)
    out = tmp_path / "de.txt"
    with pytest.raises(KeyboardInterrupt):
        ifcl.main(["translate", *flags, "--out", str(out)])
    part = Path(str(out) + ".part")
    assert not out.exists() and part.read_text(encoding="utf-8").splitlines() == ref_lines[:24]
    with open(part, "ab") as f:                                    # a line cut by the kill
        f.write("halb geschrieb".encode())

    # resumed: only the 24 remaining sentences are translated, the result is the full file
    calls.clear()
    monkeypatch.setattr(BartForConditionalGeneration, "generate",
                        lambda self, **kw: calls.append(kw["input_ids"].shape[0]) or real(self, **kw))
    ifcl.main(["translate", *flags, "--out", str(out)])
    assert sum(calls) == 24
    assert out.read_text(encoding="utf-8").splitlines() == ref_lines
    assert not part.exists()
    # a different model for the same .part is refused
    ifcl.main(["translate", *flags, "--out", str(out)])            # already complete: no-op
    with pytest.raises(common.UserError, match="exists with 48 lines"):
        ifcl.main(["translate", *flags[:2], "--data", str(parallel / "de_short.txt"),
                   "--mt_model", str(stub_mt), "--out", str(out)])


# -------------------------------------------------------------------------------------
# End to end on CPU: tiny English encoder + tiny 'multilingual' embedding layer
# -------------------------------------------------------------------------------------

def test_end_to_end_full_ifcl(tmp_path, tiny_bert, tiny_mbert, parallel, small_sts):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer
    run = tmp_path / "run"
    res = ifcl.main(["--model", str(tiny_bert), "--fraternal_model", str(tiny_mbert),
                     "--data", str(parallel / "en.txt"), "--fraternal_data", str(parallel / "de.txt"),
                     "--sts_dir", str(small_sts), "--output_dir", str(run), "--max_steps", "4",
                     "--eval_every", "2", "--batch_size", "8", "--queue_len", "20",
                     "--cache_dir", str(tmp_path / "cache")])
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("stsb_dev" in r for r in recs)
    train_recs = [r for r in recs if "loss" in r]
    assert train_recs and all(k in train_recs[-1] for k in ("l_identical", "l_fraternal", "l_twins", "margin"))
    assert res["test"] is not None and len([k for k in res["test"] if k != "avg"]) == 7
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


def test_end_to_end_simcse_row_needs_no_german(tmp_path, tiny_bert, parallel, small_sts):
    run = tmp_path / "run"
    ifcl.main(["--model", str(tiny_bert), "--fraternal_model", str(tmp_path / "never-loaded"),
               "--data", str(parallel / "en.txt"), "--sts_dir", str(small_sts), "--output_dir", str(run),
               "--max_steps", "2", "--eval_every", "2", "--batch_size", "8", "--no_fraternal",
               "--no_queue", "--cache_dir", str(tmp_path / "cache")])
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("stsb_dev" in r for r in recs)
    assert all("l_fraternal" not in r for r in recs)
