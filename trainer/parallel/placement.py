"""Where a model's weights come from when the trainer places it, one part at a time so that no process ever holds
the whole model on its device (docs/sharded.md): built on ``meta`` (each module initialised by the model's own
initialisation under a seed of its own, drawn from ``seed`` and its name: the same weights on any process count,
DDP or FSDP2), or the first process's, sent tensor by tensor to the others (any way a user builds a model,
``from_pretrained`` with ``fsdp_cpu_ram_efficient_loading`` included).
"""

from __future__ import annotations

import zlib
from typing import Callable, Iterator, Optional

import torch

from trainer.errors import ShardingError

META = torch.device("meta")


def built_on_meta(model: torch.nn.Module) -> bool:
    """Whether every parameter of ``model`` is on the meta device (only its shapes exist)."""
    parameters = list(model.parameters())
    return bool(parameters) and all(p.device == META for p in parameters)


def to_upcast(model: torch.nn.Module) -> dict[int, str]:
    """The trainable parameters of a precision below fp32, by id, with their names: they get fp32 master weights
    (AdamW state in bf16 stalls training without an error; fp16 weights cannot be unscaled)."""
    return {id(p): name for name, p in model.named_parameters() if p.requires_grad and p.dtype != torch.float32}


def upcast_words(names: list[str]) -> str:
    """The banner's words for ``names`` upcast ('' for none)."""
    return f"{len(names)} low-precision trainable tensors upcast to fp32 masters" if names else ""


def region(module: torch.nn.Module, done: set[int]) -> list[torch.nn.Module]:
    """``module`` and its submodules, children before parents (the order ``model.apply`` initialises in), without
    those inside a part already placed (``done``: ids of modules)."""
    found: list[torch.nn.Module] = []

    def visit(current: torch.nn.Module) -> None:
        for child in current.children():
            if id(child) not in done:
                visit(child)
        found.append(current)

    visit(module)
    return found


def _slots(modules: list[torch.nn.Module]) -> Iterator[tuple[torch.nn.Module, str, str, torch.Tensor]]:
    """(module, attribute, "_parameters" or "_buffers", tensor) for every tensor the modules hold directly."""
    for module in modules:
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(module, kind).items():
                if tensor is not None:
                    yield module, name, kind, tensor


# (new tensor, the one it replaces): fills it.
Source = Optional[Callable[[torch.Tensor, torch.Tensor], None]]


def fill(modules: list[torch.nn.Module], device: torch.device, source: Source, *, upcast: set[int]) -> None:
    """Give every tensor the modules hold a new whole copy on ``device`` (fp32 for the ``upcast`` ones), filled by
    ``source`` (None: left for ``initialise``); a tensor held under two names (tied weights) stays one."""
    made: dict[int, torch.Tensor] = {}
    for module, name, kind, tensor in list(_slots(modules)):
        if id(tensor) not in made:
            dtype = torch.float32 if id(tensor) in upcast else tensor.dtype
            new = torch.empty(tensor.shape, dtype=dtype, device=device)
            if source is not None:
                source(new, tensor)
            # Left for initialise: NaN until written, so that one it leaves unwritten is found by name.
            elif new.is_floating_point():
                new.fill_(float("nan"))
            if kind == "_parameters":
                new = torch.nn.Parameter(new, requires_grad=tensor.requires_grad)
            made[id(tensor)] = new
        getattr(module, kind)[name] = made[id(tensor)]


def from_first_process(rank: int, world_size: int) -> Source:
    """A ``fill`` source: the first process's own tensor, sent to every other process."""

    def source(new: torch.Tensor, mine: torch.Tensor) -> None:
        if rank == 0:
            new.copy_(mine.detach())
        if world_size > 1:
            torch.distributed.broadcast(new, src=0)

    return source


def initialise(model: torch.nn.Module, modules: list[torch.nn.Module], seed: int, *, device: torch.device) -> None:
    """The model's own initialisation of ``modules`` (just filled, children first), each under a seed of its own:
    the same numbers on every process, whatever their number. A transformers model's ``_init_weights`` per module;
    any other model's modules their ``reset_parameters()``, then its ``_init_weights`` where it has one (nanoGPT's).
    A tensor none of them wrote is refused by name."""
    own = getattr(model, "_init_weights", None)
    by_transformers = any(kind.__name__ == "PreTrainedModel" for kind in type(model).__mro__)
    forked = [device] if device.type == "cuda" else []
    names = {id(module): name.replace("_checkpoint_wrapped_module.", "") for name, module in model.named_modules()}
    for module in modules:
        # The module's name in the whole model, wherever its part starts.
        name = names[id(module)]
        holds = any(t is not None for t in (*module._parameters.values(), *module._buffers.values()))
        if not by_transformers and not holds:
            continue
        if own is None and not hasattr(module, "reset_parameters"):
            raise ShardingError(
                f"the model was built on the meta device, and its module {name or '(root)'} "
                f"({type(module).__name__}) holds tensors but has no reset_parameters() to "
                "initialise them: give it one, or build the model on the CPU"
            )
        with torch.random.fork_rng(devices=forked, device_type=device.type):
            torch.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            try:
                with torch.no_grad():
                    if not by_transformers and hasattr(module, "reset_parameters"):
                        module.reset_parameters()
                    if own is not None:
                        own(module)
            # A user's initialisation, or a config's value it takes (a NaN initializer_range): named, in one line.
            except Exception as err:
                raise ShardingError(
                    f"the model was built on the meta device, and the initialisation of its module {name or '(root)'} "
                    f"({type(module).__name__}) raised {type(err).__name__}: {' '.join(str(err).split())[:300]}"
                ) from err
    floating = [(module, attribute, t) for module, attribute, _, t in _slots(modules) if t.is_floating_point()]
    # One host read for them all (on a GPU each would wait for the device).
    nan = torch.stack([t.isnan().any() for *_, t in floating]).tolist() if floating else []
    unwritten = [
        f"{names[id(m)]}.{attribute}".lstrip(".") for (m, attribute, _), bad in zip(floating, nan, strict=True) if bad
    ]
    if unwritten:
        raise ShardingError(
            f"the model was built on the meta device, and its initialisation (each module's reset_parameters(), "
            f"then the model's _init_weights) left {', '.join(unwritten[:3])}{', ...' if len(unwritten) > 3 else ''} "
            "unwritten or NaN: initialise it there, or build the model on the CPU"
        )


FROM_META, FROM_FIRST = "meta", "first process"


class Placement:
    """How this job places ``model``: from meta or from the first process's weights (the first process's answer,
    on every process), with its low-precision trainable tensors upcast to fp32 masters."""

    def __init__(self, model: torch.nn.Module, *, device: torch.device, seed: int):
        joined = torch.distributed.is_initialized()
        rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if joined else (0, 1)
        self.start = first_process_says(how_to_start(model), world)
        if self.start not in (FROM_META, FROM_FIRST):
            raise ShardingError(self.start)
        self.model, self.device, self.seed = model, device, seed
        self.upcast = to_upcast(model)
        self.source = None if self.start == FROM_META else from_first_process(rank, world)

    @property
    def built_on_meta(self) -> bool:
        return self.start == FROM_META

    def place(self, modules: list[torch.nn.Module]) -> None:
        """``modules``' tensors whole on the device: the first process's, or initialised."""
        fill(modules, self.device, source=self.source, upcast=set(self.upcast))
        if self.start == FROM_META:
            initialise(self.model, modules, seed=self.seed, device=self.device)


def how_to_start(model: torch.nn.Module) -> str:
    """This process's model as a starting point: built on meta, or weights the first process sends; a first process
    with some weights on meta gets the refusal's text."""
    if built_on_meta(model):
        return FROM_META
    missing = [name for name, p in model.named_parameters() if p.device == META]
    if missing:
        return (
            f"{len(missing)} parameter(s) of the model are on the meta device on the first process "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}), which sends every process its "
            "weights: build the model wholly on meta, or wholly on a device"
        )
    return FROM_FIRST


def whole_on_device(model: torch.nn.Module, device: torch.device, seed: int) -> list[str]:
    """A model for DDP, whole on ``device`` with fp32 master weights (AdamW state in bf16 stalls training without an
    error; fp16 weights cannot be unscaled); one built on meta is initialised as a sharded one is. Returns the names
    upcast. (DDP itself sends every process the first one's weights as it wraps the model.)"""
    upcast = to_upcast(model)
    if built_on_meta(model):
        modules = region(model, set())
        fill(modules, device, source=None, upcast=set(upcast))
        initialise(model, modules, seed=seed, device=device)
        return list(upcast.values())
    for parameter in model.parameters():
        if id(parameter) in upcast:
            parameter.data = parameter.data.float()
    model.to(device)
    return list(upcast.values())


def first_process_says(value: object, world_size: int) -> object:
    """The first process's ``value``, on every process (so that they all take the same path)."""
    if world_size == 1:
        return value
    said = [value]
    torch.distributed.broadcast_object_list(said, src=0)
    return said[0]
