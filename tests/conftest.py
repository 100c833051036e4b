"""Fixtures: synthetic data written by the tests themselves, tiny locally built models, and the
real data that a few tests are about.

Nothing here reaches the network. Most tests run on synthetic data made here, the same in every
checkout: an English-like corpus (seeded sentences over a fixed word list), small STS files in
SentEval's layout whose gold scores follow how much of a sentence its partner keeps, NLI-style
triplets, and English beside a word-for-word pseudo-German. Tiny models are built from a config
and a WordPiece vocabulary trained on that corpus.

The few tests about real data (the STS evaluator's pair counts, all-MiniLM-L6-v2 against its
published figures, the real BERT vocabulary) look for it under a data root laid out like the
repository: data/sts/ (`python tools/download.py --what sts`) and models/all-MiniLM-L6-v2/
(`hf download sentence-transformers/all-MiniLM-L6-v2 --local-dir models/all-MiniLM-L6-v2`).
The root is $CSE_DATA_ROOT when set, else the repository root. Where it is missing such a test
is skipped with the command that fetches it; under CI (CI=true) it fails instead.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plumbing import command_line

ROOT = Path(__file__).resolve().parents[1]
DATA_ROOT = Path(os.environ["CSE_DATA_ROOT"]).resolve() if os.environ.get("CSE_DATA_ROOT") else ROOT
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The fault tests send real signals (Ctrl-C, a hangup) to the scripts they start, which must meet
# them as a script started from a terminal does. A suite started in the background (nohup, or
# `cmd &` in a shell script) inherits SIGINT and SIGHUP ignored, every process it starts would
# inherit that, and a script rightly leaves an ignored signal ignored. A handler, unlike an
# ignored signal, does not survive exec: with one here the suite goes on ignoring them, and what
# it starts begins with the default, as from a terminal.
for _signum in (signal.SIGINT, signal.SIGHUP):
    if signal.getsignal(_signum) is signal.SIG_IGN:
        signal.signal(_signum, lambda signum, frame: None)
# torch.compile does nothing in the tests and in the processes they start (PyTorch's own switch):
# on a GPU, compiling each tiny end-to-end run costs 20-60 s, and only the tests marked
# `compiled` are about the compiled step; the fixture below switches it back on for those
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


# ------------------------------------------------------------------------------------
# Real data: where a user keeps it, and the one command that fetches it
# ------------------------------------------------------------------------------------

MINILM = "all-MiniLM-L6-v2"
# what the tests need under the data root -> (what it is, the file that proves it is there)
REAL = {("data", "sts"): ("the STS data", "STS/STSBenchmark/sts-test.csv"),
        ("models", MINILM): (MINILM, "config.json")}


def fetch_command(parts: tuple[str, ...]) -> str:
    """The one command, run from the repository root, that puts `parts` under the data root."""
    here = DATA_ROOT == ROOT
    if parts == ("data", "sts"):
        return "python tools/download.py --what sts" + ("" if here else f" --dest {DATA_ROOT / 'data'}")
    local = "/".join(parts) if here else str(DATA_ROOT.joinpath(*parts))
    return f"hf download sentence-transformers/{MINILM} --local-dir {local}"


def need_real(*parts: str) -> Path:
    """The real data at data root / parts (data/sts, models/all-MiniLM-L6-v2). Missing: the
    test is skipped with the command that fetches it, or fails under CI (CI=true)."""
    what, marker = REAL[parts]
    p = DATA_ROOT.joinpath(*parts)
    if not (p / marker).is_file():
        msg = f"needs {what}: run `{fetch_command(parts)}`"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{msg} ({p} is missing or incomplete; under CI the real data must be "
                        f"there: set CSE_DATA_ROOT to the folder that holds data/ and models/)")
        pytest.skip(msg)
    return p


# ------------------------------------------------------------------------------------
# A loss held to its paper: what a student reads when an edit of a loss fails its test
# ------------------------------------------------------------------------------------

def departs(code: str, equation: str, got, want, reference: str = "the paper's per-row loop") -> str:
    """The failure message of a test that holds `code` to `equation` of its paper: both figures
    (for tensors, their largest difference), and that an edit of the loss on purpose fails it."""
    try:
        if getattr(got, "numel", lambda: 1)() != 1:
            gap = float((got.double() - want.double()).abs().max())
            figures = f"{reference}, largest difference: {gap:.4g}"
        else:
            figures = f"{reference}: {float(want):.6g}, the code: {float(got):.6g}"
    except (RuntimeError, TypeError, ValueError):                   # shapes that do not even match
        figures = f"{reference}: {want!r}, the code: {got!r}"
    return (f"{code} departs from {equation} ({figures}): "
            "if you changed the loss on purpose, this test is expected to fail")


def assert_matches_paper(got, want, code: str, equation: str, *, rel: float | None = None,
                         abs: float | None = None, reference: str = "the paper's per-row loop") -> None:
    """float(got) == pytest.approx(float(want), rel, abs), or fail naming the paper's equation."""
    __tracebackhide__ = True
    assert float(got) == pytest.approx(float(want), rel=rel, abs=abs), departs(code, equation, got, want,
                                                                               reference)


# ------------------------------------------------------------------------------------
# Synthetic text: deterministic (seeded random.Random, md5 for the pseudo-German), the same in
# every checkout and every process
# ------------------------------------------------------------------------------------

DETERMINERS = "the a this that every some no his her their our its each another one".split()
NOUNS = """man woman child boy girl dog cat horse bird fish city river village house road bridge
school teacher student doctor farmer king queen army church market station train car boat ship
island mountain forest garden field door window table book letter song film game team player club
league season company government council party election war battle law court museum library
university college hospital newspaper radio family father mother brother sister friend guitar piano
ball street park beach lake sea sky sun moon winter summer morning night year century history music
language country region province district building tower castle wall painting picture camera
computer machine engine plane airport kitchen meal bread water coffee tea shirt hat shoe snow rain
wind stone tree flower apple chair bed phone story word name group member leader soldier captain
singer writer artist worker officer judge""".split()
VERBS = """plays played walks walked runs ran sees saw builds built writes wrote reads opens opened
closes closed wins won loses lost finds found leaves left joins joined carries carried holds held
visits visited describes described follows followed sells sold buys bought teaches taught paints
painted sings sang watches watched moves moved returns returned becomes became includes included
owns owned crosses crossed cooks cooked rides rode jumps jumped sleeps slept throws threw catches
caught meets met starts started studies studied remembers remembered""".split()
ADJECTIVES = """old new small large big young red blue green white black dark bright quiet loud
famous local national early late first last main major public private ancient modern northern
southern eastern western happy sad strong weak long short high low warm cold heavy light rich poor
simple strange beautiful busy empty open free wild gentle little brown golden wooden royal good
bad""".split()
ADVERBS = """quickly slowly often never always later again together almost also soon already still
today yesterday suddenly finally rarely quietly there""".split()
PREPOSITIONS = """in on at near under over behind beside across through from to with without after
before during into along around between against""".split()
CONJUNCTIONS = ["and", "but", "while", "because", "although", "when", "so", "until", "where"]
ENGLISH = sorted(set(DETERMINERS + NOUNS + VERBS + ADJECTIVES + ADVERBS + PREPOSITIONS + CONJUNCTIONS))


def _pseudo_words(n: int, seed: int, syllables: list[str]) -> list[str]:
    rng, out = random.Random(seed), []
    while len(out) < n:
        w = "".join(rng.choice(syllables) for _ in range(rng.randint(2, 3)))
        if w not in out and w not in ENGLISH:
            out.append(w)
    return out


# names of people and places (capitalised in the text): pseudo-words that give the WordPiece
# trainers more to merge than the word list alone
NAMES = [w.capitalize() for w in _pseudo_words(160, 7, "bar ten mor vik el an dor lis ka ren sto wen "
                                                      "hal mi ro sa tul ber gan no fe rik ol us".split())]


class EnglishLike:
    """English-like sentences: clauses of determiner, adjectives, noun, verb, object, place and
    adverb over the word lists above, joined by conjunctions, 3 to 30 words, capitalised, with
    commas, full stops, question marks, numbers, names and a year in parentheses now and then."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def noun_phrase(self) -> list[str]:
        r = self.rng
        if r.random() < 0.12:
            return [r.choice(NAMES)]
        if r.random() < 0.08:
            return [str(r.randint(2, 1999)), r.choice(NOUNS) + "s"]
        adjs = [r.choice(ADJECTIVES) for _ in range(r.choice([0, 0, 1, 1, 2]))]
        return [r.choice(DETERMINERS), *adjs, r.choice(NOUNS)]

    def clause(self) -> list[str]:
        r = self.rng
        words = self.noun_phrase() + [r.choice(VERBS)]
        if r.random() < 0.7:
            words += self.noun_phrase()
        if r.random() < 0.5:
            words += [r.choice(PREPOSITIONS)] + self.noun_phrase()
        if r.random() < 0.3:
            words.append(r.choice(ADVERBS))
        if r.random() < 0.05:
            words.append(f"({r.randint(1500, 2020)})")
        return words

    def words(self, lo: int = 3, hi: int = 30) -> list[str]:
        """One sentence as words, punctuation attached."""
        r = self.rng
        n = min(hi, max(lo, int(r.triangular(lo, hi, lo + (hi - lo) // 3))))
        words = self.clause()
        while len(words) < n:
            words[-1] += "," if r.random() < 0.5 else ""
            words += [r.choice(CONJUNCTIONS)] + self.clause()
        words = words[:n]
        words[-1] = words[-1].rstrip(",") + r.choices([".", "?", "!", ""], [85, 8, 4, 3])[0]
        words[0] = words[0][:1].upper() + words[0][1:]
        return words

    def sentences(self, n: int, lo: int = 3, hi: int = 30) -> list[str]:
        """n distinct sentences."""
        out, seen = [], set()
        while len(out) < n:
            s = " ".join(self.words(lo, hi))
            if s not in seen:
                seen.add(s)
                out.append(s)
        return out


GERMAN_SYLLABLES = ("sch ei ung ach ver ge ber lich keit heit ün ös äh ß zu wir tz ck au eu ie en er st "
                    "pf kn ü ö ä rm nd ig wal dorf mann berg haus").split()


def pseudo_german_word(word: str) -> str:
    """A fixed pseudo-German word for an English word (md5, not hash(): the same in every
    process); punctuation stays, nouns and names are capitalised, numbers are kept."""
    core = word.strip(".,?!()")
    if not core or core.isdigit():
        return word
    h = hashlib.md5(core.lower().encode()).digest()
    w = "".join(GERMAN_SYLLABLES[b % len(GERMAN_SYLLABLES)] for b in h[:2 + h[15] % 2])
    if core.lower() in NOUNS or core.lower().rstrip("s") in NOUNS or core[:1].isupper():
        w = w[:1].upper() + w[1:]
    return word.replace(core, w, 1)


def pseudo_german(sentence: str) -> str:
    """A word-for-word 'translation' with its own vocabulary."""
    words = [pseudo_german_word(w) for w in sentence.split()]
    return " ".join([words[0][:1].upper() + words[0][1:]] + words[1:])


CORPUS_LINES = 4000     # the synthetic training corpus


def write_corpus(path: Path, n: int = CORPUS_LINES, seed: int = 0) -> Path:
    """The synthetic English-like corpus, one sentence a line."""
    path.write_text("\n".join(EnglishLike(seed).sentences(n)) + "\n", encoding="utf-8")
    return path


def edited(words: list[str], keep: float, rng: random.Random) -> list[str]:
    """A partner of a sentence that keeps each word with probability `keep` (else swaps it for
    another word of the list, or drops it), and is never the sentence itself: identical pairs
    all have cosine 1, a tie that rounding breaks differently from one evaluation to the next."""
    out = []
    for w in words:
        u = rng.random()
        if u < keep:
            out.append(w)
        elif u < keep + (1 - keep) * 0.8:
            out.append(rng.choice(ENGLISH))
    out = out or words[:1]
    while out == words:
        i = rng.randrange(len(out))
        out[i] = rng.choice([w for w in ENGLISH if w != out[i]])
    return out


def overlap(a: list[str], b: list[str]) -> float:
    """Jaccard overlap of the two sentences' lower-cased word sets."""
    sa, sb = ({w.lower().strip(".,?!()") for w in x} for x in (a, b))
    return len(sa & sb) / len(sa | sb)


def sts_pairs(n: int, seed: int, lo: float, hi: float, lengths: tuple[int, int] = (4, 16)):
    """n scored pairs (a, b, gold): a sentence and an edit of it that keeps a random share of
    its words (about one pair in five: an unrelated sentence); gold = lo + (hi - lo) x the word
    overlap, with a little noise, so similar pairs score high and unrelated ones low."""
    gen = EnglishLike(seed)
    rng = random.Random(seed + 1)
    out = []
    for _ in range(n):
        a = gen.words(*lengths)
        b = gen.words(*lengths) if rng.random() < 0.2 else edited(a, rng.random(), rng)
        g = lo + (hi - lo) * overlap(a, b) + rng.gauss(0, 0.05 * (hi - lo))
        out.append((" ".join(a), " ".join(b), min(hi, max(lo, g))))
    return out


def write_sts_tree(root: Path, counts: dict, seed: int = 0, unscored: int = 1,
                   lengths: tuple[int, int] = (4, 16)) -> Path:
    """SentEval's layout under `root`, as common.load_sts_pairs reads it: STS/STS1x-en-test/
    STS.input.<subset>.txt (sentence pairs, tab-separated) beside STS.gs.<subset>.txt (gold 0-5;
    `unscored` empty gold lines a subset, which the evaluator drops, on top of the counts' kept
    pairs), STS/STSBenchmark/sts-<split>.csv (gold in column 4, sentences in 5 and 6, a trailing
    column on some rows) and SICK/SICK_<train|trial|test_annotated>.txt (a header, sentences in
    columns 1 and 2, gold 1-5 in column 3). `counts`: {task: {subset or split: kept pairs}}."""
    k = seed * 1000
    for task in ("STS12", "STS13", "STS14", "STS15", "STS16"):
        folder = root / "STS" / f"STS{task[3:]}-en-test"
        folder.mkdir(parents=True, exist_ok=True)
        for sub, n in counts[task].items():
            k += 1
            pairs = sts_pairs(n + unscored, k, 0.0, 5.0, lengths)
            gone = {(3 + 7 * i + k) % (n + unscored) for i in range(unscored)}
            (folder / f"STS.input.{sub}.txt").write_text("".join(f"{a}\t{b}\n" for a, b, _ in pairs),
                                                         encoding="utf-8")
            (folder / f"STS.gs.{sub}.txt").write_text(
                "".join("\n" if i in gone else f"{g:.3f}\n" for i, (_, _, g) in enumerate(pairs)),
                encoding="utf-8")
    (root / "STS" / "STSBenchmark").mkdir(parents=True, exist_ok=True)
    for split, n in counts["STSBenchmark"].items():
        k += 1
        rows = [f"main-captions\tsynthetic\t2012test\t{i:04d}\t{g:.3f}\t{a}\t{b}"
                + ("\tsrc" if i % 7 == 3 else "")
                for i, (a, b, g) in enumerate(sts_pairs(n, k, 0.0, 5.0, lengths))]
        path = root / "STS" / "STSBenchmark" / f"sts-{split}.csv"
        path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    (root / "SICK").mkdir(parents=True, exist_ok=True)
    names = {"train": "SICK_train.txt", "dev": "SICK_trial.txt", "test": "SICK_test_annotated.txt"}
    for split, n in counts["SICKRelatedness"].items():
        k += 1
        rows = ["pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment"]
        for i, (a, b, g) in enumerate(sts_pairs(n, k, 1.0, 5.0, lengths)):
            judgment = "ENTAILMENT" if g > 4 else "NEUTRAL" if g > 2 else "CONTRADICTION"
            rows.append(f"{i + 1}\t{a}\t{b}\t{g:.1f}\t{judgment}")
        (root / "SICK" / names[split]).write_text("\n".join(rows) + "\n", encoding="utf-8")
    return root


# The kept pair counts of the real STS data (the STS evaluation protocol's table: pairs left
# once those without a gold score are dropped), a subset at a time
STS_KEPT_PAIRS = {
    "STS12": {"MSRpar": 750, "MSRvid": 750, "SMTeuroparl": 459, "surprise.OnWN": 750,
              "surprise.SMTnews": 399},
    "STS13": {"FNWN": 189, "headlines": 750, "OnWN": 561},
    "STS14": {"deft-forum": 450, "deft-news": 300, "headlines": 750, "images": 750, "OnWN": 750,
              "tweet-news": 750},
    "STS15": {"answers-forums": 375, "answers-students": 750, "belief": 375, "headlines": 750, "images": 750},
    "STS16": {"answer-answer": 254, "headlines": 249, "plagiarism": 230, "postediting": 244,
              "question-question": 209},
    "STSBenchmark": {"train": 5749, "dev": 1500, "test": 1379},
    "SICKRelatedness": {"train": 4500, "dev": 500, "test": 4927},
}
STS_TOTALS = {"STS12": 3108, "STS13": 1500, "STS14": 3750, "STS15": 3000, "STS16": 1186}


def write_nli(path: Path, n: int = 600, seed: int = 3) -> Path:
    """SimCSE's supervised CSV (sent0,sent1,hard_neg): a premise, an entailment that keeps most
    of its words and a contradiction that keeps fewer and says "not"; cells with commas are
    quoted, as csv writes them."""
    gen, rng = EnglishLike(seed), random.Random(seed + 1)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["sent0", "sent1", "hard_neg"])
    for premise in gen.sentences(n, 4, 24):
        words = premise.split()
        pos = edited(words, 0.85, rng)
        neg = edited(words, 0.4, rng)
        neg.insert(min(len(neg), 2), "not")
        w.writerow([premise, " ".join(pos), " ".join(neg)])
    path.write_text(buf.getvalue(), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------
# Tiny models, built locally
# ------------------------------------------------------------------------------------

def wordpiece_vocab(corpus: list[Path], size: int, lowercase: bool = True) -> list[str]:
    """A WordPiece vocabulary of `size` pieces (special tokens not included) from `corpus`, the
    same in every process: every character, alone and as ##x, then whole words and the word
    pieces (prefixes, and ##suffixes of 2 to 5 characters), the most frequent first, ties in
    alphabetical order. (The tokenizers library's WordPiece trainer breaks ties at the edge of
    its vocabulary differently from one process to the next: another tiny model each session.)"""
    from collections import Counter

    from tokenizers.normalizers import BertNormalizer
    from tokenizers.pre_tokenizers import BertPreTokenizer
    normalize = BertNormalizer(lowercase=lowercase).normalize_str
    split = BertPreTokenizer().pre_tokenize_str
    words = Counter(w for p in corpus for line in p.read_text(encoding="utf-8").splitlines()
                    for w, _ in split(normalize(line)))
    chars = sorted({c for w in words for c in w})
    pieces = Counter()
    for w, n in words.items():
        pieces[w] += n
        for k in range(2, min(len(w), 6)):
            pieces[w[:k]] += n
            pieces["##" + w[-k:]] += n
    fixed = chars + ["##" + c for c in chars]
    ranked = [t for t, _ in sorted(pieces.items(), key=lambda kv: (-kv[1], kv[0])) if t not in set(fixed)]
    vocab = fixed + ranked[:size - len(fixed)]
    assert len(vocab) == size, f"the corpus gives {len(vocab)} word pieces, not {size}"
    return vocab


def build_tiny_bert(folder: Path, corpus: list[Path], vocab_size: int = 1000, hidden: int = 32,
                    layers: int = 2, heads: int = 2, seed: int = 0, lowercase: bool = True) -> Path:
    """A tiny BERT (random weights) with a WordPiece vocabulary built from `corpus`
    (wordpiece_vocab: the same model in every session), saved as a folder that AutoModel /
    AutoTokenizer load like a hub model."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = wordpiece_vocab(corpus, vocab_size - len(special), lowercase)
    (folder / "vocab.txt").write_text("\n".join(special + sorted(pieces)) + "\n", encoding="utf-8")
    tok = BertTokenizerFast.from_pretrained(str(folder), do_lower_case=lowercase)
    # transformers 5 can silently fall back to a 5-token vocabulary: check the size
    assert len(tok) == vocab_size, f"tiny tokenizer has {len(tok)} tokens, expected {vocab_size}"
    tok.save_pretrained(str(folder))
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=heads, intermediate_size=2 * hidden,
                     max_position_embeddings=256)
    BertModel(cfg).save_pretrained(str(folder))
    return folder


def build_tiny_roberta(folder: Path, corpus: list[Path], vocab_size: int = 800, hidden: int = 32,
                       seed: int = 0) -> Path:
    """A tiny RoBERTa (byte-level BPE trained on `corpus`, random weights) saved as a folder."""
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import RobertaConfig, RobertaModel, RobertaTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train([str(p) for p in corpus], vocab_size=vocab_size, min_frequency=2, show_progress=False,
              special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    bpe.save_model(str(folder))
    tok = RobertaTokenizerFast.from_pretrained(str(folder))
    assert len(tok) == vocab_size, f"tiny tokenizer has {len(tok)} tokens, expected {vocab_size}"
    tok.save_pretrained(str(folder))
    torch.manual_seed(seed)
    cfg = RobertaConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=2 * hidden,
                        max_position_embeddings=258, pad_token_id=tok.pad_token_id, type_vocab_size=1)
    RobertaModel(cfg).save_pretrained(str(folder))
    return folder


def build_tiny_mt(folder: Path, tokenizer_folder: Path, seed: int = 0) -> Path:
    """A tiny seq2seq model (BART, d=16, one layer each side, random weights) with the tokenizer
    of `tokenizer_folder`, saved as a folder that AutoModelForSeq2SeqLM loads: a stand-in for
    t5-base. Its greedy output is deterministic nonsense of 2 to about 40 tokens that differs
    from sentence to sentence (weights of std 1, not 0.02, and a bias towards the end token, so
    that it stops early at a place that depends on the input; at least 2 tokens: never empty)."""
    import torch
    from transformers import AutoTokenizer, BartConfig, BartForConditionalGeneration

    folder.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_folder))
    torch.manual_seed(seed)
    cfg = BartConfig(vocab_size=len(tok), d_model=16, encoder_layers=1, decoder_layers=1,
                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                     decoder_ffn_dim=32, max_position_embeddings=300, pad_token_id=tok.pad_token_id,
                     bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id,
                     decoder_start_token_id=tok.cls_token_id, forced_eos_token_id=None, init_std=1.0)
    model = BartForConditionalGeneration(cfg)
    with torch.no_grad():
        model.final_logits_bias[0, tok.sep_token_id] = 10.0
    model.generation_config.min_new_tokens = 2
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


def build_bert_layout_tokenizer(folder: Path, corpus: list[Path], vocab_size: int = 1000) -> Path:
    """A cased WordPiece tokenizer built from `corpus` (wordpiece_vocab) whose vocabulary is laid
    out as BERT's vocab.txt is ([PAD] 0, [unused0..98], [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103,
    then the word pieces), saved as a folder (no model)."""
    from transformers import BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    pieces = sorted(wordpiece_vocab(corpus, vocab_size - 5, lowercase=False))
    vocab = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"] + pieces
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    tok = BertTokenizerFast.from_pretrained(str(folder), do_lower_case=False)
    assert len(tok) == len(vocab) and (tok.pad_token_id, tok.cls_token_id, tok.sep_token_id) == (0, 101, 102)
    tok.save_pretrained(str(folder))
    return folder


# ------------------------------------------------------------------------------------
# Fixtures
# ------------------------------------------------------------------------------------

def pytest_configure(config):
    config.addinivalue_line("markers", "compiled: a test about the compiled step; torch.compile is on")


@pytest.fixture(autouse=True)
def _compile_only_where_marked(request, monkeypatch):
    if request.node.get_closest_marker("compiled"):
        monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)


def cpu_env(**extra: str) -> dict[str, str]:
    """The environment of a process that must run on the CPU (gloo DDP, a CPU profile) on a
    machine with a GPU too: no GPU visible to it."""
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", **extra)


@pytest.fixture
def on_cpu(monkeypatch):
    """A test about the CPU path, run in this process: the scripts see no GPU."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(autouse=True)
def _release_run_folders():
    """A run folder is held (locked) by the process that trains in it until that process ends;
    tests run many trainings in one process, so each test lets its folders go."""
    yield
    command_line.let_go()


@pytest.fixture(scope="session")
def real_sts() -> Path:
    """The real STS data (SentEval's STS12-16, STS-B, SICK), for the tests about it."""
    return need_real("data", "sts")


@pytest.fixture(scope="session")
def minilm() -> Path:
    """The real all-MiniLM-L6-v2 (a BERT with the uncased BERT vocabulary)."""
    return need_real("models", MINILM)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """The synthetic English-like training corpus: CORPUS_LINES distinct sentences of 3 to 30
    words, one a line."""
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


@pytest.fixture(scope="session")
def nli_csv(tmp_path_factory) -> Path:
    """600 synthetic triplets in SimCSE's sent0,sent1,hard_neg format."""
    return write_nli(tmp_path_factory.mktemp("nli") / "nli.csv")


@pytest.fixture(scope="session")
def small_sts(tmp_path_factory) -> Path:
    """A synthetic STS folder in SentEval's layout, 40 kept pairs a file (every STS12-16 subset
    with one more, unscored, pair): an evaluation of seconds that gives finite, varied
    Spearman figures."""
    import common
    counts = {**{t: {sub: 40 for sub in subs} for t, subs in common.STS_SUBSETS.items()},
              "STSBenchmark": {s: 40 for s in ("train", "dev", "test")},
              "SICKRelatedness": {s: 40 for s in ("train", "dev", "test")}}
    root = write_sts_tree(tmp_path_factory.mktemp("small_sts"), counts)
    # what the tests rely on: the unscored pair is in the file and dropped, the gold is varied
    gs = (root / "STS" / "STS12-en-test" / "STS.gs.MSRpar.txt").read_text(encoding="utf-8").splitlines()
    assert len(gs) == 41 and gs.count("") == 1
    for task in common.STS_TASKS:
        for split in ("test", "dev") if task in ("STSBenchmark", "SICKRelatedness") else ("test",):
            for _, _, gold in common.load_sts_pairs(root, task, split).values():
                assert len(gold) == 40 and len(set(gold)) > 10, (task, split)
    return root


@pytest.fixture(scope="session")
def full_sts(tmp_path_factory) -> Path:
    """A synthetic STS folder with the real data's files and kept pair counts (STS_KEPT_PAIRS),
    short sentences, two unscored pairs in every STS12-16 subset: what a whole download holds."""
    return write_sts_tree(tmp_path_factory.mktemp("full_sts"), STS_KEPT_PAIRS, seed=1, unscored=2,
                          lengths=(3, 8))


@pytest.fixture(scope="session")
def data(tmp_path_factory, corpus) -> Path:
    """300 sentences of the synthetic corpus: the fault and record tests' runs."""
    p = tmp_path_factory.mktemp("data") / "sentences.txt"
    p.write_text("\n".join(corpus.read_text(encoding="utf-8").splitlines()[:300]) + "\n", encoding="utf-8")
    return p


class Shell:
    """Unpickling this runs a shell command: what a file from an untrusted source may carry."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory, corpus) -> Path:
    """English tiny BERT: d=32, 2 layers, 1000-token vocabulary from the synthetic corpus."""
    return build_tiny_bert(tmp_path_factory.mktemp("tiny_bert"), [corpus])


@pytest.fixture
def cache_dir(tmp_path) -> Path:
    """Token caches go here, never beside the data."""
    return tmp_path / "cache"


@pytest.fixture(scope="session")
def parallel(tmp_path_factory):
    """48 English sentences and their pseudo-German (pseudo_german: word for word, its own
    vocabulary), en.txt and de.txt, and de_short.txt with the first 40 German lines."""
    d = tmp_path_factory.mktemp("parallel")
    en = EnglishLike(5).sentences(48, 4, 20)
    de = [pseudo_german(s) for s in en]
    (d / "en.txt").write_text("\n".join(en) + "\n", encoding="utf-8")
    (d / "de.txt").write_text("\n".join(de) + "\n", encoding="utf-8")
    (d / "de_short.txt").write_text("\n".join(de[:40]) + "\n", encoding="utf-8")
    return d


@pytest.fixture(scope="session")
def tiny_mbert(tmp_path_factory, corpus):
    """A tiny 'multilingual' BERT: pseudo-German + English vocabulary, the same width as tiny_bert."""
    d = tmp_path_factory.mktemp("mbert_corpus")
    english = corpus.read_text(encoding="utf-8").splitlines()
    lines = [pseudo_german(s) for s in english[:3000]] + english[:1000]
    (d / "corpus.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return build_tiny_bert(tmp_path_factory.mktemp("tiny_mbert"), [d / "corpus.txt"], vocab_size=1200,
                           hidden=32, seed=1)


@pytest.fixture(scope="session")
def tiny_mt(tmp_path_factory, tiny_bert) -> Path:
    """The tiny translation model, for --mt_model DIR (its English tokenizer makes the German
    side English word pieces: nonsense, but real generate() output)."""
    return build_tiny_mt(tmp_path_factory.mktemp("tiny_mt"), tiny_bert)


@pytest.fixture(scope="session")
def bert_layout_tokenizer(tmp_path_factory, corpus) -> Path:
    """A second local BERT tokenizer, cased, with BERT's id layout ([PAD] 0, [UNK] 100, [CLS] 101,
    [SEP] 102, [MASK] 103): a folder AutoTokenizer loads like a hub model's."""
    return build_bert_layout_tokenizer(tmp_path_factory.mktemp("bert_layout"), [corpus])


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the rest of the module that asks for it: a tiny model is all
    per-step overhead, and on a shared CPU two OpenMP threads spin against each other (seconds a
    batch); runs compared record for record (a resumed run and its reference) compute alike."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def run_base(tmp_path, parallel, *extra):
    """The flags of an IFCL or translation command on the parallel files, with a model and an STS
    folder that do not exist (for the checks that stop a command before it loads them)."""
    return ["--model", str(tmp_path / "no-such-model"), "--data", str(parallel / "en.txt"),
            "--output_dir", str(tmp_path / "run"), "--cache_dir", str(tmp_path / "c"),
            "--sts_dir", str(tmp_path / "no-sts"), *extra]


# ------------------------------------------------------------------------------------
# The scripts as a user runs them, and one held still mid-run: the fault tests' one helper
# ------------------------------------------------------------------------------------

# the environment of a script the tests start: offline, one OpenMP thread (its steps then equal
# an in-process reference's, and busy shared cores do not make a tiny model's step crawl)
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
           OMP_NUM_THREADS="1")

# `python -c HELD ROOT FOLDER AT SCRIPT ARGV...`: SCRIPT run as `python SCRIPT ARGV` runs it, after
# FOLDER/before.py if there is one (a fault put in place); before its AT-th training step (0: none)
# FOLDER/held is written and FOLDER/at_hold.py run if there is one, else the step waits (10 minutes
# at most) for FOLDER/go; when run_main has ended the command, FOLDER/ended holds its exit status,
# and with FOLDER/linger the process stays alive until FOLDER/exit is there.
HELD = """
import os, runpy, sys, time
from pathlib import Path
root, here, at, script = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
sys.path.insert(0, root)

def wait_for(name):
    t0 = time.time()
    while not (here / name).exists() and time.time() - t0 < 600:
        time.sleep(0.05)

if (here / "before.py").exists():
    exec((here / "before.py").read_text(), {})
import common
real, calls = common.train_step, [0]
def held(*a, **k):
    calls[0] += 1
    if calls[0] == at:
        (here / "held").write_text(str(os.getpid()))
        if (here / "at_hold.py").exists():
            exec((here / "at_hold.py").read_text(), {})
        else:
            wait_for("go")
    return real(*a, **k)
common.train_step = held
sys.argv = [script, *sys.argv[5:]]
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as e:
    (here / "ended").write_text(str(e.code))
    if (here / "linger").exists():
        wait_for("exit")
    raise
"""


class Held:
    """A script (`script`, a path under the repository) run in a process of its own as a user runs
    it, held still before its `at`-th training step (after the checkpoints before it), however slow
    the machine: a run surely alive while a test stops it, starts a second one, or pulls a file
    away. `before` and `at_hold`: code the process runs first, and at the hold instead of waiting."""

    def __init__(self, folder: Path, script: str, argv: list[str], at: int = 3, before: str = "",
                 at_hold: str = "", linger: bool = False):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in (("before.py", before), ("at_hold.py", at_hold), ("linger", "-" * linger)):
            if text:
                (folder / name).write_text(text)
        self.proc = subprocess.Popen([sys.executable, "-c", HELD, str(ROOT), str(folder), str(at),
                                      str(ROOT / script), *argv], env=ENV, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)

    def wait(self, name: str = "held", timeout: float = 300) -> str:
        """Until the process writes FOLDER/name (held, ended), alive until then; its content."""
        t0 = time.time()
        while not (self.folder / name).exists():
            assert self.proc.poll() is None, f"ended ({self.proc.returncode}) before {name}: " \
                                             f"{self.proc.stderr.read()[-3000:]}"
            assert time.time() - t0 < timeout, f"no {name} in {timeout} s"
            time.sleep(0.05)
        return (self.folder / name).read_text()

    def go(self, name: str = "go") -> None:
        (self.folder / name).write_text("")

    def end(self, timeout: float = 300) -> subprocess.CompletedProcess:
        """The process's end: its exit status and stderr."""
        err = self.proc.communicate(timeout=timeout)[1]
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, "", err)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


def script(name: str, argv: list[str], **kw) -> subprocess.CompletedProcess:
    """`python <name> ARGV` (a path under the repository), as a user runs it."""
    return subprocess.run([sys.executable, str(ROOT / name), *argv], env=ENV, capture_output=True,
                          text=True, timeout=600, **kw)
