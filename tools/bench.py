r"""A method's training step, timed as train() runs it, beside the plain fp32 eager step.

    python tools/bench.py --method simcse --config bert-base-uncased --batch_size 64 --max_len 32 \
        --steps 300 --sts_dir data/sts --tokenizer bert-base-uncased --profile trace.json

The encoder has random weights (a step costs the same as with real ones), built from a known
architecture or a config.json, always in fp32 (bf16 comes from autocast on a GPU, as in
training). The whole step is timed: forward, backward, clipping, AdamW, the schedule and the
batch's copy to the device. On a GPU the project's step is bf16, SDPA attention, fused AdamW,
compiled and replayed from CUDA graphs; the baseline is the official SimCSE code's without
--fp16: fp32, eager attention, for-loop AdamW, nothing compiled. MFU counts 3 x the forward
FLOPs (2 x weights + attention) of every token the method encodes in a step.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python tools/bench.py` from anywhere
import common  # noqa: E402
from common import UserError, arg  # noqa: E402
from plumbing import inputs  # noqa: E402
from plumbing.compiled_step import CompiledModel  # noqa: E402
from plumbing.inputs import check_sts_dir  # noqa: E402

ARCHS = {  # standard architectures, so that no hub access is needed to build a random model
    "bert-base-uncased": dict(model_type="bert", vocab_size=30522, hidden_size=768, num_hidden_layers=12,
                              num_attention_heads=12, intermediate_size=3072),
    "bert-large-uncased": dict(model_type="bert", vocab_size=30522, hidden_size=1024, num_hidden_layers=24,
                               num_attention_heads=16, intermediate_size=4096),
    "roberta-base": dict(model_type="roberta", vocab_size=50265, hidden_size=768, num_hidden_layers=12,
                         num_attention_heads=12, intermediate_size=3072, max_position_embeddings=514,
                         pad_token_id=1, type_vocab_size=1),
    "roberta-large": dict(model_type="roberta", vocab_size=50265, hidden_size=1024, num_hidden_layers=24,
                          num_attention_heads=16, intermediate_size=4096, max_position_embeddings=514,
                          pad_token_id=1, type_vocab_size=1),
    "tiny": dict(model_type="bert", vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                 num_attention_heads=2, intermediate_size=128),
}
H100_BF16_PEAK = 989e12  # dense bf16 FLOP/s of an H100 SXM: the denominator of the MFU column
METHODS = ["simcse", "focal_infonce", "ifcl", "conisi", "rcl"]


@dataclass
class Args:
    method: str = arg("simcse", "whose training step: the script's model with its default "
                      "hyperparameters (rcl: an entropy model of stage 1)", choices=METHODS)
    config: str = arg("bert-base-uncased", f"architecture ({', '.join(ARCHS)}) or a config.json path "
                      "(or its folder); weights are random")
    batch_size: int = arg(64, "sentences per step", "SimCSE paper App. A", ge=1)
    max_len: int = arg(32, "tokens per sentence (every sentence padded to it)", "SimCSE paper App. A", ge=1)
    steps: int = arg(50, "timed steps per variant", ge=1)
    warmup: int = arg(15, "untimed steps first (compilation, CUDA-graph capture)", ge=0)
    baseline: bool = arg(True, "also time the plain fp32 eager step (official SimCSE without --fp16)")
    compile: bool = arg(True, "compile the project's step (CUDA only)")
    sts_dir: str = arg("", "if given, also time one evaluation of the 7 STS tasks")
    tokenizer: str = arg("", "tokenizer folder for the STS timing (bert-base-uncased's vocabulary: "
                         "any uncased BERT tokenizer)")
    seed: int = arg(0, "seed", ge=0)
    profile: str = arg("", "if given, profile 5 more project steps with torch.profiler: print the "
                       "top kernels, the GPU's busy time per step, and write a Chrome trace to this path")


def config_from(name: str):
    """A config by architecture name or path, set to build fp32 weights whatever it says (a
    float16 config, as many hub models ship, would make a model the CPU cannot multiply)."""
    from transformers import AutoConfig
    if name in ARCHS:
        kw = dict(ARCHS[name])
        cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    elif Path(name).is_file() or Path(name, "config.json").is_file():
        cfg = AutoConfig.from_pretrained(name)
    else:
        raise UserError(f"--config {name}: not a known architecture ({', '.join(ARCHS)}) nor a "
                        f"config.json path.")
    cfg.dtype = torch.float32
    return cfg


def forward_flops_per_token(config, seq_len: int) -> float:
    """2 x non-embedding weights + 4 x layers x seq_len x hidden: the usual estimate of a
    transformer's forward FLOPs per token (a backward costs twice a forward)."""
    from transformers import AutoModel
    with torch.device("meta"):
        m = AutoModel.from_config(config)
    # the pooler reads one token a sentence, so it is left out with the embeddings
    non_emb = sum(p.numel() for n, p in m.named_parameters() if "embeddings" not in n and "pooler" not in n)
    return 2 * non_emb + 4 * config.num_hidden_layers * seq_len * config.hidden_size


def build(method: str, encoder: nn.Module, cfg, args: Args) -> tuple[nn.Module, list[str], list[tuple]]:
    """(the method's model over `encoder`, its data columns, what the encoder reads per step as
    (sentences, length) in units of (--batch_size, --max_len))."""
    if method == "simcse":
        import simcse
        return simcse.SimCSE(encoder, 0.05, supervised=False), ["text"], [(2, 1)]
    if method == "focal_infonce":
        import focal_infonce
        return focal_infonce.FocalInfoNCE(encoder, 0.07, 0.3, True), ["text"], [(2, 1)]
    if method == "rcl":
        import rcl
        return rcl.EntropyModel(encoder, "avg", 0.01, 0.05), ["text"], [(2, 1)]
    if method == "ifcl":
        from transformers import AutoModel

        import ifcl
        bel_f = AutoModel.from_config(cfg).embeddings          # a frozen embedding layer of the same width
        return ifcl.IFCL(encoder, bel_f, ifcl.Args(batch_size=args.batch_size, max_len=args.max_len), 0, 0), \
            ["text", "frat"], [(3, 1)]
    import conisi  # [CLS] a [SEP] b [SEP] with BERT's ids: a random model needs no tokenizer
    tpl = conisi.PairTemplate(1, 1, (101,), (102,), (102,), (0,), (0,), (1,), 0, 1, 0, True)
    return conisi.ConIsI(encoder, tpl, 0.05, 0.8, "s", [0, 100, 101, 102, 103], cfg.vocab_size), \
        ["text"], [(1, 1), (2, 2)]


def time_step(step: Callable, batches: Callable[[int], dict], steps: int, warmup: int,
              device: torch.device) -> tuple[float, float, float]:
    """(ms a step, seconds of warm-up, last loss) of `steps` timed calls after `warmup` untimed
    ones; batches(i) makes batch i, its copy to the device inside the timed step."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync()
    t0 = warm = time.perf_counter()
    for i in range(steps + warmup):
        if i == warmup:
            sync()
            warm, t0 = time.perf_counter() - t0, time.perf_counter()
        loss, _ = step(batches(i))
    sync()
    return (time.perf_counter() - t0) / steps * 1e3, warm, float(loss)


def profile_steps(step: Callable, batches: list, device: torch.device, trace: str, wall_ms: float) -> None:
    """Where a step's time goes: the top kernels (or CPU ops), and on CUDA how much of the
    measured wall time per step the GPU is busy (far below it: the step waits on Python)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for b in batches:
            step(b)
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    print(events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=15))
    if cuda:   # kernels and copies, not the ranges around them
        busy_us = sum(e.self_device_time_total for e in events
                      if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation)
        print(f"GPU busy {busy_us / 1e3 / len(batches):.2f} ms per step of {wall_ms:.2f} ms wall")
    Path(trace).parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(trace)
    print(f"Chrome trace (open in chrome://tracing or ui.perfetto.dev): {trace}")


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModel
    args = common.parse_args(Args, argv, description=__doc__, prog="python tools/bench.py")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = config_from(args.config)
    tokenizer = args.tokenizer or (args.config if Path(args.config).is_dir() else "")
    if args.sts_dir:        # the STS timing's data and tokenizer, checked before minutes of timing
        check_sts_dir(args.sts_dir)
        if tokenizer:
            inputs.where_from(tokenizer, "--tokenizer")
    n = args.batch_size * (args.steps + args.warmup)
    rng = np.random.default_rng(args.seed)
    _, columns, reads = build(args.method, AutoModel.from_config(cfg), cfg, args)   # to learn the columns
    low = 1000 if cfg.vocab_size > 2000 else 5                  # above the special tokens
    data = {c: common.Tokens(rng.integers(low, cfg.vocab_size, size=(n, args.max_len)).astype(np.int32),
                             np.full(n, args.max_len, np.int32), 0)
            for c in columns}
    plan = common.batch_plan(n, args.batch_size, args.seed, 0)
    flops = 3 * sum(k * args.batch_size * m * args.max_len * forward_flops_per_token(cfg, m * args.max_len)
                    for k, m in reads)
    print(f"{args.method} on {args.config}: batch {args.batch_size}, max_len {args.max_len}, "
          f"{flops / 1e12:.2f} TFLOP/step (3 x forward), device "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")

    def run(name: str, fast: bool) -> float:
        torch.manual_seed(args.seed)
        encoder = AutoModel.from_config(cfg, attn_implementation="sdpa" if fast else "eager")
        model = build(args.method, encoder, cfg, args)[0].to(device).train()
        params = [p for p in model.parameters() if p.requires_grad]
        total = args.steps + args.warmup
        # the baseline's AdamW is the plain, unfused one (a CPU device asks for that)
        opt, sched = common.make_optimizer(params, 3e-5, 0.0, total, device if fast else torch.device("cpu"))
        compiled = fast and args.compile and device.type == "cuda"
        forward = CompiledModel(model, device) if compiled else model

        def step(batch):   # the step as train() takes it
            return common.train_step(forward, batch, opt, sched, 1.0, device, amp=fast)
        ms, warm, loss = time_step(step, lambda i: common.device_batch(data, plan[i], args.max_len, device),
                                   args.steps, args.warmup, device)
        mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        print(f"{name:28s} {ms:8.2f} ms/step  {args.batch_size / ms * 1e3:9.0f} sent/s  "
              f"MFU {flops / (ms / 1e3) / H100_BF16_PEAK * 100:5.1f}%  peak {mem:5.2f} GiB  "
              f"(warm-up {warm:.1f}s, last loss {loss:.3f})")
        if fast and args.profile:
            profile_steps(step, [common.device_batch(data, plan[i % len(plan)], args.max_len, device)
                                 for i in range(5)], device, args.profile, ms)
        return ms

    fast_ms = run("project step" + (" (bf16, compiled)" if device.type == "cuda" else ""), True)
    if args.baseline:
        plain_ms = run("plain fp32 eager step", False)
        print(f"speed-up over the plain fp32 eager step: {plain_ms / fast_ms:.2f}x")
    print(f"one epoch of 1M sentences at this speed: {1e6 / args.batch_size * fast_ms / 1e3 / 60:.1f} min "
          f"of training time")
    if args.sts_dir:
        if not tokenizer:
            print("(STS timing needs a tokenizer: pass --tokenizer)")
            return
        from transformers import AutoTokenizer
        enc = AutoModel.from_config(cfg, attn_implementation="sdpa").to(device)
        t = time.perf_counter()
        common.evaluate_sts(common.make_encode(enc, AutoTokenizer.from_pretrained(tokenizer),
                                               "cls_before_pooler"), args.sts_dir)
        print(f"7 STS tasks evaluated in {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    common.run_main(main)
