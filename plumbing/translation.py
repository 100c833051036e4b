"""IFCL's German file: --data translated, one line a sentence, with any Hugging Face seq2seq model.

    python tools/translate.py --data data/wiki1m_for_simcse.txt       # t5-base, the paper's T5
    python tools/translate.py --data data/wiki1m_for_simcse.txt --mt_model Helsinki-NLP/opus-mt-en-de

Without --out: <data>.de.<mt_model>.txt beside --data (or under --cache_dir), made by `python ifcl.py` too
on its first run (under torchrun, this command makes it first). Batched by length, bf16 on CUDA, the batch
halved when out of GPU memory; resumable (<out>.part, described by <out>.part.json); <out> appears only
when every line is done.

The rules, and the function that keeps each:
1. A translation killed after hours goes on where it was (translate_file): the lines done are kept in
   <out>.part, synced a chunk at a time, and a chunk a kill cut is translated again whole (the same
   batches, so the same lines); <out>.part.json holds the input and settings it may go on with.
2. The German file is line for line the English one (translate_file): an empty translation keeps its
   English line, and a file of another length is refused, so that x and x^- stay pairs.
3. Everything the file needs is checked before ifcl.py writes anything (fraternal_file). Under torchrun
   a file still to make is refused, with this command: every rank would translate at once, and a
   barrier times out long before a million sentences are done. NOTE(ours): an earlier version had
   rank 0 translate while the others polled for its file, machinery for one command typed once.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from plumbing import downloads, inputs
from plumbing.atomic_writes import write_text_atomic
from plumbing.errors import UserError
from plumbing.flags import arg, parse_args
from plumbing.progress import progress


@dataclass
class TranslateArgs:
    data: str = arg(downloads.in_data(downloads.WIKI1M), "English sentences, one a line")
    out: str = arg("", "where the German lines go (written as <out>.part until complete); left "
                   "out: where `python ifcl.py` looks for them, <data>.de.<mt_model>.txt")
    cache_dir: str = arg("", "with --out left out: put the file here, not beside --data")
    mt_model: str = arg("t5-base", "any Hugging Face seq2seq model (T5: the paper; the size is ours; "
                        "Helsinki-NLP/opus-mt-en-de also works)", "paper Sec. 4.1")
    prefix: str = arg("auto", "text put before each sentence; auto = T5's 'translate English to "
                      "German: ' for T5 models, nothing otherwise", "ours")
    batch_size: int = arg(0, "sentences per generate() call, halved whenever the GPU runs out of "
                          "memory; 0 = 1024 on CUDA, 64 on the CPU", ge=0)
    chunk_size: int = arg(16384, "sentences sorted by length together and appended to the file "
                          "together (a kill loses at most one chunk's work)", ge=1)
    max_source_len: int = arg(256, "source tokens kept per sentence", ge=1)
    max_new_tokens: int = arg(128, "generated tokens per sentence at most", ge=1)
    num_beams: int = arg(1, "beam size (1 = greedy: a million sentences is a lot of beams)", ge=1)


def default_fraternal_path(data: str, mt_model: str, cache_dir: str = "") -> Path:
    """Where the German file made from --data by --mt_model lives: <data>.de.<model>.txt beside --data,
    or under --cache_dir when given or when --data's folder is not writable; <model>: a hub name with '/'
    as '--', or a folder's name and a hash of its path (NOTE(ours): two folders called 'mt' never mix)."""
    mt = Path(mt_model).expanduser().resolve()
    model = f"{mt.name}-{hashlib.sha256(str(mt).encode()).hexdigest()[:8]}" if mt.is_dir() else mt_model
    slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in model.replace("/", "--"))
    name = f"{Path(data).with_suffix('').name}.de.{slug}.txt"
    folder = Path(data).resolve().parent     # data/ before its first download: the folder it will be in
    if cache_dir or not os.access(next(p for p in [folder, *folder.parents] if p.exists()), os.W_OK):
        return inputs.default_cache_dir(data, cache_dir) / name
    return folder / name


ELSEWHERE = (" Translating --data needs it once (the German file is kept and reused); the file can be "
             "made on another machine: `python tools/translate.py --data DATA --out FILE`, then "
             "--fraternal_data FILE.")


def load_mt_model(name: str, device: torch.device | None = None):
    """(tokenizer, model) for translation, bf16 weights on CUDA, fp32 on the CPU; with no device, only
    a check before anything is written: the config loads and is a seq2seq one (the weights, possibly a
    download of a gigabyte, are loaded by the rank that translates).
    NOTE(ours): bf16, not fp16: T5 overflows in fp16, and bf16 is what T5 was trained in."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES as SEQ2SEQ
    inputs.where_from(name, "--mt_model", ELSEWHERE)
    try:
        if (kind := AutoConfig.from_pretrained(name).model_type) not in SEQ2SEQ:
            raise ValueError(f"its model type '{kind}' is not a sequence-to-sequence model")
        if device is None:
            return None
        tok = AutoTokenizer.from_pretrained(name)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        return tok, AutoModelForSeq2SeqLM.from_pretrained(name, dtype=dtype).to(device).eval()
    except (OSError, ValueError) as e:
        raise UserError(f"--mt_model {name}: could not load it as a seq2seq model "
                        f"({str(e).splitlines()[0] if str(e) else type(e).__name__}). Give a hub name with "
                        f"the hub reachable, or a local folder.{ELSEWHERE}")


def translate_chunk(model, tok, texts: list[str], args: TranslateArgs, prefix: str,
                    device: torch.device, batch_size: int, on_batch) -> tuple[list[str], int]:
    """`texts` translated in batches of similar length, in the input's order, and the batch size that
    fitted (halved whenever the GPU runs out of memory); on_batch(k) after each batch of k."""
    # cut to 64 characters a token kept before tokenising, as common.clip: a 50 MB line took 7 GB
    ids = tok([(prefix + t)[:64 * args.max_source_len] for t in texts], truncation=True,
              max_length=args.max_source_len)["input_ids"]
    # longest first (stable: ties keep the input's order), so a batch that does not fit in
    # memory is met at the start of the chunk; similar lengths waste little on padding
    order = sorted(range(len(texts)), key=lambda i: -len(ids[i]))
    out: list[str] = [""] * len(texts)
    i = 0
    while i < len(order):
        rows = order[i:i + batch_size]
        batch = tok.pad({"input_ids": [ids[r] for r in rows]}, return_tensors="pt").to(device)  # (B, L) each
        gen = None
        try:
            with torch.inference_mode():
                gen = model.generate(**batch, num_beams=args.num_beams, do_sample=False,
                                     max_new_tokens=args.max_new_tokens)       # (B, T)
        except torch.cuda.OutOfMemoryError:
            if batch_size == 1:
                raise
        if gen is None:                                 # outside the except: its frames freed
            batch_size //= 2
            torch.cuda.empty_cache()
            print(f"note: out of GPU memory; translating in batches of {batch_size}", file=sys.stderr)
            continue
        for r, t in zip(rows, tok.batch_decode(gen, skip_special_tokens=True)):
            out[r] = " ".join(t.split())                # one line each, whatever it generated
        i += len(rows)
        on_batch(len(rows))
    return out, batch_size


def translate_file(args: TranslateArgs, device: torch.device | None = None) -> Path:
    """--data translated into --out (the module's docstring says how); returns the finished file."""
    src = inputs.read_sentences(args.data, "--data")
    out = Path(args.out) if args.out else default_fraternal_path(args.data, args.mt_model, args.cache_dir)
    part, meta = out.with_name(out.name + ".part"), out.with_name(out.name + ".part.json")
    if out.exists():
        if (k := inputs.count_lines(out)) == len(src):
            print(f"{out}: already complete ({k} lines)", file=sys.stderr)
            return out
        raise UserError(f"--out {out} exists with {k} lines but --data {args.data} has {len(src)} "
                        f"sentences. Delete it or choose another --out.")
    key = {"data_sha256": hashlib.sha256("\n".join(src).encode()).hexdigest(), "lines": len(src),
           "mt_model": args.mt_model, "prefix": args.prefix, "num_beams": args.num_beams,
           "max_new_tokens": args.max_new_tokens, "max_source_len": args.max_source_len}
    done = 0
    if part.exists():
        try:
            old = inputs.read_json_object(meta)
        except ValueError as e:                          # missing or damaged
            old = f"nothing readable ({e})"
        if old != key:
            raise UserError(f"{part} is an unfinished translation of other input or settings "
                            f"({meta} says {old}). Delete both files to start afresh, or rerun "
                            f"with the earlier flags.")
        with open(part, "r+b") as f:
            raw = f.read()
            f.truncate(raw.rfind(b"\n") + 1)            # a line cut by the kill is translated again
        done = raw.count(b"\n")
        print(f"{part}: resuming after {done} of {len(src)} lines", file=sys.stderr)

    if done < len(src):
        device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        tok, model = load_mt_model(args.mt_model, device)  # before anything is written
        if not part.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(meta, json.dumps(key, indent=2))
            open(part, "xb").close()
        # NOTE(ours): the paper says only "T5"; t5-base with T5's own task prefix by default
        t5 = "translate English to German: " if model.config.model_type == "t5" else ""
        prefix = t5 if args.prefix == "auto" else args.prefix
        batch_size = args.batch_size or (1024 if device.type == "cuda" else 64)
        print(f"translating {len(src) - done} sentences of {args.data} into {out}", file=sys.stderr)
        # Chunks start at multiples of --chunk_size, sorted by length inside; the chunk a kill cut is
        # translated again whole (the same batches, so the same lines), and only its new lines appended.
        first = done - done % args.chunk_size
        empty, t0 = 0, time.perf_counter()
        with progress(total=len(src), desc="translating", unit="sent", initial=first) as bar, \
                open(part, "a", encoding="utf-8") as f:
            for c0 in range(first, len(src), args.chunk_size):
                chunk = src[c0:c0 + args.chunk_size]
                lines, batch_size = translate_chunk(model, tok, chunk, args, prefix, device,
                                                    batch_size, bar.update)
                skip = max(0, done - c0)                # lines of this chunk already in <out>.part
                lines, chunk = lines[skip:], chunk[skip:]
                # NOTE(ours): an empty translation keeps the English line, so the files stay
                # parallel line for line (a blank German line would be skipped when read)
                empty += sum(not t for t in lines)
                f.write("".join((t or e) + "\n" for t, e in zip(lines, chunk)))
                f.flush()
                os.fsync(f.fileno())
        secs, new = time.perf_counter() - t0, len(src) - done
        print(f"translated {new} sentences in {secs:.1f} s ({new / max(secs, 1e-9):.1f} sentences/s)",
              file=sys.stderr)
        if empty:
            print(f"note: {empty} of {new} translations came back empty; their English line was "
                  f"kept in their place", file=sys.stderr)
        del model
        torch.cuda.empty_cache()                        # the GPU's memory goes back to training
    if (n_out := inputs.count_lines(part)) != len(src):
        raise UserError(f"{part}: {n_out} lines where {len(src)} were expected (did two runs "
                        f"translate into it at once?); delete it and {meta} and translate again.")
    os.replace(part, out)
    meta.unlink(missing_ok=True)
    print(f"{out}: {len(src)} lines", file=sys.stderr)
    return out


# -------------------------------------------------------------------------------------
# ifcl.py's German file: fraternal_file(args) before common.start, .sentences() after it
# -------------------------------------------------------------------------------------

def translate_command(data: str, out: str | Path, mt_model: str) -> str:
    """The command that makes a German file of `data` on its own, as a user types it."""
    return f"python tools/translate.py --data {data} --out {out} --mt_model {mt_model}"


@dataclass
class FraternalFile:
    """--fraternal_data: a file of the user's, or the one made from --data (`made_here`) on the first
    run; `models` ({flag: (name, one more way out)}): for common.start to find."""
    path: Path
    data: str
    mt_model: str
    made_here: bool
    models: dict[str, tuple[str, str]] = field(default_factory=dict)

    def sentences(self, n: int, device: torch.device) -> list[str]:
        """After common.start: the German lines, made on the first run (translate_file), `n` of them."""
        if not self.path.is_file():
            translate_file(TranslateArgs(data=self.data, out=str(self.path), mt_model=self.mt_model), device)
        return self.read(n)

    def read(self, n: int) -> list[str]:
        """The German lines, `n` of them: a file of another length is refused, saying what to do."""
        de = inputs.read_sentences(self.path, "--fraternal_data")
        if len(de) == n:
            return de
        if self.made_here:
            raise UserError(f"{self.path} (the German file made earlier from a --data of this name with "
                            f"--mt_model {self.mt_model}) has {len(de)} sentences but --data {self.data} "
                            f"has {n}: --data has changed since. Delete {self.path} to translate --data "
                            f"again, or pass a parallel file with --fraternal_data.")
        raise UserError(f"--fraternal_data {self.path} has {len(de)} sentences but --data {self.data} has "
                        f"{n}: the files must be parallel, line by line. Make it again with "
                        f"`{translate_command(self.data, f'{self.path}.new', self.mt_model)}`, or leave "
                        f"--fraternal_data out to have it made on the first run.")


def fraternal_file(args: Any) -> FraternalFile:
    """Rule 4, ifcl.py's one call before common.start: a --fraternal_data left out becomes the file made
    from --data (args.json records it); whether its models can be had, start says (german.models)."""
    # --data first, named as such when missing or unreadable (unless a default that start fetches)
    n = 0 if downloads.fetched_on_first_use(args.data) else len(inputs.read_sentences(args.data))
    made = default_fraternal_path(args.data, args.mt_model, args.cache_dir)
    args.fraternal_data = args.fraternal_data or str(made)     # made on the first run, then reused
    german = FraternalFile(Path(args.fraternal_data), args.data, args.mt_model,
                           made_here=args.fraternal_data == str(made),
                           models={"--fraternal_model": (args.fraternal_model, "")})
    if german.path.is_file():
        if n:                                     # parallel to --data, line by line
            german.read(n)
    elif not german.made_here:
        raise UserError(f"--fraternal_data {german.path}: no such file. Leave the flag out to translate "
                        f"--data with --mt_model {args.mt_model} on the first run, or make the file with "
                        f"`{translate_command(args.data, args.fraternal_data, args.mt_model)}`.")
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:     # rule 3: torchrun sets it before the ranks meet
        raise UserError(f"--fraternal_data {german.path}: not made yet, and under torchrun every process "
                        f"would translate --data at once. Make it first (one GPU does it): "
                        f"`{translate_command(args.data, german.path, args.mt_model)}`, then launch again.")
    else:                                         # the first run: the file will be made
        german.models["--mt_model"] = (args.mt_model, ELSEWHERE)
        if inputs.model_missing(args.mt_model) is None:
            load_mt_model(args.mt_model)                            # its config only
    inputs.check_model_folder(args.fraternal_model, "--fraternal_model")
    return german


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(TranslateArgs, argv, description=__doc__, prog="python tools/translate.py")
    return translate_file(args)
