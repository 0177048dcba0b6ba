"""Launching kvq's Triton kernels with little host time: one build per constants and argument kinds, called through
its own launcher (kvq.kernels.triton_decode's and triton_quantize's kernels run per layer per decode step)."""

import torch

_compiled: dict[tuple, object] = {}


def _argument_key(argument):
    if isinstance(argument, tuple):  # an int in a tuple keys by what Triton could specialize it on
        return tuple((a == 1, a % 16 == 0) if isinstance(a, int) else _argument_key(a) for a in argument)
    if isinstance(argument, torch.Tensor):
        return argument.dtype, argument.data_ptr() % 16 == 0
    return type(argument)


def compiled_kernel(kernel, args: tuple, constants: dict):
    """The Triton build of kernel(*args, **constants), compiled and loaded on first use.

    Triton's dispatch binds and specializes every argument again on each call, host time that decode
    pays per layer per token. These kernels take no integer specialization (do_not_specialize), so what
    selects a build is the constants and each tensor's dtype and 16-byte alignment, which is the key here.
    """
    device = next(t for t in _tensors(args)).device
    key = (kernel, tuple(_argument_key(a) for a in args), tuple(constants.items()), device)
    compiled = _compiled.get(key)
    if compiled is None:
        compiled = kernel.warmup(*args, grid=(1,), **constants)
        compiled._init_handles()  # loads the binary, which gives n_regs (as Triton's softmax tutorial does)
        _compiled[key] = compiled
    return compiled


def _tensors(args):
    for argument in args:
        if isinstance(argument, tuple):
            yield from _tensors(argument)
        elif isinstance(argument, torch.Tensor):
            yield argument


def launch(kernel, grid: tuple, args: tuple, build=None, **constants) -> None:
    """kernel[grid](*args, **constants) through the build's own launcher (see compiled_kernel); `build`:
    that build, where the caller has it already."""
    params = [constants[name] for name in kernel.arg_names[len(args):]]
    (build or compiled_kernel(kernel, args, constants))[(*grid, 1, 1)[:3]](*args, *params)
