"""conisi.py: each loss against a per-row loop written from the paper, the pair encoding
against the tokenizer's own pair form, the three c_i strategies, and a tiny end-to-end run of
each strategy on CPU."""

from __future__ import annotations

import json
import math
import random
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import common
import conisi
from common import UserError
from conftest import assert_matches_paper, departs
from plumbing import flags
from plumbing.report import format_sts_table

# one intra-op thread (conftest's one_thread): on a shared 2-core machine two spinning threads make
# a tiny model's evaluation about 15 times slower
pytestmark = pytest.mark.usefixtures("one_thread")


def cos(u: torch.Tensor, v: torch.Tensor) -> float:
    return float(u @ v / (u.norm() * v.norm()))


def loop_contrastive(h_x, h_Y, tau):
    """Eq. (3)-(4), row by row: l_i = -log e^{sim(x_i, Y_i)/tau} / sum_j e^{sim(x_i, Y_j)/tau}."""
    n, total = h_x.shape[0], 0.0
    for i in range(n):
        num = math.exp(cos(h_x[i], h_Y[i]) / tau)
        den = sum(math.exp(cos(h_x[i], h_Y[j]) / tau) for j in range(n))
        total += -math.log(num / den)
    return total / n


def loop_interactive(r_Y, r_Z):
    """Eq. (8)-(9), row by row: l_i = -log e^{r_Y} / (e^{r_Y} + e^{r_Z})."""
    n = len(r_Y)
    return sum(-math.log(math.exp(float(r_Y[i])) / (math.exp(float(r_Y[i])) + math.exp(float(r_Z[i]))))
               for i in range(n)) / n


# ------------------------------------------------------------------------------------
# losses
# ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,tau", [(6, 0.05), (4, 0.5), (1, 0.05)])
def test_contrastive_loss_matches_loop(n, tau):
    g = torch.Generator().manual_seed(n)
    h_x = torch.randn(n, 7, generator=g, dtype=torch.float64)
    h_Y = torch.randn(n, 7, generator=g, dtype=torch.float64)
    got = conisi.contrastive_loss(h_x, h_Y, tau)
    assert got.shape == ()
    assert_matches_paper(got, loop_contrastive(h_x, h_Y, tau), "contrastive_loss", "ConIsI Eq. (3)-(4)",
                         rel=1e-6, abs=1e-9)
    if n == 1:  # a batch of one: the positive is its own only column
        assert_matches_paper(got, 0.0, "contrastive_loss", "ConIsI Eq. (3)-(4)", abs=1e-9,
                             reference="a batch of one: -log 1")
    else:  # rows are the single sentences: swapping the roles (a transposed matrix) differs
        assert abs(float(conisi.contrastive_loss(h_Y, h_x, tau)) - float(got)) > 1e-4


def test_contrastive_loss_ties_and_scale():
    h_x = torch.randn(5, 3, dtype=torch.float64)
    tied = torch.ones(5, 3, dtype=torch.float64)  # every column the same: log N
    assert_matches_paper(conisi.contrastive_loss(h_x, tied, 0.05), math.log(5), "contrastive_loss",
                         "ConIsI Eq. (3)-(4)", reference="every column the same: log N")
    # cosine, not dot product: scaling the inputs changes nothing
    h_Y = torch.randn(5, 3, dtype=torch.float64)
    a = conisi.contrastive_loss(h_x, h_Y, 0.1)
    assert_matches_paper(conisi.contrastive_loss(3 * h_x, 0.2 * h_Y, 0.1), a, "contrastive_loss",
                         "ConIsI Eq. (3)'s cosine sim", reference="the same loss on unscaled inputs")


def test_contrastive_loss_reduces_to_simcse():
    """With the pair encoding swapped back for a second view, Eq. (3)-(4) is SimCSE's Eq. (4)."""
    import simcse
    h, h_pos = torch.randn(8, 16), torch.randn(8, 16)
    got, want = conisi.contrastive_loss(h, h_pos, 0.05), simcse.simcse_loss(h, h_pos, 0.05)
    assert torch.allclose(got, want), departs("contrastive_loss", "SimCSE Eq. (4)", got, want, "simcse_loss")


@pytest.mark.parametrize("n", [1, 9])
def test_interactive_loss_matches_loop(n):
    g = torch.Generator().manual_seed(3)
    r_Y, r_Z = torch.randn(n, generator=g) * 3, torch.randn(n, generator=g) * 3
    got = conisi.interactive_loss(r_Y, r_Z)
    assert got.shape == ()
    assert_matches_paper(got, loop_interactive(r_Y, r_Z), "interactive_loss", "ConIsI Eq. (8)-(9)", rel=1e-5)
    # Y is the positive class: swapping Y and Z gives another loss
    assert abs(float(conisi.interactive_loss(r_Z, r_Y)) - float(got)) > 1e-4 or torch.equal(r_Y, r_Z)


def test_interactive_loss_edges():
    r = torch.tensor([0.3, -2.0, 5.0])
    assert_matches_paper(conisi.interactive_loss(r, r), math.log(2), "interactive_loss", "ConIsI Eq. (8)-(9)",
                         reference="r^Y = r^Z: log 2")
    big = conisi.interactive_loss(torch.tensor([100.0, -100.0]), torch.tensor([-100.0, 100.0]))
    assert torch.isfinite(big)
    assert_matches_paper(big, 100.0, "interactive_loss", "ConIsI Eq. (8)-(9)", rel=1e-4,
                         reference="logits of +-100: (0 + 200) / 2")


@pytest.mark.parametrize("lam", [0.0, 0.3, 0.8, 1.0])
def test_conisi_loss_matches_loop(lam):
    g = torch.Generator().manual_seed(7)
    h_x, h_Y = (torch.randn(5, 6, generator=g, dtype=torch.float64) for _ in range(2))
    r_Y, r_Z = (torch.randn(5, generator=g, dtype=torch.float64) for _ in range(2))
    want = (1 - lam) * loop_contrastive(h_x, h_Y, 0.05) + lam * loop_interactive(r_Y, r_Z)
    got = conisi.conisi_loss(h_x, h_Y, r_Y, r_Z, 0.05, lam)
    assert got.shape == ()
    assert_matches_paper(got, want, "conisi_loss", "ConIsI Eq. (10)", rel=1e-6)


def test_lam_zero_is_the_contrastive_loss_alone():
    """Tab. 7's first column: lam = 0 leaves the contrastive loss and no gradient to r."""
    h_x, h_Y = torch.randn(4, 5), torch.randn(4, 5)
    r_Y, r_Z = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    loss = conisi.conisi_loss(h_x, h_Y, r_Y, r_Z, 0.05, 0.0)
    assert torch.equal(loss, conisi.contrastive_loss(h_x, h_Y, 0.05))
    loss.backward()
    assert float(r_Y.grad.abs().sum()) == 0 and float(r_Z.grad.abs().sum()) == 0


def test_interactive_accuracy():
    assert float(conisi.interactive_accuracy(torch.tensor([1.0, 0.0, 2.0, 1.0]),
                                             torch.tensor([0.0, 1.0, 1.0, 1.0]))) == 0.5


# ------------------------------------------------------------------------------------
# pairs: Y = (x, x) and Z = (x, c) as one sequence
# ------------------------------------------------------------------------------------

SENTS = ["a man is playing a guitar .", "hello", "the quick brown fox jumps over the lazy dog today",
         "it is not a problem ."]
OTHERS = ["short", "a much longer sentence than the others , written here to be long", "x y z", "ok ."]


@pytest.fixture(scope="module")
def tiny_tok(tiny_bert):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tiny_bert))
    assert len(tok) == 1000
    return tok


def _batch(tok, texts, max_len):
    return common.tokenize(tok, texts, max_len).batch(np.arange(len(texts)))


@pytest.mark.parametrize("which", ["tiny", "bert_layout"])
def test_compose_pairs_is_the_tokenizers_pair_form(which, tiny_tok, bert_layout_tokenizer):
    from transformers import AutoTokenizer
    tok = tiny_tok if which == "tiny" else AutoTokenizer.from_pretrained(str(bert_layout_tokenizer))
    tpl = conisi.pair_template(tok)
    assert (tpl.pre, tpl.mid, tpl.suf) == ((tok.cls_token_id,), (tok.sep_token_id,), (tok.sep_token_id,))
    assert (tpl.a_type, tpl.b_type, tpl.suf_types) == (0, 1, (1,))
    pair = conisi.compose_pairs(_batch(tok, SENTS, 64), _batch(tok, OTHERS, 64), tpl)
    ref = tok(SENTS, OTHERS, return_token_type_ids=True)
    for i in range(len(SENTS)):
        m = pair["attention_mask"][i].bool()
        assert pair["input_ids"][i][m].tolist() == ref["input_ids"][i]
        assert pair["token_type_ids"][i][m].tolist() == ref["token_type_ids"][i]
        assert m.tolist() == sorted(m.tolist(), reverse=True)          # right padding only
        assert (pair["input_ids"][i][~m] == tok.pad_token_id).all()


def test_Y_repeats_the_truncated_sentence(tiny_tok):
    """Sec. 3.1.1: Y = {t_1..t_l, t_1..t_l} of the max_len-truncated x, at most 2 * max_len long."""
    tpl, max_len = conisi.pair_template(tiny_tok), 6
    x = _batch(tiny_tok, SENTS, max_len)
    Y = conisi.compose_pairs(x, x, tpl)
    assert Y["input_ids"].shape[1] <= 2 * max_len
    cls, sep = tiny_tok.cls_token_id, tiny_tok.sep_token_id
    for i in range(len(SENTS)):
        words = x["input_ids"][i][x["attention_mask"][i].bool()].tolist()[1:-1]
        m = Y["attention_mask"][i].bool()
        assert Y["input_ids"][i][m].tolist() == [cls] + words + [sep] + words + [sep]
        assert Y["token_type_ids"][i][m].tolist() == [0] * (len(words) + 2) + [1] * (len(words) + 1)


def test_compose_pairs_docstring_example(tiny_tok):
    """The worked example in compose_pairs' docstring is what compose_pairs returns: the rows are
    read off the docstring itself, so the two cannot drift apart. With MiniLM's tokenizer (BERT's
    uncased vocabulary) the example's x_i and template are also what the tokenizer gives."""
    import re

    from transformers import AutoTokenizer

    from conftest import MINILM, need_real
    found = re.findall(r"(input_ids|token_type_ids|attention_mask) \[([\d, ]+)\]",
                       conisi.compose_pairs.__doc__)
    assert [k for k, _ in found] == ["input_ids", "attention_mask", "input_ids", "token_type_ids",
                                     "attention_mask"]
    rows = [[int(v) for v in vals.split(",")] for _, vals in found]
    x = {"input_ids": torch.tensor([rows[0]]), "attention_mask": torch.tensor([rows[1]])}
    want = {"input_ids": rows[2], "token_type_ids": rows[3], "attention_mask": rows[4]}
    assert want == {"input_ids": [101, 7592, 2088, 102, 7592, 2088, 102, 0, 0],   # [CLS] a b [SEP] a b [SEP]
                    "token_type_ids": [0, 0, 0, 0, 1, 1, 1, 0, 0],
                    "attention_mask": [1, 1, 1, 1, 1, 1, 1, 0, 0]}
    bert = conisi.PairTemplate(single_pre=1, single_suf=1, pre=(101,), mid=(102,), suf=(102,),
                               pre_types=(0,), mid_types=(0,), suf_types=(1,), a_type=0, b_type=1,
                               pad_id=0, use_types=True)
    Y = conisi.compose_pairs(x, x, bert)
    assert {k: Y[k][0].tolist() for k in want} == want
    tok = AutoTokenizer.from_pretrained(str(need_real("models", MINILM)))
    assert conisi.pair_template(tok) == bert
    x_tok = _batch(tok, ["hello world", "hello there friend"], 5)      # a batch 5 wide
    assert x_tok["input_ids"][0].tolist() == rows[0] and x_tok["attention_mask"][0].tolist() == rows[1]


def test_compose_pairs_roberta_style_template():
    """A <s> a </s></s> b </s> template with one token type, against a per-row loop."""
    tpl = conisi.PairTemplate(single_pre=1, single_suf=1, pre=(0,), mid=(2, 2), suf=(2,),
                              pre_types=(0,), mid_types=(0, 0), suf_types=(0,), a_type=0, b_type=0,
                              pad_id=1, use_types=False)
    rows_a, rows_b = [[5, 6, 7], [8], []], [[9], [10, 11, 12, 13], [14, 15]]

    def single(rows):
        w = max(len(r) for r in rows) + 2
        ids = torch.full((len(rows), w), 1)
        mask = torch.zeros((len(rows), w), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r) + 2] = torch.tensor([0] + r + [2])
            mask[i, :len(r) + 2] = 1
        return {"input_ids": ids, "attention_mask": mask}

    out = conisi.compose_pairs(single(rows_a), single(rows_b), tpl)
    for i, (ra, rb) in enumerate(zip(rows_a, rows_b)):
        want = [0] + ra + [2, 2] + rb + [2]
        m = out["attention_mask"][i].bool()
        assert out["input_ids"][i][m].tolist() == want
        assert (out["input_ids"][i][~m] == 1).all() and (out["token_type_ids"][i] == 0).all()


# ------------------------------------------------------------------------------------
# strategies for c_i
# ------------------------------------------------------------------------------------

def test_other_index_never_picks_itself():
    g = torch.Generator().manual_seed(0)
    for n in (2, 3, 7):
        seen = torch.zeros(n, n, dtype=torch.long)
        for _ in range(300):
            k = conisi.other_index(n, generator=g)
            assert k.shape == (n,)
            seen[torch.arange(n), k] += 1
        assert (seen.diagonal() == 0).all()                           # never the sentence itself
        assert ((seen + torch.eye(n, dtype=torch.long)) > 0).all()    # every other one is drawn
    with pytest.raises(UserError, match="--batch_size"):
        conisi.other_index(1)


def test_subword_replace_properties():
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([0, 1, 2, 3])                               # pad, cls, sep, unk
    ids = torch.tensor([[1, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 2],
                        [1, 20, 3, 21, 2, 0, 0, 0, 0, 0, 0, 0],
                        [1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
    mask = (torch.arange(12)[None] < torch.tensor([12, 5, 2])[:, None]).long()
    cand = torch.arange(100, 200)                                      # disjoint from the rows
    new, chosen = conisi.subword_replace(ids, mask, special, cand, 0.3, 1.0, generator=g)
    content = mask.bool() & ~torch.isin(ids, special)
    assert not (chosen & ~content).any()                               # specials, padding never chosen
    assert chosen.sum(1).tolist() == [3, 1, 0]                         # round(0.3 n), at least 1
    assert torch.equal(new[~chosen], ids[~chosen])
    assert torch.isin(new[chosen], cand).all()                         # random_share 1: all swapped
    same, chosen0 = conisi.subword_replace(ids, mask, special, cand, 0.3, 0.0, generator=g)
    assert torch.equal(same, ids) and chosen0.sum() == 4               # random_share 0: chosen, kept


def test_subword_replace_80_20_and_uniform_positions():
    g = torch.Generator().manual_seed(1)
    n, L = 4000, 12
    ids = torch.randint(10, 50, (n, L), generator=g)
    ids[:, 0], ids[:, -1] = 1, 2
    mask = torch.ones(n, L, dtype=torch.long)
    new, chosen = conisi.subword_replace(ids, mask, torch.tensor([0, 1, 2]), torch.arange(100, 200),
                                         0.15, 0.8, generator=g)
    assert (chosen.sum(1) == 2).all()                                  # round(0.15 * 10) = 2
    swapped = (new != ids).sum() / chosen.sum()
    assert 0.78 < float(swapped) < 0.82                                # 80% random, 20% unchanged
    share = chosen[:, 1:-1].float().mean(0)                            # each content slot ~ 0.2
    assert float(share.min()) > 0.17 and float(share.max()) < 0.23
    assert (new[:, 0] == 1).all() and (new[:, -1] == 2).all()


@pytest.mark.parametrize("random_share", [0.0, 0.2, 0.8])
def test_change_one_guards_o1_rows_left_unchanged(random_share):
    """The o1 guard (NOTE(ours) in change_one): a row whose chosen tokens all stayed as they
    were (the 20% "unchanged" draw, or a random token equal to the original: likely here, with
    10 candidates that are also the sentences' tokens) gets exactly one chosen token changed, to
    another token; every row o1 did change is returned as drawn, so the share of changed tokens
    there is o1's own; a row with no content token cannot change and is returned as it is."""
    g = torch.Generator().manual_seed(2)
    n, L = 3000, 12
    cand = torch.arange(100, 110)
    ids = torch.randint(100, 110, (n, L), generator=g)
    lengths = torch.tensor([12, 3, 2])[torch.arange(n) % 3]              # 10 tokens, 1 token, none
    mask = (torch.arange(L)[None] < lengths[:, None]).long()
    ids = torch.where(mask.bool(), ids, 0)
    ids[:, 0] = 1
    ids[torch.arange(n), lengths - 1] = 2
    new, chosen = conisi.subword_replace(ids, mask, torch.tensor([0, 1, 2]), cand, 0.15, random_share,
                                         generator=g)
    out = conisi.change_one(new, ids, chosen, cand, generator=g)
    changed, content = (new != ids).any(1), chosen.any(1)
    assert torch.equal(out[changed], new[changed])                       # o1's draw, untouched
    assert torch.equal((out != ids).any(1), content)                     # c_i != x_i wherever it can
    stuck = content & ~changed
    assert int(stuck[1::3].sum()) > 100                                  # one-token rows needed it
    diff = (out != ids)[stuck]
    assert (diff.sum(1) == 1).all() and not (diff & ~chosen[stuck]).any()   # one chosen token
    assert torch.isin(out[stuck][diff], cand).all()
    step = (out[stuck][diff] - ids[stuck][diff]) % 10                    # the new token, as an offset
    counts = torch.bincount(step, minlength=10)                          # uniform over the 9 others
    assert counts[0] == 0 and int(counts[1:].max()) < 2 * int(counts[1:].min())


TABLE = {"good": ["bad"], "big": ["small", "little"], "up": ["down"], "happy": ["unhappy"]}


def test_antonym_replace_with_a_table():
    rng = random.Random(0)
    assert conisi.antonym_replace("Nothing here matches .", TABLE, 0.15, rng) is None
    out = conisi.antonym_replace("Good news, the dog is happy.", TABLE, 0.15, rng)
    # 6 words x 0.15 -> 1 swap, among the two with an antonym; case and punctuation kept
    assert out in ("Bad news, the dog is happy.", "Good news, the dog is unhappy.")
    out = conisi.antonym_replace("Good news, the dog is happy.", TABLE, 1.0, rng)
    assert out == "Bad news, the dog is unhappy."                      # never more than exist
    outs = {conisi.antonym_replace("a big house", TABLE, 0.15, random.Random(s)) for s in range(30)}
    assert outs == {"a small house", "a little house"}
    a = [conisi.antonym_replace("good big up", TABLE, 0.5, random.Random(5)) for _ in range(2)]
    assert a[0] == a[1] and sum(w1 != w2 for w1, w2 in zip(a[0].split(), "good big up".split())) == 2
    assert conisi.antonym_replace("good", lambda w: TABLE.get(w, []), 0.1, rng) == "bad"  # a callable


def test_o2_without_nltk_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "nltk", None)
    monkeypatch.setitem(sys.modules, "nltk.corpus", None)
    with pytest.raises(UserError, match="pip install nltk") as e:
        conisi.wordnet_antonyms()
    assert "wordnet" in str(e.value)


def test_read_antonym_table(tmp_path):
    p = tmp_path / "ant.tsv"
    p.write_text("Good\tbad\nbig\tsmall\n\nbig\tlittle\n", encoding="utf-8")
    assert conisi.read_antonym_table(p) == {"good": ["bad"], "big": ["small", "little"]}
    p.write_text("good bad\n", encoding="utf-8")
    with pytest.raises(UserError, match="line 1"):
        conisi.read_antonym_table(p)
    with pytest.raises(UserError, match="no such file"):
        conisi.read_antonym_table(tmp_path / "missing.tsv")


# ------------------------------------------------------------------------------------
# the model: head (Eq. 2, 6-7), BatchNorm, the o2 fallback, gradients
# ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tiny_bert, tiny_tok):
    from transformers import AutoModel

    def make(strategy="s", lam=0.8, tau=0.05, **kw):
        torch.manual_seed(0)
        enc = AutoModel.from_pretrained(str(tiny_bert))
        return conisi.ConIsI(enc, conisi.pair_template(tiny_tok), tau, lam, strategy,
                             tiny_tok.all_special_ids, len(tiny_tok), **kw)
    return make


def ref_g(m, h_cls):
    """Eq. (2) by hand, BatchNorm's training statistics written out: mean and biased variance
    over exactly the rows given, per feature."""
    lin, bn = m.g[0], m.g[1]
    z = h_cls @ lin.weight.T + lin.bias                                # W_1 h + b_1
    mu = z.sum(0) / z.shape[0]
    var = ((z - mu) ** 2).sum(0) / z.shape[0]
    return F.elu((z - mu) / torch.sqrt(var + bn.eps) * bn.weight + bn.bias)


def ref_r(m, h):
    """Eq. (7) by hand, row by row: r_i = w_3 . h_i + b_3."""
    return torch.stack([h[i] @ m.w3.weight[0] + m.w3.bias[0] for i in range(h.shape[0])])


def ref_pairs(m, c_Y, c_Z, reading):
    """(h_Y, r_Y, r_Z) from the pairs' [CLS] rows under one BatchNorm reading."""
    n = c_Y.shape[0]
    if reading == "joint":                                             # one batch of 2N
        g = ref_g(m, torch.cat([c_Y, c_Z]))
        g_Y, g_Z = g[:n], g[n:]
    else:                                                              # two batches of N
        g_Y, g_Z = ref_g(m, c_Y), ref_g(m, c_Z)
    return g_Y, ref_r(m, g_Y), ref_r(m, g_Z)


def test_head_is_eq2_and_eq7(tiny_model):
    m = tiny_model()
    m.train()
    h_cls = torch.randn(6, 32)
    h, r = m.head(h_cls)
    assert torch.allclose(h, ref_g(m, h_cls), atol=1e-5)               # Eq. (2)
    assert r.shape == (6,)
    assert torch.allclose(r, ref_r(m, h), atol=1e-5)                   # Eq. (7), d -> 1
    with pytest.raises(UserError, match="--batch_size"):
        m.head(torch.randn(1, 32))


@pytest.mark.parametrize("reading", ["joint", "separate"])
def test_head_pairs_batchnorm_reading(reading, tiny_model):
    """--bn joint (the default): Y and Z are one BatchNorm batch of 2N; --bn separate: two of N.
    Z is shifted away from Y, so the two readings give clearly different outputs."""
    m = tiny_model() if reading == "joint" else tiny_model(bn="separate")
    assert m.bn == reading
    m.train()
    g = torch.Generator().manual_seed(4)
    c_Y, c_Z = torch.randn(5, 32, generator=g), 3 + 2 * torch.randn(5, 32, generator=g)
    h_Y, r_Y, r_Z = m.head_pairs(torch.cat([c_Y, c_Z]))
    assert h_Y.shape == (5, 32) and r_Y.shape == (5,) and r_Z.shape == (5,)
    other = {"joint": "separate", "separate": "joint"}[reading]
    for got, want, wrong in zip((h_Y, r_Y, r_Z), ref_pairs(m, c_Y, c_Z, reading),
                                ref_pairs(m, c_Y, c_Z, other)):
        assert torch.allclose(got.detach(), want, atol=1e-5)
        assert not torch.allclose(got.detach(), wrong, atol=1e-2)
    # the defect of the separate reading: after BN, Y and Z have the same mean per feature
    # (beta), so only ELU's curvature is left to tell the two batches apart in r
    with torch.no_grad():
        pre = m.g[:2]                                                  # BN(W_1 h + b_1), no ELU
        bn_Y, bn_Z = ((pre(c_Y), pre(c_Z)) if reading == "separate"
                      else pre(torch.cat([c_Y, c_Z])).split(5))
    gap = float((bn_Y.mean(0) - bn_Z.mean(0)).abs().max())
    assert gap < 1e-5 if reading == "separate" else gap > 0.5


def test_bn_flag(tiny_model, tiny_bert, corpus, small_sts, tmp_path, cache_dir, monkeypatch):
    """--bn reaches the model (joint when left out); an unknown reading is refused."""
    assert conisi.Args().bn == "joint"
    seen = []
    monkeypatch.setattr(common, "train", lambda args, run, model, *a, **k: seen.append(model.bn) or {})
    _run(tiny_bert, corpus, small_sts, tmp_path / "a", cache_dir)
    _run(tiny_bert, corpus, small_sts, tmp_path / "b", cache_dir, "--bn", "separate")
    assert seen == ["joint", "separate"]
    with pytest.raises(UserError, match="--bn apart: not one of joint, separate"):
        flags.build_parser(conisi.Args).parse_args(["--bn", "apart"])
    with pytest.raises(UserError, match="--bn"):
        tiny_model(bn="apart")


@pytest.mark.parametrize("reading", ["joint", "separate"])
def test_forward_gives_every_parameter_a_gradient(reading, tiny_model, tiny_tok):
    m = tiny_model("o1", bn=reading)
    m.train()
    batch = {"text": _batch(tiny_tok, SENTS, 16)}
    loss, stats = m(batch)
    assert loss.shape == () and torch.isfinite(loss)
    assert set(stats) == {"loss_contrastive", "loss_interactive", "acc_interactive", "share_interactive"}
    assert float(loss.detach()) == pytest.approx(0.2 * float(stats["loss_contrastive"])
                                        + 0.8 * float(stats["loss_interactive"]), rel=1e-5)
    assert float(stats["share_interactive"]) == pytest.approx(0.8 * float(stats["loss_interactive"])
                                                              / float(loss.detach()), rel=1e-6)
    loss.backward()
    names = [n for n, p in m.named_parameters() if p.grad is None and "encoder.pooler" not in n]
    assert names == []
    assert float(m.w3.weight.grad.abs().sum()) > 0 and float(m.g[0].weight.grad.abs().sum()) > 0


@pytest.mark.parametrize("reading", ["joint", "separate"])
def test_forward_is_eq10_over_x_Y_Z(reading, tiny_model, tiny_tok):
    """The forward pass against the pieces done by hand: h_x from x alone (BatchNorm over its
    N rows), h_Y and r_Y from Y = (x, x), r_Z from Z = (x, x_k), BatchNorm over Y and Z together
    (default) or apart (--bn separate), and Eq. (10) from the per-row loops.

    tau = 0.5, not the paper's 0.05: at tau = 0.05 the tiny random BERT's contrastive loss can
    saturate (1e-7 to 1e-2 was seen), so a wrong BatchNorm batch for x would move the loss by
    less than the tolerance and the test could not catch that bug."""
    tau, lam = 0.5, 0.6
    m = tiny_model("s", lam=lam, tau=tau) if reading == "joint" else tiny_model(
        "s", lam=lam, tau=tau, bn="separate")
    m.train()
    m.encoder.eval()                                                   # no dropout: comparable
    x = _batch(tiny_tok, SENTS, 16)
    torch.manual_seed(1)
    loss, _ = m({"text": x})
    torch.manual_seed(1)
    k = conisi.other_index(len(SENTS))                                 # the same draw as forward
    c = {"input_ids": x["input_ids"][k], "attention_mask": x["attention_mask"][k]}
    with torch.no_grad():
        c_x = m.cls(x)                                                 # (N, d) [CLS] of x
        c_Y = m.cls(conisi.compose_pairs(x, x, m.tpl))                 # (N, d) [CLS] of Y
        c_Z = m.cls(conisi.compose_pairs(x, c, m.tpl))                 # (N, d) [CLS] of Z

    def eq10(h_x, pairs):
        h_Y, r_Y, r_Z = pairs
        return (1 - lam) * loop_contrastive(h_x, h_Y, tau) + lam * loop_interactive(r_Y, r_Z)

    other = {"joint": "separate", "separate": "joint"}[reading]
    with torch.no_grad():
        want = eq10(ref_g(m, c_x), ref_pairs(m, c_Y, c_Z, reading))
        swapped = eq10(ref_g(m, c_x), ref_pairs(m, c_Y, c_Z, other))
        mixed = eq10(ref_g(m, torch.cat([c_x, c_Y]))[:len(SENTS)], ref_pairs(m, c_Y, c_Z, reading))
    assert_matches_paper(loss.detach(), want, "ConIsI's forward", "ConIsI Eq. (10)", rel=1e-4,
                         reference="Eq. (10) from per-row loops over x, Y and Z")
    # the guards have power: the other reading, and one BatchNorm over x and Y together, both
    # move the loss far beyond the tolerance above (here by about 3 % and 20 %; the tiny BERT
    # is the same in every session, see conftest.build_tiny_bert)
    assert abs(swapped - want) > 1e-2 * abs(want)
    assert abs(mixed - want) > 1e-2 * abs(want)


@pytest.mark.parametrize("reading", ["joint", "separate"])
def test_lam_zero_has_no_path_from_c(reading, tiny_model, tiny_tok, monkeypatch):
    """Tab. 5's "w/o fine-grained classification loss" (Sec. 4.6: a SimCSE-like model): at lam 0
    no c_i may reach the loss, whatever --bn says. Every c_i changed (other strategies, or make_c
    handing back other sentences) leaves the loss and every gradient as they were; Z is neither
    composed nor encoded (the encoder sees x and Y, N rows each); Y is a BatchNorm batch of its
    own (the loss is Eq. (3)-(4) on ref_g(x) and ref_g(Y)); W3, in no loss, is frozen, since
    DDP runs without find_unused_parameters; only the contrastive loss is logged."""
    tau, n = 0.5, len(SENTS)  # tau 0.5: see test_forward_is_eq10_over_x_Y_Z
    x, anto = _batch(tiny_tok, SENTS, 16), _batch(tiny_tok, OTHERS, 16)

    def step(strategy, c=None):
        m = tiny_model(strategy, lam=0.0, tau=tau, bn=reading)
        m.train()
        m.encoder.eval()                                               # no dropout: only c differs
        if c is not None:
            monkeypatch.setattr(m, "make_c", lambda batch: c)
        rows = []
        m.encoder.register_forward_hook(
            lambda mod, a, kw, out: rows.append(kw["input_ids"].shape[0]), with_kwargs=True)
        loss, stats = m({"text": x, "anto": anto})
        loss.backward()
        grads = {k: p.grad for k, p in m.named_parameters() if p.grad is not None}
        return m, loss.detach(), stats, grads, list(rows)

    m, loss, stats, grads, rows = step("s")
    with torch.no_grad():
        c_x, c_Y = m.cls(x), m.cls(conisi.compose_pairs(x, x, m.tpl))
        want = loop_contrastive(ref_g(m, c_x), ref_g(m, c_Y), tau)
    assert_matches_paper(loss, want, "ConIsI's forward at lam 0", "ConIsI Eq. (3)-(4)", rel=1e-4)
    assert set(stats) == {"loss_contrastive"} and torch.equal(stats["loss_contrastive"], loss)
    assert rows == [n, n]                                              # x, then Y: no Z
    assert not m.w3.weight.requires_grad and not m.w3.bias.requires_grad
    assert [k for k, p in m.named_parameters() if p.requires_grad and p.grad is None
            and "encoder.pooler" not in k] == []                      # DDP: every weight a gradient
    others = [step("o1"), step("o2"), step("s", c=anto),
              step("s", c=_batch(tiny_tok, list(reversed(OTHERS)), 16))]
    for _, loss_c, _, grads_c, rows_c in others:
        assert torch.allclose(loss_c, loss, rtol=1e-6, atol=0) and rows_c == [n, n]
        assert grads_c.keys() == grads.keys()
        assert all(torch.allclose(grads_c[k], grads[k], rtol=1e-5, atol=1e-9) for k in grads)


def test_make_c_per_strategy(tiny_model, tiny_tok):
    x = _batch(tiny_tok, SENTS, 16)
    m = tiny_model("s")
    c = m.make_c({"text": x})
    for i in range(len(SENTS)):  # each c_i is another row of the batch, never x_i
        row = c["input_ids"][i]
        hits = [j for j in range(len(SENTS)) if torch.equal(row, x["input_ids"][j])]
        assert hits and i not in hits
    m = tiny_model("o2")
    m.replace_share, m.random_share = 1.0, 1.0
    anto = _batch(tiny_tok, ["a woman is playing a guitar .", "hello", "the slow brown fox jumps over "
                             "the lazy dog today", "it is not a problem ."], 16)
    c = m.make_c({"text": x, "anto": anto})
    L = c["input_ids"].shape[1]
    assert torch.equal(c["input_ids"][0], F.pad(anto["input_ids"][0], (0, L - anto["input_ids"].shape[1])))
    for i in (1, 3):  # no antonym found: c_i = x_i would copy Y_i, so o1 replaces its words
        m_i = x["attention_mask"][i].bool()
        assert not torch.equal(c["input_ids"][i][:m_i.numel()][m_i], x["input_ids"][i][m_i])
        assert torch.equal(c["attention_mask"][i][:m_i.numel()], x["attention_mask"][i])


@pytest.mark.parametrize("random_share", [0.0, 0.2])
def test_o1_never_composes_Z_equal_to_Y(random_share, tiny_model, tiny_tok):
    """One-token sentences under o1: the one chosen token stays as it is 80% or 100% of the time,
    so without the guard most Z_i = (x_i, c_i) would be Y_i = (x_i, x_i) under the opposite label.
    With it, none is over 30 draws; the longer rows of a mixed batch get o1's own draw (make_c
    draws subword_replace first), so the share of changed tokens there is as before."""
    # eight words that are one token each in the tiny vocabulary
    words = sorted(w for w in tiny_tok.get_vocab() if w.isalpha() and len(w) > 2
                   and len(tiny_tok(w, add_special_tokens=False)["input_ids"]) == 1)[:8]
    x = _batch(tiny_tok, words, 8)
    assert (x["attention_mask"].sum(1) == 3).all()                     # [CLS] w [SEP]: one token each
    m = tiny_model("o1")
    m.random_share = random_share
    Y = conisi.compose_pairs(x, x, m.tpl)
    for seed in range(30):
        torch.manual_seed(seed)
        Z = conisi.compose_pairs(x, m.make_c({"text": x}), m.tpl)
        assert all(not torch.equal(Z["input_ids"][i], Y["input_ids"][i]) for i in range(len(words)))
    mixed = _batch(tiny_tok, SENTS + words, 16)
    kept = 0
    for seed in range(30):
        torch.manual_seed(seed)
        c = m.make_c({"text": mixed})
        torch.manual_seed(seed)
        new, _ = conisi.subword_replace(mixed["input_ids"], mixed["attention_mask"], m.special_ids,
                                        m.candidates, m.replace_share, m.random_share)
        drawn = (new != mixed["input_ids"]).any(1)                     # rows o1 itself changed
        assert torch.equal(c["input_ids"][drawn], new[drawn])
        assert torch.equal(c["attention_mask"], mixed["attention_mask"])
        assert (c["input_ids"] != mixed["input_ids"]).any(1).all()
        kept += int(drawn.sum())
    assert (kept > 0) == (random_share > 0)                          # the check had rows to check


def test_o1_row_without_content_takes_another_sentence(tiny_model, tiny_tok):
    """A row of special tokens only ([CLS] [UNK] [SEP]) has no subword to replace: its c_i is
    another sentence of the batch (as strategy s draws it), never x_i itself."""
    x = _batch(tiny_tok, ["[UNK]"] + SENTS, 16)
    assert x["input_ids"][0, :3].tolist() == [tiny_tok.cls_token_id, tiny_tok.unk_token_id,
                                              tiny_tok.sep_token_id]
    m = tiny_model("o1")
    for seed in range(20):
        torch.manual_seed(seed)
        c = m.make_c({"text": x})
        hits = [j for j in range(1, len(SENTS) + 1) if torch.equal(c["input_ids"][0], x["input_ids"][j])
                and torch.equal(c["attention_mask"][0], x["attention_mask"][j])]
        assert hits                                                    # another sentence, whole


def paper_rows(*argv: str) -> tuple[dict[str, common.PaperRow], str]:
    """The rows of PAPER_ROWS a command's flags select, by label, and the note (flags.select_rows)."""
    picked, note = flags.select_rows(common.parse_args(conisi.Args, list(argv)), conisi.PAPER_ROWS)
    return dict(picked), note


def averages(*argv: str) -> dict[str, float]:
    return {label: r.figures["avg"] for label, r in paper_rows(*argv)[0].items()}


def test_paper_rows_per_lam_strategy_and_model():
    rows, note = paper_rows()
    assert note == "" and sorted(rows) == ["Tab. 4 ConIsI-s-BERT_base", "Tab. 5 ConIsI-s-BERT_base",
                                           "Tab. 6 ConIsI-s-BERT_base",
                                           "Tab. 7 ConIsI-s-BERT_base, lam = 0.8"]
    row = rows["Tab. 4 ConIsI-s-BERT_base"].figures
    assert row["avg"] == 78.30 and row["STSBenchmark"] == 82.15
    assert np.mean([row[t] for t in common.STS_TASKS]) == pytest.approx(78.30, abs=0.01)
    assert all(r.headline() == [78.30] for r in rows.values())
    assert averages("--strategy", "o1") == {"Tab. 6 ConIsI-o1-BERT_base": 77.14}
    assert averages("--strategy", "o2") == {"Tab. 6 ConIsI-o2-BERT_base": 77.35}
    lam0 = {"Tab. 5 w/o fine-grained classification loss": 77.00, "Tab. 7 ConIsI-s-BERT_base, lam = 0": 77.00}
    assert averages("--lam", "0") == lam0
    assert averages("--strategy", "o2", "--lam", "0") == lam0            # lam 0: c_i plays no part
    assert averages("--lam", "0.5") == {"Tab. 7 ConIsI-s-BERT_base, lam = 0.5": 78.03}
    assert averages("--strategy", "o1", "--lam", "0.5") == {}
    assert averages("--lam", "1") == {"Tab. 5 w/o contrastive loss": 67.68}   # Tab. 5, w/o contrastive
    roberta_s = {"Tab. 4 ConIsI-s-RoBERTa_base": 77.34, "Tab. 6 ConIsI-s-RoBERTa_base": 77.34}
    assert averages("--model", "roberta-base", "--lam", "0.1") == roberta_s   # Tab. 3's lam
    assert averages("--model", "/models/roberta-base", "--lam", "0.1", "--strategy", "o1") == {
        "Tab. 6 ConIsI-o1-RoBERTa_base": 78.35}
    assert averages("--model", "roberta-base") == {}                     # not reported at lam 0.8
    assert averages("--model", "bert-large-uncased", "--max_len", "28", "--lam", "0.1") == {
        "Tab. 4 ConIsI-s-BERT_large": 79.55}
    assert averages("--model", "bert-large-uncased", "--lam", "0.1") == {}   # Tab. 3: max_len 28
    assert paper_rows("--lam", "0.15") == ({}, "the paper reports no row for --lam 0.15")
    assert paper_rows("--bn", "separate") == ({}, "the paper reports no row for --bn separate")
    # the o1 / o2 rows say that their lam is our reading, the lam 0 stand-ins that c_i plays no part
    assert "our reading" in paper_rows("--model", "roberta-base", "--lam", "0.1", "--strategy", "o2")[0][
        "Tab. 6 ConIsI-o2-RoBERTa_base"].note
    assert all("no c_i" in r.note for r in paper_rows("--strategy", "o1", "--lam", "0")[0].values())
    # a model the paper did not train shows BERT-base's rows, labelled so
    rows, note = paper_rows("--model", "sentence-transformers/all-MiniLM-L6-v2", "--lam", "1")
    assert list(rows) == ["Tab. 5 w/o contrastive loss [paper: bert-base-uncased]"] and "not a model" in note


def test_paper_rows_are_the_papers_tables():
    """Every 7-task row averages to its published Avg. (Tab. 4 rounds each figure to 0.01), and
    the rows of one table agree where they are the same run (Tab. 4, 5, 6 and 7's ConIsI-s)."""
    for r in conisi.PAPER_ROWS:
        tasks = [r.figures[t] for t in common.STS_TASKS if t in r.figures]
        assert not tasks or (len(tasks) == 7 and np.mean(tasks) == pytest.approx(r.figures["avg"], abs=0.01))
    assert {(r.table, r.figures["avg"]) for r in conisi.PAPER_ROWS if r.flags.get("lam", 0.8) == 0.8
            and r.flags.get("strategy", "s") == "s" and not r.model} == {
        ("Tab. 4", 78.30), ("Tab. 5", 78.30), ("Tab. 6", 78.30), ("Tab. 7", 78.30)}


def test_paper_row_labels_fit_the_final_table():
    """Each label a run can print is shown whole, and the figures stay in their columns, for
    every strategy, model and lam the rows cover."""
    res = {**{t: {"spearman": 50.0} for t in common.STS_TASKS}, "avg": 50.0}
    for strategy in ("s", "o1", "o2"):
        for model in ("bert-base-uncased", "roberta-base", "bert-large-uncased", "all-MiniLM-L6-v2"):
            for lam in ("0", "0.1", "0.5", "0.8", "1"):
                rows, _ = paper_rows("--strategy", strategy, "--model", model, "--lam", lam,
                                     *(["--max_len", "28"] if model == "bert-large-uncased" else []))
                table = format_sts_table(res, [(label, r.figures) for label, r in rows.items()])
                lines = table.splitlines()[:-1]
                assert len({len(line) for line in lines}) == 1, table
                assert all(any(line.startswith(label + " ") for line in lines) for label in rows)


# ------------------------------------------------------------------------------------
# end to end on CPU
# ------------------------------------------------------------------------------------

def _run(tiny_bert, data, sts_dir, out, cache_dir, *extra):
    return conisi.main(["--model", str(tiny_bert), "--data", str(data), "--sts_dir", str(sts_dir),
                        "--output_dir", str(out), "--max_steps", "4", "--eval_every", "2",
                        "--batch_size", "8", "--max_len", "16", "--log_every", "2",
                        "--cache_dir", str(cache_dir), *extra])


@pytest.mark.parametrize("strategy", ["s", "o1", "o2"])
def test_end_to_end(strategy, tiny_bert, corpus, small_sts, tmp_path, cache_dir, capsys):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer
    extra = ["--strategy", strategy, "--batch_size", "64", "--max_len", "32"]   # Tab. 3's: rows print
    if strategy == "o2":
        table = tmp_path / "ant.tsv"
        table.write_text("good\tbad\nlarge\tsmall\nfirst\tlast\nnew\told\nhigh\tlow\n", encoding="utf-8")
        extra += ["--antonyms", str(table)]
    res = _run(tiny_bert, corpus, small_sts, tmp_path / "run", cache_dir, *extra)
    out = capsys.readouterr().out
    label = f"Tab. 6 ConIsI-{strategy}-BERT_base [paper: bert-base-uncased]"   # the tiny BERT stands in
    assert label in out and "this run" in out
    line = next(line for line in out.splitlines() if line.startswith(label))
    assert line.split()[-1] == {"s": "78.30", "o1": "77.14", "o2": "77.35"}[strategy]
    if strategy == "s":  # the default run: Tab. 4's 7 tasks beside its own, Tab. 5 and 7's rows too
        tab4 = next(line for line in out.splitlines() if line.startswith("Tab. 4 ConIsI-s-BERT_base"))
        assert tab4.split()[-8:] == "70.92 84.35 76.67 83.53 78.94 82.15 71.55 78.30".split()
        assert "Tab. 5 ConIsI-s-BERT_base" in out and "Tab. 7 ConIsI-s-BERT_base, lam = 0.8" in out
    saved = json.loads((tmp_path / "run" / "best" / "test_metrics.json").read_text())
    assert label in [r["label"] for r in saved["paper_rows"]]
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("stsb_dev" in r for r in recs)
    train = [r for r in recs if "loss" in r]
    assert train and all(math.isfinite(r["loss"]) and "loss_interactive" in r for r in train)
    assert res["test"] is not None and "avg" in res["test"]
    args = json.loads((tmp_path / "run" / "args.json").read_text())
    assert args["strategy"] == strategy and args["lam"] == 0.8
    best = tmp_path / "run" / "best"
    enc = AutoModel.from_pretrained(str(best))
    tok = AutoTokenizer.from_pretrained(str(best))
    sents = ["a man is playing a guitar .", "the weather is good today"]
    ours = common.make_encode(enc, tok, "cls_before_pooler")(sents)   # raw [CLS], Sec. 4.2
    st = SentenceTransformer(str(best), device="cpu").encode(sents, convert_to_numpy=True)
    assert np.abs(ours - st).max() < 1e-5


@pytest.mark.parametrize("lam", ["0", "1"])
def test_end_to_end_tab5_ablations(lam, tiny_bert, corpus, small_sts, tmp_path, cache_dir, capsys):
    """Tab. 5's two rows run end to end: --lam 0 (no Z: only the contrastive loss is logged, and
    it is the loss) and --lam 1 (the contrastive loss has weight 0 but is still logged)."""
    res = _run(tiny_bert, corpus, small_sts, tmp_path / "run", cache_dir, "--lam", lam,
               "--batch_size", "64", "--max_len", "32")                # Tab. 3's: the rows print
    name = {"0": "w/o fine-grained classification loss", "1": "w/o contrastive loss"}[lam]
    assert f"Tab. 5 {name} [paper: bert-base-uncased]" in capsys.readouterr().out and res["test"] is not None
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if "loss" in r]
    assert train and all(math.isfinite(r["loss"]) for r in train)
    for r in train:
        if lam == "0":
            assert "loss_interactive" not in r and "acc_interactive" not in r
            assert r["loss"] == pytest.approx(r["loss_contrastive"], rel=1e-5)
        else:
            assert {"loss_contrastive", "loss_interactive", "acc_interactive"} <= set(r)
            assert r["loss"] == pytest.approx(r["loss_interactive"], rel=1e-5)


@pytest.mark.parametrize("flag,value,msg", [
    ("--tau", "0", r"--tau 0\.0: must be > 0\. The paper uses 0\.05 \(Sec\. 4\.3\)\. .*--tau 0\.05"),
    ("--lam", "-0.1", r"--lam -0\.1: must be >= 0\. Eq\. \(10\) is a convex combination; the paper tries "
                      r"0 to 0\.9 \(Tab\. 7\), uses 0\.8 \(BERT-base\), 0\.1 \(RoBERTa-base, BERT-large\)"),
    ("--lam", "1.5", r"--lam 1\.5: must be <= 1\. Eq\. \(10\) is a convex combination.*--lam 0\.8"),
    ("--dropout", "1", r"--dropout 1\.0: must be < 1\. The paper uses 0\.1 \(Sec\. 4\.3\)"),
    ("--replace_share", "1.5", r"--replace_share 1\.5: must be <= 1\. A share; the paper gives none"),
    ("--random_share", "-1", r"--random_share -1\.0: must be >= 0\. A probability; the paper uses 0\.8 "
                             r"\(Sec\. 3\.2\.1\)"),
])
def test_range_errors_give_the_papers_values(flag, value, msg, tiny_bert, corpus, small_sts, tmp_path,
                                             cache_dir):
    with pytest.raises(UserError, match=msg):
        _run(tiny_bert, corpus, small_sts, tmp_path / "run", cache_dir, flag, value)
    assert not (tmp_path / "run").exists()                            # refused before writing


def test_user_errors(tiny_bert, corpus, small_sts, tmp_path, cache_dir, monkeypatch):
    with pytest.raises(UserError, match="--batch_size 1"):
        conisi.main(["--model", str(tiny_bert), "--data", str(corpus), "--sts_dir", str(small_sts),
                     "--output_dir", str(tmp_path / "a"), "--batch_size", "1"])
    with pytest.raises(UserError, match="--max_len 200"):
        _run(tiny_bert, corpus, small_sts, tmp_path / "b", cache_dir, "--max_len", "200")
    with pytest.raises(UserError, match="text file"):
        conisi.main(["--data", str(tmp_path / "x.csv"), "--output_dir", str(tmp_path / "c")])
    monkeypatch.setitem(sys.modules, "nltk", None)
    monkeypatch.setitem(sys.modules, "nltk.corpus", None)
    with pytest.raises(UserError, match="pip install nltk"):
        _run(tiny_bert, corpus, small_sts, tmp_path / "d", cache_dir, "--strategy", "o2")
    assert not (tmp_path / "d").exists()                              # stopped before writing
