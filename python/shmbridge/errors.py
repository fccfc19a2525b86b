"""Exceptions raised by shmbridge, one class per variant of the Rust ``shmbridge::Error``.

Every exception carries the Rust message, which says what went wrong and what to do.
``shmbridge._native`` raises them by name (see ``class_name`` in ``src/python/errors.rs``).
Where a builtin exception fits, the class subclasses it too, so ``except TimeoutError``,
``except FileNotFoundError``, ``except KeyError`` ... keep working.
"""

import builtins as _builtins

__all__ = [
    "ShmBridgeError",
    "NotFoundError",
    "NameInUseError",
    "PermissionDeniedError",
    "InvalidNameError",
    "InvalidRegionError",
    "NotARegionFileError",
    "BadMagicError",
    "VersionMismatchError",
    "LayoutMismatchError",
    "RegionTooSmallError",
    "InvalidHeaderError",
    "TensorOutOfBoundsError",
    "InvalidTensorError",
    "InvalidSpecError",
    "NoSuchTensorError",
    "DTypeMismatchError",
    "WrongDirectionError",
    "AlreadyBorrowedError",
    "AlreadyAttachedError",
    "PeerDiedError",
    "EngineDiedError",
    "ClientDiedError",
    "PeerClosedError",
    "EngineClosedError",
    "ClientClosedError",
    "TimeoutError",
    "ProtocolError",
    "RecordTooLargeError",
    "BadMessageError",
    "NoCommandChannelError",
    "RemoteError",
    "OutOfOrderError",
    "InterruptedError",
    "ClosedError",
    "CudaUnavailableError",
    "CudaError",
    "VulkanUnavailableError",
    "VulkanError",
    "NotOnHostError",
    "NoSpaceError",
    "CommandBacklogError",
    "NotPostedError",
    "NoDeviceSideError",
    "ShmBridgeOSError",
    "EngineStartError",
    "FullError",
]


class ShmBridgeError(Exception):
    """Base class of every shmbridge error."""

    def __str__(self) -> str:  # KeyError quotes its message; we never want that.
        return str(self.args[0]) if self.args else ""


# Region names and permissions.
class NotFoundError(ShmBridgeError, FileNotFoundError):
    """No region with that name: check the name the engine printed, and that it runs."""


class NameInUseError(ShmBridgeError, FileExistsError):
    """A region with that name exists already."""


class PermissionDeniedError(ShmBridgeError, PermissionError):
    """The region belongs to another user."""


class InvalidNameError(ShmBridgeError, ValueError):
    """Not a valid region name."""


# A region whose header cannot be trusted.
class InvalidRegionError(ShmBridgeError):
    """The region's header failed validation."""


class NotARegionFileError(InvalidRegionError):
    """The name in /dev/shm is not a regular file (a FIFO, a symlink, a directory...):
    not opened, not waited on."""


class BadMagicError(InvalidRegionError):
    """Not a shmbridge region."""


class VersionMismatchError(InvalidRegionError):
    """The engine speaks another protocol major version."""


class LayoutMismatchError(VersionMismatchError):
    """Same version, different header layout: rebuild both sides from one release."""


class RegionTooSmallError(InvalidRegionError):
    """The region is truncated."""


class InvalidHeaderError(InvalidRegionError):
    """A header field is out of range."""


class TensorOutOfBoundsError(InvalidRegionError):
    """A tensor lies outside the region."""


class InvalidTensorError(InvalidRegionError):
    """A tensor-table entry is inconsistent."""


# Using the API wrongly.
class InvalidSpecError(ShmBridgeError, ValueError):
    """An invalid engine spec (or unknown reference env)."""


class NoSuchTensorError(ShmBridgeError, KeyError):
    """No tensor with that name."""


class DTypeMismatchError(ShmBridgeError, TypeError):
    """A tensor was requested with the wrong dtype."""


class WrongDirectionError(ShmBridgeError):
    """Writing a tensor the other side writes."""


class AlreadyBorrowedError(ShmBridgeError):
    """A tensor was borrowed twice."""


class AlreadyAttachedError(ShmBridgeError):
    """Another live client is attached to this engine (one client per engine)."""


# The peer.
class PeerDiedError(ShmBridgeError):
    """The other process died. ``pid`` is its pid as it recorded it, in its own PID
    namespace; ``pid_in_other_namespace`` is true when it lived in another PID namespace
    than this process (another container), where that number names nothing here."""


class EngineDiedError(PeerDiedError):
    """The engine process died (its region was removed)."""


class ClientDiedError(PeerDiedError):
    """The client process died."""


class PeerClosedError(ShmBridgeError):
    """The other side closed the region."""


class EngineClosedError(PeerClosedError):
    """The engine closed the region."""


class ClientClosedError(PeerClosedError):
    """The client closed the region."""


class TimeoutError(ShmBridgeError, _builtins.TimeoutError):
    """A wait ran out of time. After a step timed out, the next step first waits for
    the frame still in flight."""


class ProtocolError(ShmBridgeError):
    """The other side broke the lock-step or command protocol."""


class RecordTooLargeError(ShmBridgeError, ValueError):
    """A command does not fit the command ring."""


class BadMessageError(ProtocolError):
    """A malformed command-channel message."""


class NoCommandChannelError(ShmBridgeError):
    """The engine has no command channel."""


class RemoteError(ShmBridgeError):
    """The engine answered a command with an error (``method``, ``code`` attributes)."""


class InterruptedError(ShmBridgeError, _builtins.InterruptedError):  # noqa: A001
    """A wait was stopped by an interrupt hook (Python raises the signal's own exception,
    e.g. KeyboardInterrupt, instead; this class is the fallback)."""


class OutOfOrderError(ShmBridgeError):
    """Calls in an order the protocol does not allow."""


class ClosedError(ShmBridgeError, ValueError):
    """This client is closed."""


# CUDA.
class CudaUnavailableError(ShmBridgeError, RuntimeError):
    """CUDA was asked for but cannot be used here (no ``cuda`` feature in this build, no
    loadable driver, no device); the message says which. ``device="auto"`` falls back to
    host memory instead of raising this."""


class CudaError(ShmBridgeError, RuntimeError):
    """A CUDA driver call failed (the message names the call and the driver's error)."""


# Vulkan.
class VulkanUnavailableError(ShmBridgeError, RuntimeError):
    """Vulkan was asked for but cannot be used here (no ``vulkan`` feature in this build,
    no loader or driver, no matching device); the message says which."""


class VulkanError(ShmBridgeError, RuntimeError):
    """A Vulkan call failed (the message names the call and the driver's result)."""


class NotOnHostError(ShmBridgeError, TypeError):
    """A host view was asked of a tensor whose bytes live on a device."""


class NoDeviceSideError(ShmBridgeError, RuntimeError):
    """A device-side call on tensor views that have none (the engine's device backend
    asked of a client's views), whatever the device."""


class FullError(ShmBridgeError):
    """A stream's lane stayed full for the whole deadline of a reserve: the consumers
    did not release enough records. Nothing was written; reserve again later."""


class CommandBacklogError(ShmBridgeError):
    """The engine's command ring stayed full for the whole call timeout: it has not read
    earlier requests (busy in a long step or handler). Nothing was sent; the session can
    keep stepping, and a later call goes through once the engine serves commands again."""


class NotPostedError(TimeoutError):
    """A step ran out of time before its action could be sent: the device work the
    action waits on (a CUDA stream of a Vulkan engine's tensors, or of CUDA memory
    shared by file descriptor) did not drain. Nothing
    was sent and nothing is in flight; the frame is unchanged. Step again. A
    ``TimeoutError``, so ``except TimeoutError`` still catches it."""


class NoSpaceError(ShmBridgeError, OSError):
    """``/dev/shm`` has no room for the region (Docker gives containers 64 MB unless
    started with ``--shm-size``); the message gives the sizes. Nothing was left behind."""


class ShmBridgeOSError(ShmBridgeError, OSError):
    """A system call failed."""


class EngineStartError(ShmBridgeError):
    """``launch()`` could not start the engine; the message holds the engine's stderr."""
