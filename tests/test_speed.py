"""The fast path and multi-GPU: the compiled step gives the eager losses, DDP gives the
one-process loss and gradients, `python tools/bench.py` runs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import common
import simcse
from conftest import ROOT, cpu_env
from plumbing import compiled_step
from tools import bench


def _tiny_simcse(seed: int = 0, dropout: float = 0.0) -> simcse.SimCSE:
    from transformers import AutoModel
    cfg = bench.config_from("tiny")
    cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = dropout
    torch.manual_seed(seed)
    enc = AutoModel.from_config(cfg, attn_implementation="sdpa")
    return simcse.SimCSE(enc, 0.05, supervised=False)


def _batch(n: int, width: int = 12, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 1000, (n, width), generator=g)
    lengths = torch.randint(3, width + 1, (n,), generator=g)
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    return {"text": {"input_ids": ids * mask, "attention_mask": mask}}


def _step_fn(model, opt, sched, device, max_grad_norm=1.0, world_size=1, compile=False, amp=True):
    """The step as train() takes it: train_step over the model, or over its CompiledModel."""
    device = torch.device(device)
    forward = compiled_step.CompiledModel(model, device, world_size) if compile else model
    return lambda batch: common.train_step(forward, batch, opt, sched, max_grad_norm, device, world_size, amp)


def _losses(compile_, device, steps=4):
    model = _tiny_simcse().to(device)
    params = [p for p in model.parameters()]
    opt, sched = common.make_optimizer(params, 1e-3, 0.0, 10**9, torch.device(device))   # as train() does
    step = _step_fn(model, opt, sched, device, compile=compile_)
    out = []
    for i in range(steps):
        b = {k: {kk: vv.to(device) for kk, vv in v.items()} for k, v in _batch(16, seed=i).items()}
        out.append(float(step(b)[0]))
    return out


@pytest.mark.compiled
def test_compiled_step_gives_the_eager_losses_cpu():
    """The graph-capture path (dynamo + AOT autograd, aot_eager backend on CPU) against eager."""
    eager = _losses(False, "cpu")
    compiled = _losses(True, "cpu")
    assert np.allclose(compiled, eager, rtol=1e-4), (compiled, eager)
    assert eager[-1] < eager[0]     # the steps do train


def test_failed_compilation_falls_back_to_eager(monkeypatch, capsys):
    """A compiler that cannot run on this platform: one note, then the eager step, which
    gives the eager losses (the failed attempt left no gradient behind)."""
    def broken_compile(model, **kw):
        def run(batch):
            model(batch)[0].backward()       # half-done work the fallback must discard
            raise RuntimeError("inductor: no C++ compiler found\nmore detail")
        return run
    eager = _losses(False, "cpu")
    monkeypatch.setattr(torch, "compile", broken_compile)
    got = _losses(True, "cpu")
    assert got == pytest.approx(eager, rel=1e-6)
    err = capsys.readouterr().err
    assert err.count("the compiled step failed") == 1 and "no C++ compiler found" in err
    assert "more detail" not in err and "--no-compile" in err


def test_out_of_memory_says_what_to_do(capsys):
    def main(argv):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(SystemExit) as e:
        common.run_main(main, [])
    assert e.value.code == 3
    err = capsys.readouterr().err
    assert "--batch_size" in err and "torchrun --nproc_per_node" in err and "Traceback" not in err


def _plain_losses(batches, fused=False, max_grad_norm=1.0, world_size=1) -> list[float]:
    """The losses of plain clip_grad_norm_ + AdamW, written out here, on the CPU."""
    model = _tiny_simcse()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / 10)
    out = []
    for b in batches:
        loss = model(b)
        (loss * world_size).backward()
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
        out.append(float(loss.detach()))
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_cuda_path_simulated_on_cpu(world_size, monkeypatch):
    """The fast path's wiring with CUDA simulated on the CPU: on one GPU the model is compiled
    with torch.compile's CUDA graphs (mode "reduce-overhead") and marks each step's start, so
    that a replay may overwrite the last step's outputs, which train_step has copied; under DDP
    it is compiled without graphs. The step clips, steps the fused AdamW and the schedule, and
    its losses are those of the plain step written out."""
    batches = [_batch(16, seed=i) for i in range(4)]
    seen, marks, clips = [], [], []

    def fake_compile(model, mode=None, backend=None):
        seen.append((mode, backend))
        return model                                     # the compiled model computes the same

    real_clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    def clip(params, max_norm, **kw):
        clips.append(max_norm)
        return real_clip(params, max_norm, **kw)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    model = _tiny_simcse()
    opt = torch.optim.AdamW(list(model.parameters()), lr=1e-3, fused=True)   # make_optimizer's on CUDA
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / 10)
    step = _step_fn(model, opt, sched, "cuda", 0.5, world_size, compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                  # CUDA autocast asked for on a CPU machine
        got = [step(b) for b in batches]
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", real_clip)
    assert seen == [("reduce-overhead" if world_size == 1 else None, "inductor")]
    assert len(marks) == (len(batches) if world_size == 1 else 0)
    assert clips == [0.5] * len(batches)
    assert sched.last_epoch == len(batches)
    want = _plain_losses(batches, fused=True, max_grad_norm=0.5, world_size=world_size)
    # clipping at 0.6 instead of 0.5 moves the 4th loss by 5%, no clipping by 18%
    assert [float(l) for l, _ in got] == pytest.approx(want, rel=1e-5)
    loss = got[0][0]
    assert loss.requires_grad is False and loss.dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.compiled
def test_compiled_bf16_step_matches_fp32_eager_cuda():
    """On the GPU: bf16 autocast + compile + the CUDA-graph replay (steps 3 to 6) against the
    same steps in fp32 eager."""
    fast = _losses(True, "cuda", steps=6)
    ref = _losses_fp32_cuda(6)
    assert np.allclose(fast, ref, rtol=2e-2, atol=2e-2), (fast, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.compiled
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_cuda_graphs_read_the_batch_the_lr_and_fresh_dropout(dropout, capsys):
    """On the GPU, once the compiled step runs from its CUDA graphs (after the warm-up calls):
    with the lr scheduled to 0 the weights stay put (the schedule reaches the step), so two
    steps on one batch differ by dropout alone: equal without dropout, different with it; a
    new batch gives a new loss (the graphs read each new batch)."""
    cuda = torch.device("cuda")
    model = _tiny_simcse(dropout=dropout).cuda()
    params = list(model.parameters())
    opt, _ = common.make_optimizer(params, 1e-3, 0.0, 10, cuda)
    factor = [1.0]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: factor[0])
    step = _step_fn(model, opt, sched, cuda, compile=True)
    b0, b1 = ({k: {kk: vv.cuda() for kk, vv in v.items()} for k, v in _batch(16, seed=i).items()}
              for i in (0, 1))
    for _ in range(4):                                 # compile, warm up, record the graphs
        step(b0)
    w0 = [p.detach().clone() for p in params]
    factor[0] = 0.0
    step(b0)                                           # still at lr 1e-3; the schedule then says 0
    assert not all(torch.equal(p, q) for p, q in zip(params, w0))
    w1 = [p.detach().clone() for p in params]
    la, lb, lc = (float(step(b)[0]) for b in (b0, b0, b1))
    assert all(torch.equal(p, q) for p, q in zip(params, w1))
    assert (la != lb) == (dropout > 0)
    assert lc != la
    assert "failed" not in capsys.readouterr().err


def _losses_fp32_cuda(steps):
    model = _tiny_simcse().cuda()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    step = _step_fn(model, opt, sched, "cuda", amp=False)
    out = []
    for i in range(steps):
        b = {k: {kk: vv.cuda() for kk, vv in v.items()} for k, v in _batch(16, seed=i).items()}
        out.append(float(step(b)[0]))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, world: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    model = _tiny_simcse()
    model.encoder.pooler.requires_grad_(False)     # as common.train() does: no loss uses it
    ddp = compiled_step.wrap_ddp(model, torch.device("cpu"))
    full = _batch(8)
    n = 8 // world
    local = {k: {kk: vv[rank * n:(rank + 1) * n] for kk, vv in v.items()} for k, v in full.items()}
    loss = ddp(local)
    (loss * world).backward()        # what common.train_step does under DDP
    if rank == 0:
        torch.save({"loss": loss.detach(), "grads": {k: p.grad.clone() for k, p in model.named_parameters()
                                                     if p.grad is not None}}, out_path)
    torch.distributed.barrier()      # neither process tears the group down while the other still uses it
    torch.distributed.destroy_process_group()


def test_ddp_two_processes_equal_one_process(tmp_path):
    """gloo, 2 processes, dropout off: the loss sees the global batch (gathered embeddings)
    and the averaged gradients equal those of one process on the same 8 sentences."""
    out = tmp_path / "ddp.pt"
    mp.start_processes(_ddp_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True,
                       start_method="spawn")
    got = torch.load(out)
    model = _tiny_simcse()
    loss = model(_batch(8))
    loss.backward()
    assert torch.allclose(got["loss"], loss.detach(), atol=1e-6)
    ref = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    assert set(got["grads"]) == set(ref)
    for k in ref:
        assert torch.allclose(got["grads"][k], ref[k], atol=1e-6, rtol=1e-4), k
    # without the all-gather each rank would see only 4 sentences: a different loss
    half = {k: {kk: vv[:4] for kk, vv in v.items()} for k, v in _batch(8).items()}
    assert not torch.allclose(model(half), loss)


def test_gather_is_identity_in_one_process():
    x = torch.randn(3, 4, requires_grad=True)
    assert common.gather(x) is x


TORCHRUN_CASES = {   # script, then flags beyond the shared ones; {x} are fixtures
    "simcse": ["simcse.py", "--data", "{corpus}"],
    "simcse_nli": ["simcse.py", "--data", "{nli}"],
    "focal_infonce": ["focal_infonce.py", "--data", "{corpus}"],
    "ifcl": ["ifcl.py", "--data", "{parallel}/en.txt", "--fraternal_data", "{parallel}/de.txt",
             "--fraternal_model", "{tiny_mbert}", "--queue_len", "20"],
    "conisi": ["conisi.py", "--data", "{corpus}", "--max_len", "16"],
    "rcl": ["rcl.py", "--data", "{corpus}", "--phi", "0.01", "0.02"],
    # ablations that switch parts off: no trainable weight may go without a gradient under DDP
    "conisi_lam0": ["conisi.py", "--data", "{corpus}", "--max_len", "16", "--lam", "0"],
    "conisi_lam1": ["conisi.py", "--data", "{corpus}", "--max_len", "16", "--lam", "1"],
    "simcse_first_last": ["simcse.py", "--data", "{corpus}", "--pooler", "avg_first_last"],
    "simcse_no_mlp": ["simcse.py", "--data", "{corpus}", "--no_mlp"],
    "ifcl_simcse_row": ["ifcl.py", "--data", "{parallel}/en.txt", "--fraternal_model", "unused",
                        "--no_fraternal", "--no_queue"],
    "ifcl_train_embeddings": ["ifcl.py", "--data", "{parallel}/en.txt", "--fraternal_data",
                              "{parallel}/de.txt", "--fraternal_model", "{tiny_mbert}", "--train_embeddings"],
}


def _case_argv(case: str, request) -> list[str]:
    """The script and its flags for one of TORCHRUN_CASES, the fixtures filled in."""
    fixtures = {name: request.getfixturevalue(name) for name in ("corpus", "parallel", "tiny_mbert",
                                                                 "tiny_mt")
                if any("{" + name + "}" in f for f in TORCHRUN_CASES[case])}
    if case == "simcse_nli":
        fixtures["nli"] = request.getfixturevalue("nli_csv")
    return [f.format(**fixtures) for f in TORCHRUN_CASES[case]]


@pytest.mark.compiled
@pytest.mark.parametrize("case", list(TORCHRUN_CASES))
def test_every_scripts_step_compiles_to_one_graph(case, request, tmp_path, tiny_bert, small_sts,
                                                  monkeypatch, capsys, on_cpu):
    """What torch.compile sees of each script's model on a statically padded batch: one graph
    and no graph break (no .item(), no Python branch on a tensor, nothing that would stop a
    CUDA-graph capture of the step on the GPU). Checked after a first step, which installs
    transformers' output-capturing hooks (IFCL reads hidden_states[0]). Then three compiled
    steps on different batches of that shape must not recompile (a Python number in the model
    that changes every step, say a queue pointer, would)."""
    script, *flags = _case_argv(case, request)
    real, seen = common.train, []

    def train_then_explain(args, run, model, data, *a, **k):
        res = real(args, run, model, data, *a, **k)
        cpu = torch.device("cpu")
        batches = [common.device_batch(data, np.arange(i, i + args.batch_size), args.max_len, cpu)
                   for i in range(3)]
        model.train()
        ex = torch._dynamo.explain(model)(batches[0])
        seen.append((ex.graph_count, ex.graph_break_count, [str(b.reason)[:300] for b in ex.break_reasons]))
        # and three compiled steps on other batches of the same shape: no recompilation
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-5)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        step = _step_fn(model, opt, sched, cpu, compile=True)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for b in batches:
                step(b)
        return res

    monkeypatch.setattr(common, "train", train_then_explain)
    torch._dynamo.reset()
    module = __import__(script.removesuffix(".py"))
    module.main([*flags, "--model", str(tiny_bert), "--sts_dir", str(small_sts),
                 "--output_dir", str(tmp_path / "run"), "--max_steps", "1", "--eval_every", "1",
                 "--batch_size", "8", "--cache_dir", str(tmp_path / "cache")])
    torch._dynamo.reset()
    assert seen and all(s[:2] == (1, 0) for s in seen), seen
    assert "the compiled step failed" not in capsys.readouterr().err   # no eager fallback either


@pytest.mark.parametrize("case", list(TORCHRUN_CASES))
def test_torchrun_two_processes_trains_end_to_end(case, request, tmp_path, tiny_bert, small_sts):
    """`torchrun --nproc_per_node 2 <script>.py` on the CPU (gloo), for every script: the
    whole loop under DDP (each script's own parts too: IFCL's queue, ConIsI's BatchNorm and
    in-batch sampling, RCL's two stages), evaluation and checkpoints on rank 0, the other rank
    waiting at the barriers."""
    script, *flags = _case_argv(case, request)
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "--master_port", str(_free_port()), str(ROOT / script), *flags,
                        "--model", str(tiny_bert), "--sts_dir", str(small_sts), "--output_dir", str(out),
                        "--max_steps", "4", "--eval_every", "2", "--batch_size", "8",
                        "--cache_dir", str(tmp_path / "cache")],
                       capture_output=True, text=True, timeout=600, env=cpu_env())
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs if "stsb_dev" in x] == [2, 4]
    assert (out / "best" / "config.json").exists() and (out / "best" / "test_metrics.json").exists()
    if case == "rcl":
        assert all((out / f"entropy_phi{phi}" / "DONE.json").exists() for phi in ("0.01", "0.02"))


# ------------------------------------------------------------------ length-sorted sub-batches (CPU)

def _ragged(n: int = 24, width: int = 20, seed: int = 0, types: bool = False) -> dict:
    """A right-padded batch whose rows' lengths range from 2 to `width` (one row at full width)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, width + 1, (n,), generator=g)
    lengths[0] = width
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    ids = torch.randint(5, 1000, (n, width), generator=g) * mask
    out = {"input_ids": ids, "attention_mask": mask}
    if types:
        out["token_type_ids"] = (torch.arange(width)[None] >= lengths[:, None] // 2).long() * mask
    return out


@pytest.mark.parametrize("types", [False, True])
def test_sub_batches_give_the_padded_batch_rows_and_loss(types):
    """With dropout off (the same masks: none), the encoder in length-sorted parts gives the padded
    batch's last layer, hidden states and pooler output on every real token, and SimCSE's loss and
    gradients, within float tolerance."""
    import copy
    model = _tiny_simcse(dropout=0.0).train()
    sub = copy.deepcopy(model)
    compiled_step.sub_batched(sub.encoder)
    x = _ragged(types=types)
    mask = x["attention_mask"].bool()
    ref = model.encoder(**x, output_hidden_states=True)
    got = sub.encoder(**x, output_hidden_states=True)
    assert torch.allclose(got.last_hidden_state[mask], ref.last_hidden_state[mask], atol=1e-5)
    assert len(got.hidden_states) == len(ref.hidden_states)
    for h_got, h_ref in zip(got.hidden_states, ref.hidden_states):
        assert torch.allclose(h_got[mask], h_ref[mask], atol=1e-5)
    assert torch.allclose(got.pooler_output, ref.pooler_output, atol=1e-5)
    batch = {"text": {k: v for k, v in x.items() if k != "token_type_ids"}}
    loss_ref, loss_got = model(batch), sub(batch)
    assert torch.allclose(loss_got, loss_ref, atol=1e-5)
    loss_ref.backward()
    loss_got.backward()
    for (name, p_ref), p_got in zip(model.named_parameters(), sub.parameters()):
        if p_ref.grad is not None:
            assert torch.allclose(p_got.grad, p_ref.grad, atol=1e-5, rtol=1e-4), name


def test_sub_batches_split_the_forward_and_leave_every_other_call_as_it_is(monkeypatch):
    """In training, 4 forwards over rows of similar length, each cut to its longest row; in eval
    mode, with few rows, little padding, left padding or inputs_embeds: the plain forward, to the bit."""
    model = _tiny_simcse(dropout=0.0)
    enc = compiled_step.sub_batched(model.encoder)
    widths = []
    plain = type(enc).forward
    def counted(self, **kw):
        widths.append(kw["input_ids" if kw.get("input_ids") is not None else "inputs_embeds"].shape[:2])
        return plain(self, **kw)
    monkeypatch.setattr(type(enc), "forward", counted)
    x = _ragged()
    enc.train()
    enc(**x)
    assert len(widths) == 4 and sum(n for n, _ in widths) == 24 and max(w for _, w in widths) == 20
    assert [w for _, w in widths] == sorted(w for _, w in widths) and widths[0][1] < 20
    left = {"input_ids": x["input_ids"].flip(1), "attention_mask": x["attention_mask"].flip(1)}
    full = {k: v[:, :2] for k, v in x.items()}                       # every row 2 tokens: nothing to save
    embeds = {"inputs_embeds": enc.embeddings.word_embeddings(x["input_ids"]),
              "attention_mask": x["attention_mask"]}
    for mode, call in [("eval", x), ("train", {k: v[:7] for k, v in x.items()}), ("train", left),
                       ("train", full), ("train", embeds)]:
        enc.train(mode == "train")
        widths.clear()
        got = enc(**call).last_hidden_state
        assert len(widths) == 1, mode
        assert torch.equal(got, plain(enc, **call).last_hidden_state)


def test_the_cpu_step_encodes_in_sub_batches_and_a_gpu_step_does_not():
    model = _tiny_simcse()
    assert common.compiled_forward(model, torch.device("cpu"), True, 1) is model
    assert getattr(model.encoder.forward, "sub_batched", False)
    other = _tiny_simcse()
    forward = common.compiled_forward(other, torch.device("cuda"), False, 1)
    assert forward is other and not getattr(other.encoder.forward, "sub_batched", False)
