// Package sparsa is the Go binding of sparsa, a sparse-attention kernel library with a stable C ABI.
//
// Handles (Context, SelectionCache) are released with an explicit, idempotent Close. Every failure is returned as
// a *Error carrying the library's status and the message the library wrote in the very call that failed; compare
// classes with errors.Is(err, sparsa.ErrShapeMismatch). Tensors are non-owning views of Go slices (zero copy, valid
// for the call only: the library never keeps them) or of raw device addresses (uintptr).
//
// The library is found with pkg-config (`#cgo pkg-config: sparsa`): point PKG_CONFIG_PATH at the folder holding
// sparsa.pc (the install prefix's lib/pkgconfig, or the build tree's uninstalled one).
package sparsa

/*
#cgo pkg-config: sparsa
#include <stdlib.h>
#include "cwrappers.h"
*/
import "C"

import (
	"fmt"
	"unsafe"
)

// HeaderVersion is the version of sparsa.h this package was compiled against (MAJOR*10000 + MINOR*100 + PATCH).
const HeaderVersion = uint32(C.SPARSA_VERSION)

// Version returns the loaded library's version, encoded as HeaderVersion.
func Version() uint32 { return uint32(C.sparsa_version()) }

// VersionString returns the loaded library's version as "MAJOR.MINOR.PATCH".
func VersionString() string { return C.GoString(C.sparsa_version_string()) }

// Status is a sparsa_status code.
type Status int32

// Status codes (values of sparsa_status_code; never renumbered).
const (
	StatusSuccess            Status = C.SPARSA_STATUS_SUCCESS
	StatusInvalidArgument    Status = C.SPARSA_STATUS_INVALID_ARGUMENT
	StatusNullPointer        Status = C.SPARSA_STATUS_NULL_POINTER
	StatusDTypeMismatch      Status = C.SPARSA_STATUS_DTYPE_MISMATCH
	StatusShapeMismatch      Status = C.SPARSA_STATUS_SHAPE_MISMATCH
	StatusIndexOutOfRange    Status = C.SPARSA_STATUS_INDEX_OUT_OF_RANGE
	StatusDeviceMismatch     Status = C.SPARSA_STATUS_DEVICE_MISMATCH
	StatusStructSize         Status = C.SPARSA_STATUS_STRUCT_SIZE
	StatusUnsupported        Status = C.SPARSA_STATUS_UNSUPPORTED
	StatusBackendUnavailable Status = C.SPARSA_STATUS_BACKEND_UNAVAILABLE
	StatusOutOfMemory        Status = C.SPARSA_STATUS_OUT_OF_MEMORY
	StatusDeviceError        Status = C.SPARSA_STATUS_DEVICE_ERROR
	StatusInternal           Status = C.SPARSA_STATUS_INTERNAL
)

// String returns the library's name for the status ("SPARSA_STATUS_SHAPE_MISMATCH").
func (s Status) String() string { return C.GoString(C.sparsa_status_string(C.sparsa_status(s))) }

// Error is every error this package returns: the library's status and its message (which names the argument,
// what was expected and what came). Errors detected in Go before calling the library use the same statuses.
type Error struct {
	Status  Status
	Message string
}

func (e *Error) Error() string { return fmt.Sprintf("sparsa: %s: %s", e.Status, e.Message) }

// Is makes errors.Is(err, sparsa.ErrShapeMismatch) true for every *Error of that status. A target with a message
// matches only an equal error.
func (e *Error) Is(target error) bool {
	other, ok := target.(*Error)
	if !ok {
		return false
	}
	return other.Status == e.Status && (other.Message == "" || other.Message == e.Message)
}

// Sentinels for errors.Is, one per failure status.
var (
	ErrInvalidArgument    = &Error{Status: StatusInvalidArgument}
	ErrNullPointer        = &Error{Status: StatusNullPointer}
	ErrDTypeMismatch      = &Error{Status: StatusDTypeMismatch}
	ErrShapeMismatch      = &Error{Status: StatusShapeMismatch}
	ErrIndexOutOfRange    = &Error{Status: StatusIndexOutOfRange}
	ErrDeviceMismatch     = &Error{Status: StatusDeviceMismatch}
	ErrStructSize         = &Error{Status: StatusStructSize}
	ErrUnsupported        = &Error{Status: StatusUnsupported}
	ErrBackendUnavailable = &Error{Status: StatusBackendUnavailable}
	ErrOutOfMemory        = &Error{Status: StatusOutOfMemory}
	ErrDeviceError        = &Error{Status: StatusDeviceError}
	ErrInternal           = &Error{Status: StatusInternal}
)

// check turns a wrapper's result into a Go error, freeing the C copy of the message.
func check(result C.gs_result) error {
	if result.status == C.SPARSA_STATUS_SUCCESS {
		return nil
	}
	message := "(no message: out of memory while copying it)"
	if result.message != nil {
		message = C.GoString(result.message)
		C.free(unsafe.Pointer(result.message))
	}
	return &Error{Status: Status(result.status), Message: message}
}

// errorf builds an *Error for a failure found in Go, before any library call.
func errorf(status Status, format string, args ...interface{}) error {
	return &Error{Status: status, Message: fmt.Sprintf(format, args...)}
}

func cBool(b bool) C.int32_t {
	if b {
		return 1
	}
	return 0
}
