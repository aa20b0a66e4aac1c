"""Kernels as every runtime sees them: a program (a compiled image per compute capability, and the Python reference of
each kernel for the emulator) and typed launch arguments.

Pointer arguments are ``DeviceAddress`` values of the launch device and nothing else, so a CPU address cannot reach a
kernel; each runtime turns arguments into what it needs (C parameter bytes for CUDA, Python values for the emulator)
with the same device check.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Union

from kvtier.address import DeviceAddress
from kvtier.errors import AddressDomainError, WrongDeviceError


class Scalar(NamedTuple):
    """A kernel scalar argument: a ``struct`` format character ('i' int32, 'q' int64, 'Q' uint64) and its value."""

    format: str
    value: int


def i32(value: int) -> Scalar:
    return Scalar("i", int(value))


def i64(value: int) -> Scalar:
    return Scalar("q", int(value))


#: A kernel argument: a device address (a pointer), a scalar, or a tuple of them (a C struct passed by value).
KernelArg = Union[DeviceAddress, Scalar, tuple]


def pack_argument(arg: KernelArg, device: int) -> bytes:
    """The bytes of one kernel parameter, C layout; pointers must be addresses of ``device``."""
    if type(arg) is Scalar:
        return struct.pack("<" + arg.format, arg.value)
    if type(arg) is DeviceAddress:
        if arg.device != device:
            raise WrongDeviceError(f"kernel operand {arg} is not an address of device {device}")
        return struct.pack("<Q", arg.value)
    if isinstance(arg, tuple):
        fields = [pack_argument(member, device) for member in arg]
        out = b""
        for piece in fields:
            out += bytes(-len(out) % len(piece)) + piece
        return out + bytes(-len(out) % 8)
    raise AddressDomainError(f"kernel argument {arg!r} must be a DeviceAddress, a Scalar or a struct tuple; raw "
                             f"integers cannot be kernel operands")


def pack_parameters(args: Sequence[KernelArg], device: int) -> tuple[bytes, list[int]]:
    """All parameters of a launch in one buffer, each 8-byte aligned, and the offset of each: the driver takes an
    array of pointers into it (one allocation per launch, not one per parameter)."""
    blob, offsets = bytearray(), []
    for arg in args:
        blob += bytes(-len(blob) % 8)
        offsets.append(len(blob))
        blob += pack_argument(arg, device)
    return bytes(blob), offsets


def argument_values(arg: KernelArg, device: int) -> Any:
    """The Python values a reference kernel receives for one argument, with the same device check as packing."""
    if isinstance(arg, tuple) and not isinstance(arg, Scalar):
        return tuple(argument_values(member, device) for member in arg)
    pack_argument(arg, device)
    return arg.value


@dataclass(frozen=True)
class ProgramSpec:
    """A set of kernels as every runtime needs it: a compiled image for a compiler target (``sm_90``, ``gfx942``)
    and the Python reference of each kernel (the emulator). ``key`` identifies the build: a runtime loads a key once per
    device and keeps it for its lifetime, so engines share modules instead of loading one each."""

    key: str
    names: tuple[str, ...]
    image: Callable[[str], tuple[bytes, str]]
    reference: Mapping[str, Callable[..., Any]] = field(default_factory=dict)


class Program:
    """A program loaded on one device; ``origin`` says where its code came from (aot/jit/reference)."""

    device: int
    origin: str
    spec: ProgramSpec
