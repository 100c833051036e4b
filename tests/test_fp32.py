"""Every loss in fp32 whatever the autocast (common.fp32): under bf16 autocast each loss, and
each figure for the log computed from embeddings, gives what it gives without autocast on
the same inputs cast to fp32. Checked on the CPU's bf16 autocast; the GPU's runs the step."""

from __future__ import annotations

import pytest
import torch

import common
import conisi
import focal_infonce as fi
import ifcl
import rcl
import simcse

N, D, L, M = 8, 16, 5, 6  # batch, width, tokens, queue slots


def _inputs(name: str) -> tuple[list, dict]:
    """Random fp32 inputs of the right shapes for one function: (positional args, keyword args).
    Positives lie near their anchors, so the logits are large, as in training."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))

    def r(*shape):
        return torch.randn(*shape, generator=g)

    h = r(N, D)                                                               # (N, d)
    near = lambda x: x + 0.5 * torch.randn(x.shape, generator=g)             # noqa: E731
    s = torch.rand(N, N, generator=g) * 2 - 1                                 # (N, N) cosines
    mask = (torch.arange(L)[None] < torch.randint(1, L + 1, (N,), generator=g)[:, None]).long()  # (N, L)
    return {
        "simcse_loss": ([h, near(h), 0.05], {}),
        "simcse_sup_loss": ([h, near(h), r(N, D), 0.05], {}),
        "focal_infonce_loss": ([h, near(h), 0.07, 0.3], {}),
        "focal_cosine_matrix": ([h, near(h)], {}),
        "focal_infonce_from_cos": ([s, 0.07, 0.3], {}),
        "focal_similarity_stats": ([s, 0.3], {}),
        "identical_loss": ([h, near(h), r(M, D), torch.rand(M, generator=g) * 0.9 + 0.1, 0.05], {}),
        "fraternal_loss": ([h, near(h), 0.05], {}),
        "twins_loss": ([h, near(h), near(h), 0.5 * r(N)], {}),
        "innate_margin": ([r(N, L, D), r(N, L, D), r(N, L, D), mask], {}),
        "conisi_contrastive_loss": ([h, near(h), 0.05], {}),
        "interactive_loss": ([r(N), r(N)], {}),
        "conisi_loss": ([h, near(h), r(N), r(N), 0.05, 0.1], {}),
        "interactive_accuracy": ([r(N), r(N)], {}),
        "rcl_contrastive_loss": ([h, torch.cat([near(h), r(N, D)]), 0.05], {}),
        "entropy_loss": ([h, torch.cat([near(h), r(N, D)]), 0.1, 0.05], {}),
        "regularized_loss": ([h, near(h)], {"aug_q": [near(h), near(h)],
                                            "aug_ind": [near(h), near(h)], "tau": 0.05}),
        "row_entropy": ([h, near(h), 0.05], {}),
    }[name]


FUNCTIONS = {
    "simcse_loss": simcse.simcse_loss,
    "simcse_sup_loss": simcse.simcse_sup_loss,
    "focal_infonce_loss": fi.focal_infonce_loss,
    "focal_cosine_matrix": fi.cosine_matrix,
    "focal_infonce_from_cos": fi.focal_infonce_from_cos,
    "focal_similarity_stats": fi.similarity_stats,
    "identical_loss": ifcl.identical_loss,
    "fraternal_loss": ifcl.fraternal_loss,
    "twins_loss": ifcl.twins_loss,
    "innate_margin": ifcl.innate_margin,
    "conisi_contrastive_loss": conisi.contrastive_loss,
    "interactive_loss": conisi.interactive_loss,
    "conisi_loss": conisi.conisi_loss,
    "interactive_accuracy": conisi.interactive_accuracy,
    "rcl_contrastive_loss": rcl.contrastive_loss,
    "entropy_loss": rcl.entropy_loss,
    "regularized_loss": rcl.regularized_loss,
    "row_entropy": rcl.row_entropy,
}


def _map(x, f):
    """f on every floating tensor of x (x a tensor, a list of them, or anything else)."""
    if isinstance(x, (list, tuple)):
        return type(x)(_map(v, f) for v in x)
    return f(x) if torch.is_tensor(x) and x.is_floating_point() else x


def _leaves(args, kwargs) -> list[torch.Tensor]:
    out = []
    _map([list(args), list(kwargs.values())], lambda t: out.append(t) or t)
    return out


def _outputs(y) -> list[torch.Tensor]:
    return list(y.values()) if isinstance(y, dict) else [y]


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_bf16_autocast_gives_the_fp32_value(name, in_dtype):
    fn = FUNCTIONS[name]
    args, kwargs = _inputs(name)
    args, kwargs = _map(args, lambda t: t.to(in_dtype)), _map(kwargs, lambda t: t.to(in_dtype))
    # the reference: no autocast, the same inputs cast to fp32
    ref_args, ref_kwargs = _map(args, lambda t: t.float()), _map(kwargs, lambda t: t.float())
    want = _outputs(fn(*ref_args, **ref_kwargs))
    # under autocast the inputs are leaves that ask for a gradient
    args, kwargs = _map(args, lambda t: t.requires_grad_()), _map(kwargs, lambda t: t.requires_grad_())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _outputs(fn(*args, **kwargs))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32, (name, g.dtype)
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    # the gradient comes back in each input's own dtype
    if got[0].requires_grad:
        got[0].sum().backward()
        leaves = _leaves(args, kwargs)
        assert any(t.grad is not None for t in leaves)
        for t in leaves:
            assert t.grad is None or t.grad.dtype == in_dtype, (name, t.grad.dtype)


def test_bf16_autocast_would_change_the_loss():
    """The test above can fail: the same loss computed under bf16 autocast without common.fp32
    (the undecorated function, __wrapped__) is off by far more than 1e-5."""
    fn = simcse.simcse_loss
    h, h_pos, tau = _inputs("simcse_loss")[0]
    want = fn(h, h_pos, tau)                                                  # ()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        raw = fn.__wrapped__(h, h_pos, tau)                                   # ()
    assert abs(float(raw) - float(want)) > 1e-3 * abs(float(want))


def test_fp32_decorator_casts_only_what_is_below_fp32():
    """bf16 (also inside a list) up to fp32; fp64 and integer tensors as they are; autocast off
    inside the function and on again after it."""
    seen = {}

    @common.fp32
    def f(a, xs, b, ids):
        seen.update(a=a.dtype, xs=[x.dtype for x in xs], b=b.dtype, ids=ids.dtype,
                    autocast=torch.is_autocast_enabled("cpu"))
        return a.sum()

    bf = torch.ones(2, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        f(bf, [bf, bf], b=torch.ones(2, dtype=torch.float64), ids=torch.ones(2, dtype=torch.long))
        seen["after"] = torch.is_autocast_enabled("cpu")
    assert seen == {"a": torch.float32, "xs": [torch.float32] * 2, "b": torch.float64,
                    "ids": torch.long, "autocast": False, "after": True}


@pytest.mark.compiled
def test_compiled_loss_under_autocast_is_one_graph_in_fp32():
    """torch.compile traces through the decorator (autocast off inside): one graph, no break,
    and the fp32 value."""
    fn = fi.focal_infonce_loss
    h, h_pos, tau, m = _inputs("focal_infonce_loss")[0]
    want = fn(h, h_pos, tau, m)                                               # ()
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ex = torch._dynamo.explain(fn)(h, h_pos, tau, m)
        got = torch.compile(fn, backend="aot_eager")(h, h_pos, tau, m)        # ()
    torch._dynamo.reset()
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
