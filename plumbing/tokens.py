"""The training text as token ids: tokenised once, before training, into one compact integer array
(Tokens), kept in a cache for the next run on the same text (plumbing/inputs.py's token_cache), from
which each step's batch is cut (Tokens.batch).

The rules, and the function that keeps each:
1. Tokenised once (tokenize): a million sentences tokenised at every step would cost the step its time;
   kept as uint16 (int32 for a vocabulary past 65,536), so that wiki1m's ids fit in memory beside the
   model.
2. One huge line costs no more memory than a long one (clip): a line is cut to CHARS_PER_TOKEN
   characters a token the model keeps before it is tokenised. What is kept is the same unless a line's
   tokens average more than that many characters.
3. The ids are the tokenizer's (token_ids): the Rust tokenizer called directly, with the truncation a
   call of the tokenizer would make, and no padding (each batch pads to its own longest sentence).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from plumbing.inputs import load_tokens, save_tokens, token_cache
from plumbing.progress import progress

CHARS_PER_TOKEN = 64


@dataclass
class Tokens:
    """Token ids of n sentences, right-padded to max_len in one compact integer array."""
    ids: np.ndarray      # (n, max_len) uint16 or int32
    lengths: np.ndarray  # (n,) int32, tokens per sentence (specials included)
    pad_id: int

    def __len__(self) -> int:
        return len(self.lengths)

    def batch(self, idx: np.ndarray, pad_to: int | None = None) -> dict[str, torch.Tensor]:
        """input_ids and attention_mask of rows `idx`, padded to the longest or to `pad_to`."""
        width = pad_to or int(self.lengths[idx].max())
        ids = torch.from_numpy(self.ids[idx, :width].astype(np.int64))      # (B, L)
        mask = torch.arange(width)[None, :] < torch.from_numpy(self.lengths[idx].astype(np.int64))[:, None]
        return {"input_ids": ids, "attention_mask": mask.long()}           # (B, L), (B, L)


def clip(texts: list[str], tokens: int) -> list[str]:
    """Rule 2: each text cut to CHARS_PER_TOKEN characters a token the model keeps."""
    return [t[:CHARS_PER_TOKEN * tokens] for t in texts]


def token_ids(tokenizer, max_len: int) -> Callable[[list[str]], list]:
    """encode_batch(texts) -> encodings (.ids), cut at max_len, unpadded: the Rust tokenizer (a copy)
    directly, on both cores, without the offsets and dicts that cost a third of the time at 1M lines."""
    backend = copy.deepcopy(tokenizer.backend_tokenizer)
    backend.enable_truncation(max_len)
    backend.no_padding()
    return getattr(backend, "encode_batch_fast", backend.encode_batch)


def tokenize(tokenizer, texts: list[str], max_len: int, cache_dir: str | Path | None = None,
             desc: str = "tokenizing") -> Tokens:
    """Tokenise once, before training, into a (n, max_len) array, kept in `cache_dir` for the
    next run on the same texts and tokenizer."""
    cache = token_cache(tokenizer, texts, max_len, cache_dir)
    if (kept := load_tokens(cache)) is not None:
        return Tokens(*kept)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = np.full((len(texts), max_len), pad_id, dtype=np.uint16 if len(tokenizer) < 65536 else np.int32)
    lengths = np.zeros(len(texts), dtype=np.int32)
    encode_batch = token_ids(tokenizer, max_len)
    with progress(total=len(texts), desc=desc, unit="sent", disable=len(texts) < 50000) as bar:
        for s in range(0, len(texts), 20000):
            for j, e in enumerate(encode_batch(clip(texts[s:s + 20000], max_len)), start=s):
                ids[j, :len(e.ids)], lengths[j] = e.ids, len(e.ids)
            bar.update(min(20000, len(texts) - s))
    save_tokens(cache, ids, lengths, pad_id)
    return Tokens(ids, lengths, pad_id)
