"""What densematch's PyTorch operators share: a vmap rule by batch item, and the boundary that
reads settings once per graph."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

__all__ = [
    "call",
    "differentiable",
    "looped",
    "operator",
    "plain",
    "read_once",
    "recording",
    "refuse_legacy_onnx",
    "transformed",
]

if TYPE_CHECKING:
    from torch._library.custom_ops import CustomOpDef

F = TypeVar("F", bound=Callable[..., Any])

# each operator's own Python function, which plain eager calls run directly (:func:`call`)
_FUNCTIONS: dict[Any, Callable[..., Any]] = {}


def operator(name: str, schema: str) -> Callable[[Callable[..., Any]], CustomOpDef]:
    """``torch.library.custom_op(name, schema=schema)`` (no argument mutated), with the
    decorated function kept for :func:`call`."""

    def register(fn: Callable[..., Any]) -> CustomOpDef:
        op = torch.library.custom_op(name, mutates_args=(), schema=schema)(fn)
        _FUNCTIONS[op] = fn
        return op

    return register


def transformed() -> bool:
    """Whether this thread's calls are transformed: a graph recorded (:func:`recording`), a torch
    dispatch mode (such as FakeTensorMode) or a torch.func transform."""
    return recording() or is_in_torch_dispatch_mode() or torch._C._functorch.peek_interpreter_stack() is not None


def plain(args: tuple[Any, ...]) -> bool:
    """Whether a call on ``args`` is plain eager: not :func:`transformed`, and every tensor a
    torch.Tensor itself (no subclass, no functorch wrapper)."""
    if transformed():
        return False
    return all(
        type(a) is torch.Tensor and not torch._C._functorch.is_functorch_wrapped_tensor(a)
        for a in args
        if isinstance(a, torch.Tensor)
    )


def call(op: Any, *args: Any) -> Any:
    """``op(*args)``; a plain eager call (:func:`plain`) runs the operator's function itself:
    the dispatcher would add nothing there, and an operator's first call imports torch._dynamo
    (2-3 s on a 2-core CPU)."""
    fn = _FUNCTIONS.get(op)
    return fn(*args) if fn is not None and plain(args) else op(*args)


def read_once(fn: F) -> F:
    """``fn`` marked as :func:`torch.compiler.assume_constant_result` marks it: under
    torch.compile and torch.export it runs when the graph is made, and its result is kept in the
    graph as a constant. For the settings a public function resolves (budget, precision, kernel)
    from ContextVars, the environment and the device's free memory: Python that Dynamo cannot
    trace. The mark is set here because torch's function imports torch._dynamo (2 s) to set it;
    tests/operators/test_compile.py checks that it is the mark torch sets."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def looped(op: Callable[..., Any], in_dims: tuple[int | None, ...], args: tuple[Any, ...]) -> tuple[Any, Any]:
    """A vmap rule that runs ``op`` once per batch item and stacks each output along dimension
    0: for batched arguments no cheaper rule covers."""
    # a list argument's in_dims is a list of Nones: only an int marks a batched tensor
    dims = [dim if isinstance(dim, int) else None for dim in in_dims]
    size = next(a.shape[dim] for a, dim in zip(args, dims, strict=True) if dim is not None)
    outs = [
        op(*(a if dim is None else a.select(dim, i) for a, dim in zip(args, dims, strict=True))) for i in range(size)
    ]
    if isinstance(outs[0], tuple):
        return tuple(torch.stack(parts) for parts in zip(*outs, strict=True)), (0,) * len(outs[0])
    return torch.stack(outs), 0


def differentiable(
    op: Any,
    backward_op: Any,
    setup_context: Callable[[Any, tuple[Any, ...], Any], None],
    gradients: Callable[..., tuple[Any, ...]],
    what: str,
) -> type[torch.autograd.Function]:
    """Register ``op``'s derivative and return the autograd.Function that eager calls use.

    ``gradients(ctx, grads, backward)`` turns the output gradients into the input gradients by
    calling ``backward`` as ``backward_op`` is called. The op gets it through
    ``register_autograd`` (for recorded graphs: torch.jit.trace keeps the op with its derivative);
    the returned Function runs the same op and the same step, and is what torch.func.grad,
    jacrev and vmap of a gradient accept: the autograd ``register_autograd`` builds has no
    ``setup_context`` of its own, which they refuse (pytorch/pytorch#168393). The backward is
    differentiable no further: a second derivative raises one NotImplementedError naming
    ``what``. Both Functions are vmapped through the ops' own vmap rules."""

    def no_second_order(ctx: Any, *grads: Any) -> tuple[None, ...]:
        raise NotImplementedError(
            f"{what} is differentiable once: its backward has no derivative of its own (as torch.cdist's); "
            "for second-order terms compute it with torch operators"
        )

    class Backward(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(*args: Any) -> Any:
            with torch.no_grad():
                return call(backward_op, *args)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            pass

        backward = staticmethod(no_second_order)

    class Forward(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(*args: Any) -> Any:
            with torch.no_grad():  # the op's own autograd stays out: this Function is the derivative
                return call(op, *args)

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
            return gradients(ctx, grads, Backward.apply)

    Forward.setup_context = staticmethod(setup_context)  # type: ignore[assignment]
    op.register_autograd(lambda ctx, *grads: gradients(ctx, grads, backward_op), setup_context=setup_context)
    backward_op.register_autograd(no_second_order, setup_context=lambda ctx, inputs, output: None)
    return Forward


def recording() -> bool:
    """Whether a graph is being recorded (torch.compile's and torch.export's Dynamo, or
    torch.jit.trace): a Python branch on the data would be fixed in it, not kept."""
    return torch.compiler.is_compiling() or torch._C._get_tracing_state() is not None


def refuse_legacy_onnx(what: str) -> None:
    """Raise a RuntimeError naming ``what`` under torch.onnx's TorchScript exporter
    (``dynamo=False``), which has no translation of densematch's operators."""
    if torch._C._get_tracing_state() is not None and torch.onnx.is_in_onnx_export():
        raise RuntimeError(
            f"{what} cannot be exported by torch.onnx.export(..., dynamo=False): the TorchScript exporter has "
            "no translation of densematch's operators; export with torch.export.export, pass the program "
            "through densematch.onnx.decompose, then torch.onnx.export(program, dynamo=True) (docs/compile.md)"
        )
