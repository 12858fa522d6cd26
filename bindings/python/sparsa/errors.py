"""Exceptions: one subclass of sparsa.Error per sparsa_status, each carrying .status and .message.

Where Python has a matching built-in category the class also derives from it, so `except ValueError` catches a
ShapeError and `except IndexError` catches an IndexOutOfRangeError.
"""


class Error(Exception):
    """A sparsa call failed. `status` is the sparsa_status code, `message` the library's detailed message."""

    status = 0

    def __init__(self, message, status=None, function=None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        self.function = function  # the C function that failed, or None when Python refused before the call

    def __str__(self):
        where = f"{self.function}: " if self.function else ""
        return f"{where}{self.message} ({type(self).__name__}, status {self.status})"


class InvalidArgumentError(Error, ValueError):
    status = 1


class NullPointerError(Error, ValueError):
    status = 2


class DtypeError(Error, TypeError):
    status = 3


class ShapeError(Error, ValueError):
    status = 4


class IndexOutOfRangeError(Error, IndexError):
    status = 5


class DeviceMismatchError(Error, ValueError):
    status = 6


class StructSizeError(Error):
    status = 7


class UnsupportedError(Error, NotImplementedError):
    status = 8


class BackendUnavailableError(Error, RuntimeError):
    status = 9


class OutOfMemoryError(Error, MemoryError):
    status = 10


class DeviceError(Error, RuntimeError):
    status = 11


class InternalError(Error, RuntimeError):
    status = 12


_BY_STATUS = {cls.status: cls for cls in (
    InvalidArgumentError, NullPointerError, DtypeError, ShapeError, IndexOutOfRangeError, DeviceMismatchError,
    StructSizeError, UnsupportedError, BackendUnavailableError, OutOfMemoryError, DeviceError, InternalError)}


def error_for_status(status, message, function=None):
    """The exception for a status returned by the library (an unknown status gives a plain Error)."""
    return _BY_STATUS.get(status, Error)(message, status=status, function=function)
