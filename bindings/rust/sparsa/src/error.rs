//! Errors: every sparsa status other than success becomes an `Error` carrying the status and the library's message.
use std::ffi::CStr;
use std::fmt;

use sparsa_sys as sys;

/// The failure categories of `sparsa_status_code`, one to one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    InvalidArgument,
    NullPointer,
    DtypeMismatch,
    ShapeMismatch,
    IndexOutOfRange,
    DeviceMismatch,
    StructSize,
    Unsupported,
    BackendUnavailable,
    OutOfMemory,
    DeviceError,
    Internal,
    /// A code this version of the crate does not know (from a newer library).
    Unknown(i32),
}

impl Status {
    /// The status for a non-zero `sparsa_status`.
    pub fn from_code(code: i32) -> Status {
        match code as u32 {
            sys::SPARSA_STATUS_INVALID_ARGUMENT => Status::InvalidArgument,
            sys::SPARSA_STATUS_NULL_POINTER => Status::NullPointer,
            sys::SPARSA_STATUS_DTYPE_MISMATCH => Status::DtypeMismatch,
            sys::SPARSA_STATUS_SHAPE_MISMATCH => Status::ShapeMismatch,
            sys::SPARSA_STATUS_INDEX_OUT_OF_RANGE => Status::IndexOutOfRange,
            sys::SPARSA_STATUS_DEVICE_MISMATCH => Status::DeviceMismatch,
            sys::SPARSA_STATUS_STRUCT_SIZE => Status::StructSize,
            sys::SPARSA_STATUS_UNSUPPORTED => Status::Unsupported,
            sys::SPARSA_STATUS_BACKEND_UNAVAILABLE => Status::BackendUnavailable,
            sys::SPARSA_STATUS_OUT_OF_MEMORY => Status::OutOfMemory,
            sys::SPARSA_STATUS_DEVICE_ERROR => Status::DeviceError,
            sys::SPARSA_STATUS_INTERNAL => Status::Internal,
            _ => Status::Unknown(code),
        }
    }

    /// The C value of this status.
    pub fn code(self) -> i32 {
        (match self {
            Status::InvalidArgument => sys::SPARSA_STATUS_INVALID_ARGUMENT,
            Status::NullPointer => sys::SPARSA_STATUS_NULL_POINTER,
            Status::DtypeMismatch => sys::SPARSA_STATUS_DTYPE_MISMATCH,
            Status::ShapeMismatch => sys::SPARSA_STATUS_SHAPE_MISMATCH,
            Status::IndexOutOfRange => sys::SPARSA_STATUS_INDEX_OUT_OF_RANGE,
            Status::DeviceMismatch => sys::SPARSA_STATUS_DEVICE_MISMATCH,
            Status::StructSize => sys::SPARSA_STATUS_STRUCT_SIZE,
            Status::Unsupported => sys::SPARSA_STATUS_UNSUPPORTED,
            Status::BackendUnavailable => sys::SPARSA_STATUS_BACKEND_UNAVAILABLE,
            Status::OutOfMemory => sys::SPARSA_STATUS_OUT_OF_MEMORY,
            Status::DeviceError => sys::SPARSA_STATUS_DEVICE_ERROR,
            Status::Internal => sys::SPARSA_STATUS_INTERNAL,
            Status::Unknown(code) => return code,
        }) as i32
    }
}

/// A failed sparsa call: the status and the message naming the argument, what was expected and what came.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub status: Status,
    pub message: String,
}

impl Error {
    /// An error raised by this crate before calling the library (e.g. a slice shorter than its shape).
    pub fn new(status: Status, message: impl Into<String>) -> Error {
        Error { status, message: message.into() }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({:?})", self.message, self.status)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// Turns a returned status into a Result. The library's message is thread-local; this runs on the thread of the
/// call that just returned, before any other sparsa call, so it reads that call's message.
pub(crate) fn check(status: sys::sparsa_status) -> Result<()> {
    if status == 0 {
        return Ok(());
    }
    // SAFETY: sparsa_last_error_message returns a valid NUL-terminated string owned by the library.
    let message = unsafe { CStr::from_ptr(sys::sparsa_last_error_message()) }.to_string_lossy().into_owned();
    Err(Error { status: Status::from_code(status), message })
}
