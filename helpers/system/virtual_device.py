"""A second device on a machine that has only a CPU, so that device placement is checked where no GPU is.

A notebook written on a laptop runs every tensor on the CPU, so a tensor it forgets to move to `DEVICE` (a
validation window, a prompt, a KV cache, a random generator) goes unnoticed until a learner opens it on a GPU,
where it stops with "Expected all tensors to be on the same device". `virtual_accelerator()` makes that mistake
fail on the CPU: inside it, `"cpu:0"` (`ACCELERATOR`) is a device of its own. Tensors moved or created there
compute on the CPU but report `cpu:0`, and an operation that mixes them with tensors of the plain `"cpu"`, or
draws for them from a generator made for the plain `"cpu"`, raises as CUDA would. The code paths stay the CPU's
(`device.type` is `"cpu"`), so what it checks is placement, not CUDA's kernels.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

ACCELERATOR = torch.device("cpu", 0)

# Operations that CUDA runs with host tensors among their inputs: copies between devices, and indexing with host
# indices (CUDA copies the indices over).
MIXED_DEVICES_ALLOWED = {"aten::copy_", "aten::_to_copy", "aten::copy", "aten::index", "aten::index_put_",
                         "aten::index_put", "aten::_index_put_impl_", "aten::_copy_from"}


class PlacementError(RuntimeError):
    """What CUDA would have raised: tensors on two devices in one operation, or a generator of the wrong one."""


def on_accelerator(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.device == ACCELERATOR


def _is_accelerator(device: object) -> bool:
    return device is not None and torch.device(device) == ACCELERATOR


class _AcceleratorTensor(torch.Tensor):
    """A tensor on ACCELERATOR: a CPU tensor (`host`) behind a wrapper that reports the other device."""

    host: torch.Tensor

    @staticmethod
    def __new__(cls, host: torch.Tensor) -> _AcceleratorTensor:
        return torch.Tensor._make_wrapper_subclass(
            cls, host.shape, strides=host.stride(), storage_offset=host.storage_offset(), dtype=host.dtype,
            layout=host.layout, device=ACCELERATOR, requires_grad=host.requires_grad)

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host

    def __repr__(self) -> str:
        return f"{self.host!r} on {ACCELERATOR}"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return NotImplemented  # every operation goes through _Placement, which is active whenever these exist


class Generator(torch.Generator):
    """`torch.Generator` that remembers the device it was made for (a CPU generator forgets an index)."""

    def __new__(cls, device: torch.device | str | int = "cpu") -> Generator:
        made_for = torch.device(device)
        generator = super().__new__(cls, "cpu" if made_for.type == "cpu" else made_for)
        generator.made_for = made_for
        return generator

    def __init__(self, device: torch.device | str | int = "cpu") -> None:
        pass


def _check_generator(name: str, args: tuple, kwargs: dict) -> None:
    generator = kwargs.get("generator")
    if generator is None:
        return
    flat, _ = tree_flatten((args, kwargs))
    for_accelerator = any(on_accelerator(t) for t in flat) or _is_accelerator(kwargs.get("device"))
    if for_accelerator and getattr(generator, "made_for", None) != ACCELERATOR:
        raise PlacementError(f"{name}: a generator made for the CPU draws for tensors on {ACCELERATOR} (on a GPU: "
                             "\"Expected a 'cuda' device type for generator\"); make it with torch.Generator(DEVICE)")


class _Factories(TorchFunctionMode):
    """Sees what the dispatcher does not: `torch.tensor(..., device=...)` copies its data without a dispatched
    operation, and a generator's Python object (the dispatcher gets a C++ one that forgot its device)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _check_generator(getattr(func, "__name__", str(func)), args, kwargs)
        if func in (torch.tensor, torch.as_tensor) and _is_accelerator(kwargs.get("device")):
            return func(*args, **{**kwargs, "device": "cpu"}).to(ACCELERATOR)
        if func in (torch.Tensor.tolist, torch.Tensor.__format__) and on_accelerator(args[0]):  # as from CUDA
            return func(_host(args[0]), *args[1:], **kwargs)
        if func is torch.Tensor.untyped_storage and on_accelerator(args[0]):  # its bytes, for memory accounting
            return _host(args[0]).untyped_storage()
        if func in (torch.Tensor.numpy, torch.Tensor.__array__) and on_accelerator(args[0]):
            raise PlacementError(f"numpy() of a tensor on {ACCELERATOR} (on a GPU: \"can't convert cuda:0 device "
                                 "type tensor to numpy\"); copy it to the CPU first with .cpu()")
        return func(*args, **kwargs)


class _Placement(TorchDispatchMode):
    """Runs every operation on the CPU tensors behind the accelerator's, after CUDA's placement rules."""

    supports_higher_order_operators = True  # FlexAttention's operator, say, gets here with its tensors

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name, writes, aliases = _schema_of(func)
        tensors = list(_tensors(args, kwargs.values())) if name else \
            [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]  # nested: a HOP's
        accelerated = [t for t in tensors if t.device == ACCELERATOR]
        if accelerated and name not in MIXED_DEVICES_ALLOWED:
            host = next((t for t in tensors if t.device != ACCELERATOR and t.dim() > 0), None)  # 0-d: a scalar
            if host is not None:
                raise PlacementError(
                    f"{name}: a tensor on the CPU {tuple(host.shape)} {host.dtype} meets one on {ACCELERATOR} "
                    f"{tuple(accelerated[0].shape)} (on a GPU: \"Expected all tensors to be on the same device\"); "
                    "move it with .to(DEVICE) or create it with device=DEVICE")
        if "device" in kwargs:  # a factory, or a copy to another device
            to_accelerator = _is_accelerator(kwargs["device"])
            if to_accelerator:
                kwargs = {**kwargs, "device": torch.device("cpu")}
        else:
            to_accelerator = bool(accelerated)
        written = kwargs.get("out", args[0] if args else None)
        if accelerated:
            args, kwargs = (tree_map(_host, args), tree_map(_host, kwargs)) if not name else \
                (_map(_host, args), {key: _map(_host, value) for key, value in kwargs.items()})
        unwrapped = func(*args, **kwargs)
        if not to_accelerator:
            return unwrapped
        if unwrapped is written and not accelerated and not writes:  # aten::to, in inference mode: a copy to move
            unwrapped = unwrapped.clone()
        if writes:
            return written  # in place: the caller's tensor, on the device it was
        if not torch.is_inference_mode_enabled():
            return _map(_AcceleratorTensor, unwrapped)
        # a view shares its base's version counter, which a tensor made in inference mode cannot
        with torch.inference_mode(not (aliases and accelerated and not accelerated[0].is_inference())):
            return _map(_AcceleratorTensor, unwrapped)


_SCHEMAS: dict = {}


def _schema_of(func) -> tuple[str | None, bool, bool]:
    """(name, writes its first input, returns a view of it) of an operator; no name for a higher-order one."""
    if func not in _SCHEMAS:
        schema = getattr(func, "_schema", None)
        alias = schema.returns[0].alias_info if schema is not None and schema.returns else None
        _SCHEMAS[func] = (schema.name if schema is not None else None, alias is not None and alias.is_write,
                          alias is not None)
    return _SCHEMAS[func]


def _tensors(*groups):
    """The tensors among an operator's arguments: each given directly or in a list."""
    for group in groups:
        for value in group:
            if isinstance(value, torch.Tensor):
                yield value
            elif isinstance(value, (list, tuple)):
                yield from (v for v in value if isinstance(v, torch.Tensor))


def _map(fn, value):
    """fn of each tensor in `value`, a tensor or a (nested) list or tuple of them; other values as they are."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        mapped = [_map(fn, v) for v in value]
        return type(value)(*mapped) if hasattr(value, "_fields") else type(value)(mapped)  # a named tuple
    return value


def _host(value: object) -> object:
    return value.host if isinstance(value, _AcceleratorTensor) else value


class _Autocast(torch.autocast):
    """Autocast takes a device type; the accelerator's is the CPU's."""

    def __init__(self, device_type: str, *args, **kwargs) -> None:
        super().__init__("cpu" if _is_accelerator(device_type) else device_type, *args, **kwargs)


def _save(obj: object, *args, **kwargs) -> None:
    """torch.save of the tensors behind the accelerator's: a file as a GPU's would hold, loadable anywhere."""
    _ORIGINAL["save"](tree_map(_host, obj), *args, **kwargs)


def _load(*args, map_location=None, **kwargs) -> object:
    if not _is_accelerator(map_location):
        return _ORIGINAL["load"](*args, map_location=map_location, **kwargs)
    loaded = _ORIGINAL["load"](*args, map_location="cpu", **kwargs)
    return tree_map(lambda t: t.to(ACCELERATOR) if isinstance(t, torch.Tensor) else t, loaded)


_ORIGINAL = {"Generator": torch.Generator, "autocast": torch.autocast, "save": torch.save, "load": torch.load}
_STANDINS = {"Generator": Generator, "autocast": _Autocast, "save": _save, "load": _load}


@contextlib.contextmanager
def virtual_accelerator() -> Iterator[torch.device]:
    """Inside: ACCELERATOR ("cpu:0") is a device of its own. `torch.Generator` remembers its device; autocast,
    torch.save and torch.load take the accelerator as they take a GPU. Yields the accelerator."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    # module.to(device) swaps each parameter for its copy (rather than assigning .data, which would keep a plain
    # Parameter around a wrapper it cannot reach into)
    torch.__future__.set_swap_module_params_on_conversion(True)
    for name, standin in _STANDINS.items():
        setattr(torch, name, standin)
    try:
        with _Placement(), _Factories():
            yield ACCELERATOR
    finally:
        for name, original in _ORIGINAL.items():
            setattr(torch, name, original)
        torch.__future__.set_swap_module_params_on_conversion(swap)
