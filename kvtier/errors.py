"""Every exception kvtier raises on purpose, in one place.

Callers catch :class:`KvtierError` for anything kvtier refused; the subclasses say which rule was broken, so an
engine can tell "this buffer is pageable" from "the driver failed" without parsing messages.
"""

from __future__ import annotations


class KvtierError(Exception):
    """Base class of kvtier's own errors."""


def about(error: KvtierError, what: str) -> KvtierError:
    """``error`` again, of its own class and with its fields, its message led by ``what`` (the operand it concerns).
    Rebuilt without calling the class, whose constructor may want more than a message."""
    named = type(error).__new__(type(error))
    named.__dict__.update(error.__dict__)
    named.args = (f"{what}: {error}",)
    return named


class RuntimeUnavailable(KvtierError):
    """The requested runtime cannot be used on this machine (no driver, no GPU, unknown name)."""


class RuntimeCallError(KvtierError):
    """A native runtime call failed; the message names the call and the error."""

    def __init__(self, call: str, error: str, detail: str = "") -> None:
        self.call, self.error = call, error
        super().__init__(f"{call}: {error}" + (f" ({detail})" if detail else ""))


CAPTURE_REFUSALS = ("cudaErrorStreamCaptureUnsupported", "cudaErrorStreamCaptureInvalidated",
                    "cudaErrorStreamCaptureImplicit", "hipErrorStreamCaptureUnsupported",
                    "hipErrorStreamCaptureInvalidated", "hipErrorStreamCaptureImplicit")


def capture_refused(error: BaseException) -> bool:
    """Whether ``error`` is a host wait refused because a stream is capturing: nothing was waited for, and nothing
    is wrong with the device; the wait can be made once the capture ends."""
    return isinstance(error, RuntimeCallError) and error.error in CAPTURE_REFUSALS


class IllegalAddress(KvtierError):
    """A device touched an address that is not mapped for it: the emulator's model of a GPU memory fault."""


class AddressDomainError(KvtierError, TypeError):
    """A CPU address and a device address were mixed, or a raw integer was offered where a typed one is needed."""


class WrongDeviceError(KvtierError):
    """Memory of one device was offered to another."""


class NotDeviceAccessible(KvtierError):
    """Host memory that no device can reach (pageable, or not registered) was offered to a device."""


class RegistrationError(KvtierError):
    """Registering host memory with the runtime failed or would overlap an existing registration."""


class HugePagesUnavailable(KvtierError):
    """The system has no free huge pages for a hugetlb buffer."""


class OutOfMemory(KvtierError, MemoryError):
    """Host or device memory of the requested size could not be had (budget, mmap, ftruncate or the driver refused)."""


class BufferClosed(KvtierError):
    """A buffer, pool, engine or captured graph was used after close()."""


class BufferInUse(KvtierError):
    """close() was refused because views of the buffer are still alive."""


class InvalidDevice(KvtierError, ValueError):
    """A device index that this runtime does not have."""


class KernelBuildError(KvtierError):
    """Compiling or finding the transfer kernels failed; the message carries the compiler's log."""


class InvalidArgument(KvtierError, ValueError):
    """An argument kvtier cannot use (wrong type, out of range, duplicated); the message names the argument."""


class MisalignedAddress(IllegalAddress):
    """A vector access at an address not aligned to its width: a GPU faults (cudaErrorMisalignedAddress)."""


class WrongRuntime(KvtierError, TypeError):
    """A stream, event or graph of one runtime was handed to another."""


class LoadFailed(KvtierError):
    """A load-back a request relies on failed (a device fault): the pages it was filling went back to the cache and
    hold no KV of the request's tokens, so the request serves none of them; close it and make a new one."""


class TransferFailed(KvtierError):
    """A KV transfer between processes (``kvtier.disagg``) failed: the wire refused a write, the peer reported a
    failure, or it went away. ``peer`` names the other process, ``request_id`` the request (None: not about one).
    No page of the request was marked landed."""

    def __init__(self, message: str, *, peer: str = "", request_id: str | None = None) -> None:
        self.peer, self.request_id = peer, request_id
        super().__init__(message)


class PeerLost(TransferFailed):
    """The peer's control connection closed or broke (the process died, was killed, or closed its side)."""


class TransferTimedOut(TransferFailed, TimeoutError):
    """A wait for a peer's message or a request's landing ran out of time; what it waited for is still pending."""


class HandshakeRefused(TransferFailed):
    """Two disaggregation endpoints do not fit each other (geometry, dtype, page size, protocol version): refused
    before any byte of KV moved."""
