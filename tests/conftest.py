"""Shared fixtures: the ../shared folder, tiny locally built BERT models, a tiny translation
model, a temporary cache.

Nothing here reaches the Hugging Face hub: tiny models are built from a config and a small
WordPiece vocabulary trained on local text. Under CI (CI=true) a test that needs ../shared
fails instead of skipping when it is missing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def need_shared(*parts: str) -> Path:
    """The path under ../shared; skip when it is missing, but fail under CI."""
    p = SHARED.joinpath(*parts)
    if not p.exists():
        msg = f"{p} is missing (../shared beside the repository)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return p


@pytest.fixture(autouse=True)
def _release_run_folders():
    """A run folder is held (locked) by the process that trains in it until that process ends;
    tests run many trainings in one process, so each test lets its folders go."""
    yield
    import common
    common.release_run_folders()


@pytest.fixture(scope="session")
def shared() -> Path:
    return need_shared()


@pytest.fixture(scope="session")
def sts_dir() -> Path:
    return need_shared("data", "sts")


@pytest.fixture(scope="session")
def wiki_head() -> Path:
    return need_shared("data", "wiki1m_head.txt")


def build_tiny_bert(folder: Path, corpus: list[Path], vocab_size: int = 1000, hidden: int = 32,
                    layers: int = 2, heads: int = 2, seed: int = 0, lowercase: bool = True) -> Path:
    """A tiny BERT (random weights) with a WordPiece vocabulary trained on `corpus`, saved as
    a folder that AutoModel / AutoTokenizer load like a hub model."""
    import torch
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    wp = BertWordPieceTokenizer(lowercase=lowercase)
    wp.train([str(p) for p in corpus], vocab_size=vocab_size, min_frequency=1, show_progress=False)
    wp.save_model(str(folder))
    # The trainer's token set is the same every run, but its ids are not: merges that tie fall in
    # a different order in each process, and the ids move the random embedding rows under every
    # token. Special tokens first, then the rest sorted, gives every session the same model.
    vocab = folder / "vocab.txt"
    words = vocab.read_text(encoding="utf-8").splitlines()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert words[:5] == special, words[:5]
    vocab.write_text("\n".join(special + sorted(words[5:])) + "\n", encoding="utf-8")
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


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory, wiki_head) -> Path:
    """English tiny BERT: d=32, 2 layers, 1000-token vocabulary from wiki1m_head."""
    return build_tiny_bert(tmp_path_factory.mktemp("tiny_bert"), [wiki_head])


@pytest.fixture(scope="session")
def small_sts(sts_dir, tmp_path_factory) -> Path:
    """The first 40 pairs of every STS file in SentEval's layout (SICK keeps its header): an
    evaluation of seconds for end-to-end runs. The evaluator itself is tested on the full data."""
    dst = tmp_path_factory.mktemp("small_sts")
    for src in list(sts_dir.glob("STS/*/STS.*.txt")) + list(sts_dir.glob("STS/STSBenchmark/sts-*.csv")) \
            + list(sts_dir.glob("SICK/SICK_*.txt")):
        keep = 41 if src.parent.name == "SICK" else 40
        out = dst / src.relative_to(sts_dir)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(src.read_text(encoding="utf-8").splitlines()[:keep]) + "\n",
                       encoding="utf-8")
    return dst


@pytest.fixture
def cache_dir(tmp_path) -> Path:
    """Token caches go here, never into ../shared."""
    return tmp_path / "cache"


@pytest.fixture(scope="session")
def parallel(tmp_path_factory):
    """48 English sentences of multi30k and their German translations (a short file too)."""
    m30k = need_shared("data", "multi30k")
    d = tmp_path_factory.mktemp("m30k")
    en = (m30k / "train.en").read_text(encoding="utf-8").splitlines()[:48]
    de = (m30k / "train.de").read_text(encoding="utf-8").splitlines()[:48]
    (d / "en.txt").write_text("\n".join(en) + "\n", encoding="utf-8")
    (d / "de.txt").write_text("\n".join(de) + "\n", encoding="utf-8")
    (d / "de_short.txt").write_text("\n".join(de[:40]) + "\n", encoding="utf-8")
    return d


@pytest.fixture(scope="session")
def tiny_mbert(tmp_path_factory):
    """A tiny 'multilingual' BERT: German + English vocabulary, the same width as tiny_bert."""
    m30k = need_shared("data", "multi30k")
    d = tmp_path_factory.mktemp("mbert_corpus")
    corpus = d / "corpus.txt"
    lines = (m30k / "train.de").read_text(encoding="utf-8").splitlines()[:3000]
    lines += (m30k / "train.en").read_text(encoding="utf-8").splitlines()[:1000]
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return build_tiny_bert(tmp_path_factory.mktemp("tiny_mbert"), [corpus], vocab_size=1200, hidden=32, seed=1)


@pytest.fixture(scope="session")
def tiny_mt(tmp_path_factory, tiny_bert) -> Path:
    """The tiny translation model, for --mt_model DIR (its English tokenizer makes the German
    side English word pieces: nonsense, but real generate() output)."""
    return build_tiny_mt(tmp_path_factory.mktemp("tiny_mt"), tiny_bert)


@pytest.fixture
def one_thread():
    """Translation with a tiny model is all per-step overhead: on a shared CPU, two OpenMP
    threads spin against each other (seconds a batch); one thread keeps the tests quick."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
