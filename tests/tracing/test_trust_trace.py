"""Issue 17, tracing: results a user can trust.

Each test is a case that gave a wrong result without an error before: in-place operations across
stages (functional graphs before the split), trace keys that missed what changes a trace, module
buffers captured at trace time, and trace state shared by threads. References are the unsplit
function under `torch.func` or eager.
"""

from __future__ import annotations

import copy
import dataclasses
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from models import ConvBN, assert_trees_close

import fpipe
from fpipe._src.tracing.trace_key import Static as _Static
from fpipe._src.tracing.trace_key import tensor_key as _tensor_key

DT = torch.float64
SCHEDULES = ["gpipe", "1f1b", "zb-h1"]


def _check_value_and_grad(f, args, *, stages=None, microbatches=2, schedule="1f1b"):
    """fpipe's value and gradients (all arguments) equal the unsplit function's."""
    argnums = tuple(range(len(args)))
    ref_grads, ref_value = torch.func.grad_and_value(f, argnums=argnums)(*args)
    piped = fpipe.pipeline(f, stages=stages, microbatches=microbatches, schedule=schedule, in_axes=None)
    value, grads = fpipe.value_and_grad(piped, argnums=argnums[1:])(*args)
    assert_trees_close(value, ref_value)
    grads_w = fpipe.grad(piped)(*args)
    assert_trees_close((grads_w, *grads), ref_grads)
    assert_trees_close(piped(*args), f(*args))


# -- 1. functional graphs before the split -----------------------------------------------------------


def _mutates_boundary_output(w, x):
    h = torch.tanh(x @ w)
    y = fpipe.stage_boundary(h)
    y.mul_(2)  # stage 0 saved h for tanh's backward: the split must not hand it the same storage
    return (y @ w).pow(2).mean()


def _writes_after_a_later_stage_reads(w, x):
    z = fpipe.stage_boundary(torch.tanh(x @ w))
    a = z @ w  # stage 1
    h = fpipe.stage_boundary(a + 1)
    b = h + a  # stage 2 reads a before ...
    a.mul_(3)  # ... stage 1 updates it: the update must not run first
    return (b * a).mean()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("f", [_mutates_boundary_output, _writes_after_a_later_stage_reads])
def test_in_place_operations_across_stages(f, schedule):
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(4, 4, generator=g, dtype=DT), torch.randn(8, 4, generator=g, dtype=DT)
    _check_value_and_grad(f, (w, x), schedule=schedule)


def _skip_updated_in_place(ws, x):
    a = x @ ws[0]
    h = a * 2
    for w in ws[1:]:
        h = torch.tanh(h @ w)
    out = h + a  # the skip connection, read on the last stage ...
    a.add_(1)  # ... and updated in place afterwards, where `a` was computed
    return (out * a).mean()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("stages", [2, 3])
def test_in_place_update_after_an_automatic_cut(stages, schedule):
    """A guard: automatic cuts follow program order, so the old split got this right too; the
    functional graph (the update an out-of-place add) must keep it right."""
    g = torch.Generator().manual_seed(1)
    ws = torch.randn(5, 6, 6, generator=g, dtype=DT) / 2
    x = torch.randn(8, 6, generator=g, dtype=DT)
    _check_value_and_grad(_skip_updated_in_place, (ws, x), stages=stages, schedule=schedule)


def test_traced_programs_have_no_in_place_operations_but_input_writes():
    module = ConvBN(stages=3).to(DT).train()
    fn, params = fpipe.functionalize(module)
    piped = fpipe.pipeline(lambda p, x: fn(p, x).pow(2).mean(), microbatches=2, schedule="zb-h1")
    fpipe.value_and_grad(piped)(params, torch.randn(4, 3, 6, 6, dtype=DT))
    staged = next(iter(piped._cache.values())).staged
    for place, prog in staged.programs.items():
        for node in prog.gm.graph.nodes:
            schema = getattr(node.target, "_schema", None)
            if schema is not None and schema.is_mutable:
                assert node.target is torch.ops.aten.copy_.default, (place, node.format_node())
                assert node.args[0].name in staged.const_inputs, (place, node.format_node())


def test_a_buffer_update_runs_on_its_modules_stage():
    """A BatchNorm after a boundary updates its counter on its own stage (the rank that holds
    it), not wherever the functional graph's trailing write would fall."""
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).to(DT).train()
    fn, params = fpipe.functionalize(module)

    def f(p, x):
        return fn(p, fpipe.stage_boundary(x * 2)).pow(2).mean()

    piped = fpipe.pipeline(f, microbatches=2)
    fpipe.value_and_grad(piped)(params, torch.randn(4, 3, dtype=DT))
    assert module[1].num_batches_tracked.item() == 2
    staged = next(iter(piped._cache.values())).staged
    writes = {
        place
        for place, prog in staged.programs.items()
        for node in prog.gm.graph.nodes
        if node.target is torch.ops.aten.copy_.default
    }
    assert writes == {("F", 1)}


class _ReadThenUpdate(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4, dtype=DT, generator=torch.Generator().manual_seed(5)))
        self.register_buffer("buf", torch.ones(4, dtype=DT))

    def forward(self, x):
        h1 = fpipe.stage_boundary(torch.tanh(x @ self.w))
        y = (h1 * self.buf).sum()  # stage 1 reads the buffer ...
        self.buf.add_(1)  # ... then it is updated; stage 0's work follows in program order
        h2 = fpipe.stage_boundary(torch.sin(x @ self.w))
        return y + h2.sum()


def test_a_buffer_write_never_runs_before_an_earlier_read():
    """Neither the trace (on fake tensors) nor a stage placed before the reading one updates the
    buffer: the step reads the old value and leaves the buffer updated once."""
    module, eager = _ReadThenUpdate(), _ReadThenUpdate()
    fn, params = fpipe.functionalize(module)
    x = torch.randn(8, 4, dtype=DT)
    out = fpipe.pipeline(fn, microbatches=1)(params, x)
    assert_trees_close(out, eager(x).detach())
    assert_trees_close(module.buf, eager.buf)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_batchnorm_statistics_with_functional_graphs(schedule):
    """Running statistics are updated once per microbatch, in order, as eager training does."""
    torch.manual_seed(0)
    base = ConvBN().to(DT).train()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 3, 6, 6, generator=g, dtype=DT)
    y = torch.randint(0, 3, (8,), generator=g)
    eager = copy.deepcopy(base)
    ref_params = {k: v.detach() for k, v in eager.named_parameters()}
    ref_buffers = {k: v.clone() for k, v in eager.named_buffers()}

    def ref_loss(params, buffers):
        losses = [
            F.cross_entropy(torch.func.functional_call(eager, (params, buffers), (xc,)), yc)
            for xc, yc in zip(x.chunk(2), y.chunk(2))
        ]
        return sum(losses) / 2

    ref_grads, ref_value = torch.func.grad_and_value(ref_loss)(ref_params, ref_buffers)
    module = ConvBN(stages=3).to(DT).train()
    module.load_state_dict(base.state_dict())
    fn, params = fpipe.functionalize(module)
    piped = fpipe.pipeline(lambda p, x, y: F.cross_entropy(fn(p, x), y), microbatches=2, schedule=schedule)
    value, grads = fpipe.value_and_grad(piped)(params, x, y)
    assert_trees_close(value, ref_value)
    assert_trees_close(grads, ref_grads)
    for name, buf in module.named_buffers():
        expected = ref_buffers[name]
        if buf.is_floating_point():
            assert_trees_close(buf, expected)
        else:
            assert buf.item() == expected.item() == 2, name


# -- 2. a complete trace key -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Scale:
    value: float = dataclasses.field(repr=False)  # two scales print alike


def test_statics_are_keyed_by_value_not_by_repr():
    def f(w, x, s):
        return (x @ w).sum() * s.value

    w, x = torch.ones(3, dtype=DT), torch.ones(4, 3, dtype=DT)
    piped = fpipe.pipeline(f, microbatches=2, out_axes="sum")
    assert repr(_Scale(1.0)) == repr(_Scale(2.0))
    for s in (_Scale(1.0), _Scale(2.0), _Scale(1.0)):
        assert_trees_close(piped(w, x, s), f(w, x, s))


def test_an_unhashable_static_is_refused_by_name():
    def f(w, x, table):
        return (x @ w).sum() * float(table[5])

    piped = fpipe.pipeline(f, microbatches=2)
    a = np.zeros(1000)
    with pytest.raises(TypeError) as err:
        piped(torch.ones(3), torch.ones(4, 3), a)
    msg = str(err.value)
    assert msg.startswith("pipeline(f, microbatches=2): argument 'table' is a ndarray, which is not hashable")
    assert "torch.as_tensor" in msg and "tuple" in msg


def test_autocast_is_part_of_the_key():
    def f(w, x):
        return x @ w

    w, x = torch.randn(3, 3), torch.randn(4, 3)
    piped = fpipe.pipeline(f, microbatches=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = piped(w, x)
        assert first.dtype == f(w, x).dtype == torch.bfloat16
    plain = piped(w, x)
    assert plain.dtype == torch.float32
    torch.testing.assert_close(plain, f(w, x), rtol=1e-6, atol=1e-6)


def test_grad_mode_is_part_of_the_key():
    def f(w, x):
        extra = torch.ones(3, dtype=DT) if torch.is_grad_enabled() else torch.zeros(3, dtype=DT)
        return x @ (w + extra)

    w, x = torch.ones(3, dtype=DT), torch.ones(4, 3, dtype=DT)
    piped = fpipe.pipeline(f, microbatches=2)
    assert_trees_close(piped(w, x), f(w, x))
    with torch.no_grad():
        assert_trees_close(piped(w, x), f(w, x))


def test_default_dtype_is_part_of_the_key():
    def f(w, x):
        return x @ w + torch.tensor(0.1).to(DT)  # 0.1 in the default dtype

    w, x = torch.ones(3, dtype=DT), torch.ones(4, 3, dtype=DT)
    piped = fpipe.pipeline(f, microbatches=2)
    assert_trees_close(piped(w, x), f(w, x))
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert_trees_close(piped(w, x), f(w, x))
    finally:
        torch.set_default_dtype(old)


def test_layout_is_part_of_the_key():
    def f(w, x):
        return x.reshape(-1)[:5].sum() * w.sum()

    w = torch.ones(2, dtype=DT)
    x = torch.arange(24, dtype=DT).reshape(2, 12)
    xt = torch.arange(24, dtype=DT).reshape(12, 2).t()  # same shape, transposed layout
    piped = fpipe.pipeline(f, microbatches=1)
    assert_trees_close(piped(w, x), f(w, x))
    assert_trees_close(piped(w, xt), f(w, xt))


def test_key_matches_across_ranks():
    """A meta parameter (another rank's) keys like a real one on the data's device; a static's
    repr (compared across ranks) holds no object address."""
    real, meta = torch.empty(3, 4), torch.empty(3, 4, device="meta")
    assert _tensor_key(meta, "cpu") == _tensor_key(real, "cpu")
    assert _tensor_key(real.t(), "cpu") != _tensor_key(real.t().contiguous(), "cpu")
    assert "0x" not in repr(_Static(object()))
    assert _Static(1) != _Static(True) and _Static(1) != _Static(1.0)


# -- 3. buffers read at every call -----------------------------------------------------------------


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3).to(DT)
        self.register_buffer("scale", torch.full((3,), 2.0, dtype=DT))

    def forward(self, x):
        h = fpipe.stage_boundary(self.lin(x))
        return (h * self.scale).sum()


def test_reassigned_buffers_are_read_at_every_call():
    module = _Scaled()
    fn, params = fpipe.functionalize(module)
    piped = fpipe.pipeline(fn, microbatches=2, out_axes="sum")
    x = torch.randn(4, 3, dtype=DT)
    assert_trees_close(piped(params, x), module(x))
    sd = {k: v.clone() for k, v in module.state_dict().items()}
    sd["scale"] = torch.tensor([1.0, -3.0, 0.5], dtype=DT)
    module.load_state_dict(sd, assign=True)
    assert_trees_close(piped(params, x), module(x))
    module.scale = torch.tensor([4.0, 0.0, 1.0], dtype=DT)
    assert_trees_close(fpipe.value_and_grad(piped)(params, x)[0], module(x))


def test_a_reshaped_buffer_is_an_error():
    module = _Scaled()
    fn, params = fpipe.functionalize(module)
    piped = fpipe.pipeline(fn, microbatches=2)
    x = torch.randn(4, 3, dtype=DT)
    piped(params, x)
    module.scale = torch.ones(1, dtype=DT)
    with pytest.raises(
        ValueError, match=r"buffer 'scale' of _Scaled is now a torch.float64 tensor of shape \(1,\)"
    ):
        piped(params, x)


def test_a_trace_in_another_thread_leaves_this_threads_buffers_alone():
    """A trace restores the 0-dim buffers it updated at trace time; another thread's eager
    update of its own module during that trace must stay."""
    reached, go_on = threading.Event(), threading.Event()

    def slow(w, x):
        reached.set()
        go_on.wait(30)
        return (x @ w).sum()

    errors: list[BaseException] = []

    def trace_in_thread():
        try:
            fpipe.pipeline(slow, microbatches=2)(torch.ones(3), torch.ones(4, 3))
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=trace_in_thread)
    thread.start()
    assert reached.wait(60)
    bn = torch.nn.BatchNorm1d(3).train()
    fn, params = fpipe.functionalize(bn)
    fn(params, torch.randn(4, 3))  # eager: num_batches_tracked 0 -> 1
    go_on.set()
    thread.join(60)
    assert not errors, errors
    assert bn.num_batches_tracked.item() == 1


# -- 4. custom autograd.Function, without patching torch -------------------------------------------


class _Doubled(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_custom_function_refused_on_plain_calls_without_patching_torch():
    original = torch.autograd.Function.__dict__["apply"]
    seen = []

    def f(w, x):
        seen.append(torch.autograd.Function.__dict__["apply"] is original)
        h = fpipe.stage_boundary(torch.tanh(x @ w))
        return _Doubled.apply(h).sum()

    piped = fpipe.pipeline(f, microbatches=2)
    with pytest.raises(ValueError, match="calls the custom autograd.Function _Doubled"):
        piped(torch.eye(3, dtype=DT), torch.ones(4, 3, dtype=DT))
    with pytest.raises(ValueError, match="calls the custom autograd.Function _Doubled"):
        fpipe.value_and_grad(piped)(torch.eye(3, dtype=DT), torch.ones(4, 3, dtype=DT))
    assert seen and all(seen)


def test_a_constant_value_passed_through_a_boundary_is_recomputed_by_its_readers():
    """A value computed from constants alone (a mask), read on stage 0 forward and backward and
    passed through a boundary to stage 1 (as GPT-2 passes its causal mask from block to block):
    its readers each compute it. It used to be copied into stage 0's programs and read on
    stage 1 from an output no program produced (KeyError)."""

    def f(w, x):
        mask = torch.arange(4) % 2 == 0
        h = torch.where(mask, x @ w, 0.0)
        h, m = fpipe.stage_boundary((h, mask))
        return torch.where(m, torch.tanh(h) @ w, 0.0).pow(2).mean()

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(4, 4, generator=g, dtype=DT), torch.randn(6, 4, generator=g, dtype=DT)
    for microbatches in (1, 2):
        loss, grad = fpipe.value_and_grad(fpipe.pipeline(f, microbatches=microbatches))(w, x)
        ref_grad, ref_loss = torch.func.grad_and_value(f)(w, x)
        assert_trees_close((loss, grad), (ref_loss, ref_grad))


class _Counted(torch.nn.Module):
    """A position counter kept as a plain tensor attribute (a KV cache's length, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3).to(DT)
        self.length = torch.tensor(0)

    def forward(self, x):
        pos = torch.arange(self.length, self.length + x.shape[1])
        return self.lin(x) + pos[None, :, None]


def test_a_captured_tensor_read_as_a_number_is_refused_naming_the_line():
    """NOTE [captured values]: the trace would keep the counter's value at trace time (after
    `m.length += 3` the pipeline returned the old positions' result, no error)."""
    model = _Counted()
    fn, params = fpipe.functionalize(model)
    piped = fpipe.pipeline(lambda p, x: fn(p, x).sum(), microbatches=1)
    with pytest.raises(ValueError) as err:
        piped(params, torch.ones(2, 3, 3, dtype=DT))
    msg = str(err.value)
    assert "reads the value of a tensor it did not receive as an argument" in msg
    assert f"{__file__}:" in msg and "torch.arange(self.length, self.length + x.shape[1])" in msg


def test_a_number_read_from_a_global_tensor_is_refused_and_from_its_own_tensor_allowed():
    scale = torch.tensor(2.0, dtype=DT)

    def captured(w, x):
        return (x @ w).sum() * float(scale + 1)

    def own(w, x):
        return (x @ w).sum() * float(torch.tensor(2.0) + 1)

    w, x = torch.eye(3, dtype=DT), torch.ones(4, 3, dtype=DT)
    with pytest.raises(ValueError, match="reads the value of a tensor it did not receive"):
        fpipe.pipeline(captured, microbatches=2)(w, x)
    assert float(fpipe.pipeline(own, microbatches=2)(w, x)) == float(own(w, x)) == 36.0


def test_a_captured_tensor_used_as_a_tensor_is_read_at_every_call():
    counter = torch.tensor(1.0, dtype=DT)

    def f(w, x):
        return (fpipe.stage_boundary(x @ w) * counter).sum()

    w, x = torch.eye(3, dtype=DT), torch.ones(2, 3, dtype=DT)
    piped = fpipe.pipeline(f, microbatches=1)
    assert float(piped(w, x)) == 6.0
    counter.add_(1)
    assert float(piped(w, x)) == float(f(w, x)) == 12.0


class _ScaledByCount(torch.nn.Module):
    """A buffer the forward advances, then reads, on stage 0; the value is used on stage 1,
    passed through the boundary or read directly."""

    def __init__(self, through: bool) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4).to(DT)
        self.register_buffer("count", torch.zeros((), dtype=DT))
        self.through = through

    def forward(self, x):
        self.count.add_(1.0)
        scale = self.count * 2.0
        if self.through:
            h, scale = fpipe.stage_boundary((torch.tanh(self.a(x)), scale))
        else:
            h = fpipe.stage_boundary(torch.tanh(self.a(x)))
        return (h * scale).sum()


@pytest.mark.parametrize("through", [True, False])
def test_a_value_computed_from_a_written_buffer_is_computed_once_before_the_write(through):
    """A later stage used to recompute `count * 2` from the buffer after stage 0 had advanced it:
    twice the loss and gradients, no error (`through=False` since the first split; `True` with
    the boundary's identity on parameter-only values)."""
    torch.manual_seed(0)
    model = _ScaledByCount(through)
    ref = copy.deepcopy(model)
    fn, params = fpipe.functionalize(model)
    x = torch.randn(8, 4, dtype=DT, generator=torch.Generator().manual_seed(1))
    loss, grads = fpipe.value_and_grad(fpipe.pipeline(fn, microbatches=1, out_axes="sum"))(params, x)
    ref_loss = ref(x)
    ref_loss.backward()
    assert_trees_close((loss, grads["a.bias"], model.count), (ref_loss.detach(), ref.a.bias.grad, ref.count))


def test_a_checkpointed_region_is_recomputed_in_the_backward():
    """torch.utils.checkpoint inside the function: exact gradients, no warning, and the
    region's saved value is recomputed in stage 0's backward rather than kept. It was accepted
    in silence, as if it saved memory, then warned that nothing was recomputed."""
    import torch.utils.checkpoint as checkpoint

    def f(w, x):
        h = checkpoint.checkpoint(lambda a: torch.tanh(a @ w), x, use_reentrant=False)
        return (fpipe.stage_boundary(h) @ w).pow(2).mean()

    def same(w, x):  # torch.func refuses saved-tensor hooks: the reference without the checkpoint
        return (fpipe.stage_boundary(torch.tanh(x @ w)) @ w).pow(2).mean()

    w = torch.randn(3, 3, dtype=DT, generator=torch.Generator().manual_seed(0))
    x = torch.randn(4, 3, dtype=DT, generator=torch.Generator().manual_seed(1))
    piped = fpipe.pipeline(f, microbatches=2)
    loss, grad = fpipe.value_and_grad(piped)(w, x)  # filterwarnings=error: no warning
    ref_grad, ref_loss = torch.func.grad_and_value(same)(w, x)
    assert_trees_close((loss, grad), (ref_loss, ref_grad))

    def b0_ops(p):
        return {n.target for n in p._last.staged.programs["B", 0].gm.graph.nodes}

    plain = fpipe.pipeline(same, microbatches=2)
    fpipe.value_and_grad(plain)(w, x)
    tanh = torch.ops.aten.tanh.default
    assert tanh in b0_ops(piped) and tanh not in b0_ops(plain)  # recomputed, not read


def test_other_saved_tensor_hooks_warn_that_nothing_is_offloaded():
    """A saved-tensor hook that is no checkpoint (offloading to the host) never runs in fpipe's
    programs: a warning says so."""

    def f(w, x):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            h = torch.tanh(x @ w)
        return (fpipe.stage_boundary(h) @ w).pow(2).mean()

    w = torch.randn(3, 3, dtype=DT, generator=torch.Generator().manual_seed(0))
    x = torch.randn(4, 3, dtype=DT, generator=torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match="runs saved-tensor hooks .* no memory is saved"):
        loss, grad = fpipe.value_and_grad(fpipe.pipeline(f, microbatches=2))(w, x)
    ref_grad, ref_loss = torch.func.grad_and_value(lambda w, x: (torch.tanh(x @ w) @ w).pow(2).mean())(w, x)
    assert_trees_close((loss, grad), (ref_loss, ref_grad))
