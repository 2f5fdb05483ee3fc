"""What one training step's graph calls were: their order, their inputs'
storage identities (to tell an input handed to several calls from a fresh
one), and the parameters a sharding gathered for them."""
from __future__ import annotations

import dataclasses
import weakref

import torch

from partitioners.rank_sync import world_size


class InputIdentities:
    """Names the tensors handed to a step's calls, to tell one handed to
    several calls from a fresh one each time: the same live storage, offset
    and shape get the same name; memory freed and allocated again (a block's
    input it did not save) gets a new one. Parameters are not named (never
    a batch input).

    Held weakly by the tensor first seen at an address (a storage weak
    reference, kept across Inductor's backward compile, crashed the
    process in it): a new tensor at the address of a dead one starts a new
    generation, which at worst names a repeated input as fresh (its bytes
    are then counted per call, never too few)."""

    def __init__(self):
        self._storages: dict[int, tuple[object, int]] = {}  # address -> (weak reference, generation)

    def of(self, value) -> tuple | None:
        if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
            return None
        try:
            storage = value.untyped_storage()
            address = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # a tensor without storage
            return None
        known = self._storages.get(address)
        if known is None or known[0]() is None:
            known = (weakref.ref(value), 0 if known is None else known[1] + 1)
            self._storages[address] = known
        return (address, known[1], value.storage_offset(), tuple(value.shape))


@dataclasses.dataclass
class Calls:
    """The training calls of the running step, in order."""

    keys: list[str] = dataclasses.field(default_factory=list)
    inputs: list[tuple] = dataclasses.field(default_factory=list)
    """Per call, its inputs' storage identities."""
    ran: set[tuple[str, tuple]] = dataclasses.field(default_factory=set)
    """The graphs called, each with what its plan was made for."""
    below_plan: bool = False
    """A call ran below the sizes its plan was made for."""
    identities: InputIdentities = dataclasses.field(default_factory=InputIdentities)
    parameters: list[tuple] = dataclasses.field(default_factory=list)
    """Per call, its parameters: (weak reference, bytes)."""

    def record(self, key: str, args, planned_for: tuple, at_planned_sizes: bool) -> None:
        self.keys.append(key)
        self.inputs.append(tuple(map(self.identities.of, args)))
        self.parameters.append(tuple(
            (weakref.ref(arg), arg.numel() * arg.element_size()) for arg in args if has_storage(arg, parameter=True)
        ))
        self.ran.add((key, planned_for))
        self.below_plan |= not at_planned_sizes


    def freed_parameters(self) -> tuple[int, ...]:
        """Per call, the bytes of its parameters whose memory is freed now,
        the step ended: parameters a sharding (FSDP) gathered for the step."""
        return tuple(
            sum(nbytes for ref, nbytes in parameters if (p := ref()) is not None and p.untyped_storage().nbytes() == 0)
            for parameters in self.parameters
        )


def has_storage(value, parameter: bool = False) -> bool:
    """``value`` is a tensor with a storage of its own (not a tensor
    subclass such as DTensor, nor a fake or meta tensor); with
    ``parameter``, an ``nn.Parameter``."""
    if not isinstance(value, torch.nn.Parameter if parameter else torch.Tensor):
        return False
    try:
        return value.device.type != "meta" and value.untyped_storage() is not None
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def first_requiring_grad(outputs):
    stack = [outputs]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return value
        elif isinstance(value, (list, tuple)):
            stack.extend(reversed(value))
    return None


def shard_group_size() -> int:
    """The ranks a gathered parameter is sharded over: the world (FSDP2 over
    one mesh dimension; a hybrid sharding's smaller group keeps more)."""
    return world_size()
