"""Focal-InfoNCE (focal_infonce.py): Eq. (2) against a per-row loop, its gradients against
Eq. (5) and the corrected Eq. (4), the reduction to SimCSE's InfoNCE, and a tiny CPU run."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import common
import focal_infonce as fi
from conftest import assert_matches_paper
from plumbing import flags

# -------------------------------------------------------------------------------------
# References written straight from the paper, one row at a time, in float64
# -------------------------------------------------------------------------------------

def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b) / (float(a.norm()) * float(b.norm()))


def eq2_rows(s: list[list[float]], tau: float, m: float) -> list[float]:
    """l_i = -log e^{(s_p^i)^2/tau} / (sum_{j!=i} e^{s_n^{ij}(s_n^{ij}+m)/tau} + e^{(s_p^i)^2/tau})."""
    out = []
    for i in range(len(s)):
        num = math.exp(s[i][i] ** 2 / tau)
        z = num + sum(math.exp(s[i][j] * (s[i][j] + m) / tau) for j in range(len(s)) if j != i)
        out.append(-math.log(num / z))
    return out


def sim_rows(h: torch.Tensor, h_pos: torch.Tensor) -> list[list[float]]:
    """s[i][j] = cos(h_i, h_j^+): anchors in rows, second views in columns."""
    return [[cos(h[i], h_pos[j]) for j in range(len(h_pos))] for i in range(len(h))]


def z_row(s: list[list[float]], i: int, tau: float, m: float) -> float:
    return math.exp(s[i][i] ** 2 / tau) + sum(
        math.exp(s[i][j] * (s[i][j] + m) / tau) for j in range(len(s)) if j != i)


def grad_eq5(s, i, tau, m) -> float:
    """Eq. (5): dL/ds_p^i = (2/tau) (e^{(s_p^i)^2/tau} / Z_i - 1) s_p^i."""
    return 2 / tau * (math.exp(s[i][i] ** 2 / tau) / z_row(s, i, tau, m) - 1) * s[i][i]


def grad_eq4_corrected(s, i, j, tau, m) -> float:
    """Eq. (4) as corrected (focal_infonce.py's erratum note):
    dL/ds_n^{ij} = ((2 s_n^{ij} + m)/tau) e^{s_n^{ij}(s_n^{ij}+m)/tau} / Z_i."""
    return (2 * s[i][j] + m) / tau * math.exp(s[i][j] * (s[i][j] + m) / tau) / z_row(s, i, tau, m)


def grad_eq4_printed(s, i, tau, m) -> float:
    """Eq. (4) as printed: sum_{j!=i} (2/tau) e^{s_n^{ij}(s_n^{ij}+m)/tau} / Z_i (s_n^{ij} + m)."""
    return sum(2 / tau * math.exp(s[i][j] * (s[i][j] + m) / tau) / z_row(s, i, tau, m) * (s[i][j] + m)
               for j in range(len(s)) if j != i)


def autograd_of_sum(s: torch.Tensor, tau: float, m: float, fn=fi.focal_infonce_from_cos) -> torch.Tensor:
    """dL/ds for the paper's L = sum_i l_i (Eq. 3) = N x the batch mean."""
    s = s.clone().requires_grad_(True)
    (fn(s, tau, m) * s.shape[0]).backward()
    return s.grad


def random_cos(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, n, generator=g, dtype=torch.float64) * 2 - 1       # (N, N) in [-1, 1)


# -------------------------------------------------------------------------------------
# Eq. (2)
# -------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,d,tau,m", [(7, 5, 0.07, 0.3), (16, 8, 0.05, 0.2), (3, 4, 0.5, 0.0),
                                       (5, 3, 0.1, -0.2)])
def test_loss_matches_per_row_loop(n, d, tau, m):
    g = torch.Generator().manual_seed(n * 100 + d)
    # unnormalised views, so a missing F.normalize would show
    h = torch.randn(n, d, generator=g, dtype=torch.float64) * 3              # (N, d)
    h_pos = h + 0.8 * torch.randn(n, d, generator=g, dtype=torch.float64)    # (N, d)
    got = fi.focal_infonce_loss(h, h_pos, tau, m)
    assert got.dim() == 0
    want = float(np.mean(eq2_rows(sim_rows(h, h_pos), tau, m)))
    assert_matches_paper(got, want, "focal_infonce_loss", "Focal-InfoNCE Eq. (2)", rel=1e-10, abs=1e-10)
    # orientation: rows are anchors h_i, columns second views h_j^+ (not the transpose)
    transposed = float(np.mean(eq2_rows(sim_rows(h_pos, h), tau, m)))
    assert abs(transposed - want) > 1e-6


def test_loss_ties_and_batch_of_one():
    tau, m = 0.07, 0.3
    # every vector the same: all similarities tie at 1
    h = torch.ones(4, 6, dtype=torch.float64)                                # (4, d)
    want = -math.log(math.exp(1 / tau) / (math.exp(1 / tau) + 3 * math.exp((1 + m) / tau)))
    assert_matches_paper(fi.focal_infonce_loss(h, h, tau, m), want, "focal_infonce_loss",
                         "Focal-InfoNCE Eq. (2)", rel=1e-10, reference="every similarity tied at 1")
    # ties between negatives of one row
    s = torch.tensor([[0.9, 0.2, 0.2], [0.5, 0.8, 0.5], [-0.1, -0.1, 0.7]], dtype=torch.float64)
    want = float(np.mean(eq2_rows(s.tolist(), tau, m)))
    assert_matches_paper(fi.focal_infonce_from_cos(s, tau, m), want, "focal_infonce_from_cos",
                         "Focal-InfoNCE Eq. (2)", rel=1e-10,
                         reference="the paper's per-row loop, with tied negatives")
    # a batch of one: no negatives, the positive is the whole denominator, l = 0
    h1 = torch.randn(1, 6, dtype=torch.float64)
    assert_matches_paper(fi.focal_infonce_loss(h1, h1 + 0.3, tau, m), 0.0, "focal_infonce_loss",
                         "Focal-InfoNCE Eq. (2)", abs=1e-12, reference="a batch of one: -log 1")


def test_low_precision_input_is_computed_in_fp32():
    s = random_cos(8, 3)
    got = fi.focal_infonce_from_cos(s.to(torch.bfloat16), 0.07, 0.3)
    assert got.dtype == torch.float32
    want = float(np.mean(eq2_rows(s.to(torch.bfloat16).double().tolist(), 0.07, 0.3)))
    assert_matches_paper(got, want, "focal_infonce_from_cos", "Focal-InfoNCE Eq. (2)", rel=1e-5,
                         reference="the paper's per-row loop, on bf16 input")


# -------------------------------------------------------------------------------------
# Gradients: Eq. (5) as printed, Eq. (4) as corrected
# -------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,tau,m,seed", [(6, 0.07, 0.3, 0), (9, 0.05, 0.2, 1), (4, 0.5, 0.0, 2)])
def test_gradients_match_eq5_and_corrected_eq4(n, tau, m, seed):
    s = random_cos(n, seed)
    grad = autograd_of_sum(s, tau, m)                                        # (N, N)
    rows = s.tolist()
    for i in range(n):
        assert_matches_paper(grad[i, i], grad_eq5(rows, i, tau, m), "focal_infonce_from_cos's gradient",
                             "Focal-InfoNCE Eq. (5)", rel=1e-9, abs=1e-12, reference=f"dL/ds_p^{i}")
        for j in range(n):
            if j != i:
                assert_matches_paper(grad[i, j], grad_eq4_corrected(rows, i, j, tau, m),
                                     "focal_infonce_from_cos's gradient",
                                     "Focal-InfoNCE Eq. (4) as corrected (focal_infonce.py's erratum note)",
                                     rel=1e-9, abs=1e-12, reference=f"dL/ds_n^{i},{j}")


def test_printed_eq4_is_not_the_derivative():
    """The erratum is real: Eq. (4) as printed disagrees with autograd (and with the sum of
    the corrected per-pair derivatives) whenever m != 0."""
    tau, m = 0.07, 0.3
    s = random_cos(5, 7)
    grad = autograd_of_sum(s, tau, m)                                        # (N, N)
    rows = s.tolist()
    for i in range(5):
        row_sum = float(grad[i].sum() - grad[i, i])
        assert abs(grad_eq4_printed(rows, i, tau, m) - row_sum) > 1e-3


def test_modulation_factors_are_not_detached():
    """A detached factor (a plausible bug) gives s_p/tau, not 2 s_p/tau, in the gradient:
    the Eq. (5) check above would catch it; so does this direct comparison."""
    tau, m = 0.07, 0.3

    def detached(s, tau, m):
        pos = torch.eye(s.shape[0], dtype=torch.bool)
        logits = s * torch.where(pos, s, s + m).detach() / tau
        return F.cross_entropy(logits, torch.arange(s.shape[0]))

    s = random_cos(6, 11)
    ours, bug = autograd_of_sum(s, tau, m), autograd_of_sum(s, tau, m, detached)
    # same loss value, different gradient
    assert float(fi.focal_infonce_from_cos(s, tau, m)) == pytest.approx(float(detached(s, tau, m)))
    assert not torch.allclose(ours, bug, atol=1e-6)


def test_batch_of_one_gradient_is_zero():
    s = torch.tensor([[0.6]], dtype=torch.float64)
    grad = autograd_of_sum(s, 0.07, 0.3)
    assert_matches_paper(grad[0, 0], grad_eq5(s.tolist(), 0, 0.07, 0.3), "focal_infonce_from_cos's gradient",
                         "Focal-InfoNCE Eq. (5)", abs=1e-12, reference="a batch of one")
    assert float(grad[0, 0]) == pytest.approx(0.0, abs=1e-12)


# -------------------------------------------------------------------------------------
# Reduction: modulate=False is unsupervised SimCSE's InfoNCE
# -------------------------------------------------------------------------------------

def simcse_infonce(h: torch.Tensor, h_pos: torch.Tensor, tau: float) -> torch.Tensor:
    """SimCSE Eq. (4), written out: l_i = -log e^{cos(h_i,h_i^+)/tau} / sum_j e^{cos(h_i,h_j^+)/tau}."""
    s = F.cosine_similarity(h[:, None, :], h_pos[None, :, :], dim=-1)        # (N, N)
    return (torch.logsumexp(s / tau, dim=1) - s.diagonal() / tau).mean()


@pytest.mark.parametrize("m", [0.0, 0.3, 0.9])
def test_no_modulation_is_simcse(m):
    g = torch.Generator().manual_seed(5)
    h = torch.randn(10, 7, generator=g, dtype=torch.float64)                 # (N, d)
    h_pos = torch.randn(10, 7, generator=g, dtype=torch.float64)             # (N, d)
    got = fi.focal_infonce_loss(h, h_pos, 0.05, m, modulate=False)
    assert_matches_paper(got, simcse_infonce(h, h_pos, 0.05), "focal_infonce_loss(modulate=False)",
                         "SimCSE Eq. (4), the InfoNCE of Focal-InfoNCE's Eq. (1)", rel=1e-10,
                         reference="SimCSE's InfoNCE written out")
    # and the modulation does change it
    assert abs(float(fi.focal_infonce_loss(h, h_pos, 0.05, m)) - float(got)) > 1e-3


# -------------------------------------------------------------------------------------
# Logged statistics and flags
# -------------------------------------------------------------------------------------

def test_similarity_stats():
    s = torch.tensor([[0.9, 0.8, 0.1], [0.75, 0.7, -0.4], [0.2, 0.5, 0.8]])
    st = fi.similarity_stats(s, m=0.3)
    assert float(st["s_p"]) == pytest.approx((0.9 + 0.7 + 0.8) / 3)
    assert float(st["s_n"]) == pytest.approx((0.8 + 0.1 + 0.75 - 0.4 + 0.2 + 0.5) / 6)
    assert float(st["hard_frac"]) == pytest.approx(2 / 6)    # 0.8 and 0.75 exceed 1 - m = 0.7
    one = fi.similarity_stats(torch.tensor([[0.5]]), m=0.3)
    assert all(torch.isfinite(v) for v in one.values())


def test_defaults_and_sources():
    a = common.parse_args(fi.Args, [])
    assert (a.tau, a.m, a.lr, a.batch_size, a.modulate) == (0.07, 0.3, 3e-5, 64, True)
    src = {f.name: fi.Args.SOURCES.get(f.name, f.metadata["source"]) for f in dataclasses.fields(fi.Args)}
    assert (src["tau"], src["lr"], src["batch_size"]) == ("paper Tab. 4", "paper Tab. 1", "paper Tab. 1")
    assert common.parse_args(fi.Args, ["--no-modulate", "--m", "0.2"]).modulate is False


def test_bad_input_errors(tmp_path, small_sts):
    csv = tmp_path / "pairs.csv"
    csv.write_text("sent0,sent1\na,b\n")
    with pytest.raises(common.UserError, match=r"--data .*pairs\.csv.*simcse\.py"):
        fi.main(["--data", str(csv), "--output_dir", str(tmp_path / "r1"), "--sts_dir", str(small_sts)])
    with pytest.raises(common.UserError, match="--tau"):
        fi.main(["--tau", "0", "--output_dir", str(tmp_path / "r2"), "--sts_dir", str(small_sts)])
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()


# -------------------------------------------------------------------------------------
# The paper's rows: which ones a command selects
# -------------------------------------------------------------------------------------

def selected(*argv: str) -> tuple[dict[str, list[float]], str]:
    """{label: headline figures} of the rows the command's flags select, and the note."""
    picked, note = flags.select_rows(common.parse_args(fi.Args, list(argv)), fi.PAPER_ROWS)
    return {label: r.headline() for label, r in picked}, note


def test_the_default_run_selects_the_main_row_and_each_ablations_default():
    rows, note = selected()
    assert rows == {"Tab. 2 SimCSE-BERT_base + Focal-InfoNCE": [77.33],
                    "Tab. 3 +Focal InfoNCE": [0.134, -1.906, 79.31],
                    "Tab. 4 BERT_base, tau = 0.07": [79.31],
                    "Tab. 5 BERT_base, m = 0.3": [79.31, 72.72]}
    assert note == ""
    # Tab. 2's seven figures as published (STS14's 79.00 included: see the NOTE beside PAPER_ROWS)
    row = next(r for r in fi.PAPER_ROWS if r.label == "Tab. 2 SimCSE-BERT_base + Focal-InfoNCE")
    assert row.figures == dict(zip(common.STS_TASKS + ["avg"],
                                   [68.50, 83.70, 79.00, 82.71, 79.43, 78.85, 72.99, 77.33]))
    assert row.note == "a mean over seeds (Sec. 5.2)"


def test_ablation_flags_select_their_rows():
    assert selected("--m", "0.2") == ({"Tab. 5 BERT_base, m = 0.2": [79.37, 71.70]}, "")
    assert selected("--tau", "0.03") == ({"Tab. 4 BERT_base, tau = 0.03": [74.66]}, "")
    # SimCSE's loss at SimCSE's tau: Tab. 2's rerun (7 tasks) and Tab. 3's SimCSE
    assert selected("--no-modulate", "--tau", "0.05") == (
        {"Tab. 2 SimCSE-BERT_base": [75.68], "Tab. 3 SimCSE": [0.190, -2.400, 76.38]}, "")
    # the same loss at Focal's tau is our control: no row, and the note says which flag
    assert selected("--no-modulate") == ({}, "the paper reports no row for --no-modulate")
    assert selected("--m", "0.15") == ({}, "the paper reports no row for --m 0.15")


def test_other_encoders_select_their_rows_at_tab1_settings_only():
    base = ["--model", "roberta-base", "--batch_size", "512", "--lr", "1e-5", "--tau", "0.05"]
    assert selected(*base)[0] == {"Tab. 2 SimCSE-RoBERTa_base + Focal-InfoNCE": [77.60],
                                  "Tab. 4 RoBERTa_base, tau = 0.05": [81.72],
                                  "Tab. 5 RoBERTa_base, m = 0.3": [81.72, 69.52]}
    assert selected(*base, "--no-modulate")[0] == {"Tab. 2 SimCSE-RoBERTa_base": [76.07]}
    assert selected(*base[:-1], "0.07")[0] == {"Tab. 4 RoBERTa_base, tau = 0.07": [81.00]}
    # the hub's organisation prefix names the same model
    assert "Tab. 2 SimCSE-RoBERTa_base + Focal-InfoNCE" in selected("--model", "FacebookAI/roberta-base",
                                                                     *base[2:])[0]
    # roberta-base at BERT-base's batch size and lr: no row, and the note names what differs
    assert selected("--model", "roberta-base") == ({}, "the paper reports no row for --model roberta-base")
    large = ["--model", "bert-large-uncased", "--lr", "1e-5"]
    assert selected(*large)[0] == {"Tab. 2 SimCSE-BERT_large + Focal-InfoNCE": [78.51],
                                   "Tab. 4 BERT_large, tau = 0.07": [80.43]}
    assert selected(*large, "--no-modulate", "--tau", "0.05")[0] == {"Tab. 2 SimCSE-BERT_large": [77.90]}
    rl = ["--model", "roberta-large", "--batch_size", "512", "--lr", "3e-5", "--tau", "0.05"]
    assert selected(*rl)[0] == {"Tab. 2 SimCSE-RoBERTa_large + Focal-InfoNCE": [78.80],
                                "Tab. 4 RoBERTa_large, tau = 0.05": [82.46]}


def test_a_model_the_paper_did_not_train_shows_bert_base_rows_as_a_reference():
    rows, note = selected("--model", "sentence-transformers/all-MiniLM-L6-v2", "--m", "0.2")
    assert rows == {"Tab. 5 BERT_base, m = 0.2 [paper: bert-base-uncased]": [79.37, 71.70]}
    assert note.startswith("sentence-transformers/all-MiniLM-L6-v2 is not a model the paper trained")


def test_every_docstring_command_parses_and_selects_a_row_unless_ours():
    """The commands of the module docstring (the default, a quick CPU run, an ablation, the control
    marked 'ours'): each parses, and selects at least one row of the paper, except the control
    (the note says so). The other rows' commands are on docs/focal_infonce.md (test_readme_rows)."""
    import re
    import shlex
    doc = fi.__doc__.replace("\\\n", " ")
    commands = re.findall(r"^\s*(python focal_infonce\.py[^#\n]*?)\s*(?:#(.*))?$", doc, flags=re.M)
    assert len(commands) >= 3
    for cmd, comment in commands:
        rows, note = selected(*shlex.split(cmd)[2:])
        if comment.strip().startswith("ours"):
            assert rows == {} and note.startswith("the paper reports no row"), cmd
        elif "--model sentence-transformers" in cmd:
            assert note.startswith("sentence-transformers/all-MiniLM-L6-v2 is not a model"), cmd
        else:
            assert rows, (cmd, note)


# -------------------------------------------------------------------------------------
# End to end on CPU: a tiny BERT, a few steps
# -------------------------------------------------------------------------------------

def test_end_to_end_tiny(tmp_path, tiny_bert, corpus, small_sts, cache_dir, capsys):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    run = tmp_path / "run"
    res = fi.main(["--model", str(tiny_bert), "--data", str(corpus), "--sts_dir", str(small_sts),
                   "--output_dir", str(run), "--max_steps", "4", "--eval_every", "2",
                   "--cache_dir", str(cache_dir)])
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in recs if "stsb_dev" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:  # paper Tab. 3: alignment and uniformity at every evaluation
        assert r["alignment"] >= 0 and r["uniformity"] <= 0
    train_recs = [r for r in recs if "loss" in r]
    assert train_recs and all(math.isfinite(r["loss"]) and -1 <= r["s_p"] <= 1 for r in train_recs)
    assert res["test"] is not None and math.isfinite(res["test"]["avg"])
    args = json.loads((run / "args.json").read_text())
    assert (args["tau"], args["m"], args["modulate"]) == (0.07, 0.3, True)

    # the end of the run: the rows its flags select (the default's: batch 64, tau 0.07, m 0.3),
    # labelled as BERT-base's (the tiny encoder is not a model of the paper), printed and stored
    out = capsys.readouterr().out
    labels = [f"{name} [paper: bert-base-uncased]" for name in (
        "Tab. 2 SimCSE-BERT_base + Focal-InfoNCE", "Tab. 3 +Focal InfoNCE", "Tab. 4 BERT_base, tau = 0.07",
        "Tab. 5 BERT_base, m = 0.3")]
    assert f"note: {tiny_bert} is not a model the paper trained" in out
    table = [line for line in out.splitlines() if line.startswith(("this run", "Tab. "))]
    assert [line.split("  ")[0] for line in table] == ["this run", *labels]
    assert table[1].split()[-8:] == ["68.50", "83.70", "79.00", "82.71", "79.43", "78.85", "72.99", "77.33"]
    assert table[4].split()[-8:] == ["-", "-", "-", "-", "-", "79.31", "72.72", "-"]
    test = res["test"]
    au = f"this run {test['alignment']:.3f} / {test['uniformity']:.3f}; {labels[1]}: 0.134 / -1.906"
    assert f"alignment / uniformity on STS-B test (lower is better): {au}" in out
    assert f"({labels[0]}: a mean over seeds (Sec. 5.2))" in out
    stored = json.loads((run / "best" / "test_metrics.json").read_text())
    assert [r["label"] for r in stored["paper_rows"]] == labels
    assert stored["paper_rows"][1]["figures"] == {"alignment": 0.134, "uniformity": -1.906,
                                                  "STSBenchmark": 79.31}
    assert stored["paper_note"].startswith(f"{tiny_bert} is not a model the paper trained")

    best = run / "best"
    enc = AutoModel.from_pretrained(best, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(best)
    ours = common.make_encode(enc, tok, "cls_before_pooler")(["a man is playing a guitar .",
                                                              "the cat sat on the mat ."])
    st = SentenceTransformer(str(best), device="cpu")
    theirs = st.encode(["a man is playing a guitar .", "the cat sat on the mat ."],
                       convert_to_numpy=True)
    np.testing.assert_allclose(theirs, ours, atol=1e-5)
