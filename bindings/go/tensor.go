package sparsa

/*
#include "cwrappers.h"
*/
import "C"

import (
	"fmt"
	"unsafe"
)

// DType is a tensor element type (values of sparsa_dtype).
type DType int32

// Element types.
const (
	DTypeF32  DType = C.SPARSA_DTYPE_F32
	DTypeF16  DType = C.SPARSA_DTYPE_F16
	DTypeBF16 DType = C.SPARSA_DTYPE_BF16
	DTypeF64  DType = C.SPARSA_DTYPE_F64
	DTypeI32  DType = C.SPARSA_DTYPE_I32
	DTypeI64  DType = C.SPARSA_DTYPE_I64
	DTypeU8   DType = C.SPARSA_DTYPE_U8
	DTypeI8   DType = C.SPARSA_DTYPE_I8
)

// Size returns the size in bytes of one element (0 for an unknown dtype), as the library reports it.
func (d DType) Size() int { return int(C.sparsa_dtype_size(C.int32_t(d))) }

var dtypeNames = map[DType]string{
	DTypeF32: "F32", DTypeF16: "F16", DTypeBF16: "BF16", DTypeF64: "F64",
	DTypeI32: "I32", DTypeI64: "I64", DTypeU8: "U8", DTypeI8: "I8",
}

func (d DType) String() string {
	if name, ok := dtypeNames[d]; ok {
		return name
	}
	return fmt.Sprintf("DType(%d)", int32(d))
}

// DeviceType says where a tensor's memory lives (values of sparsa_device_type, which are DLPack's codes).
type DeviceType int32

// Device types.
const (
	DeviceCPU      DeviceType = C.SPARSA_DEVICE_CPU
	DeviceCUDA     DeviceType = C.SPARSA_DEVICE_CUDA
	DeviceCUDAHost DeviceType = C.SPARSA_DEVICE_CUDA_HOST
	DeviceROCm     DeviceType = C.SPARSA_DEVICE_ROCM
)

// MaxDims is the largest rank a tensor may have.
const MaxDims = int(C.SPARSA_MAX_DIMS)

// Tensor is a non-owning view: a Go slice (zero copy) or a raw address, with a dtype, shape and strides in
// elements. The library reads and writes it only during a call. A Tensor over a Go slice keeps the slice alive.
type Tensor struct {
	dtype    DType
	device   DeviceType
	deviceID int32
	shape    []int64
	strides  []int64
	goData   unsafe.Pointer // first element of the Go slice; nil for a raw address or an empty slice
	goBytes  int            // bytes the Go slice holds
	isGo     bool           // over Go memory (goData/goBytes) rather than a raw address
	address  uintptr        // raw address when the tensor is not over Go memory
}

// DType returns the element type.
func (t *Tensor) DType() DType { return t.dtype }

// Shape returns a copy of the extents.
func (t *Tensor) Shape() []int64 { return append([]int64(nil), t.shape...) }

// Strides returns a copy of the strides, in elements.
func (t *Tensor) Strides() []int64 { return append([]int64(nil), t.strides...) }

// Float32 wraps a float32 slice as an F32 tensor; len(data) must equal the product of shape.
func Float32(data []float32, shape ...int64) (*Tensor, error) {
	return fromSlice(DTypeF32, sliceData(data), len(data), 4, "[]float32", shape)
}

// Float64 wraps a float64 slice as an F64 tensor.
func Float64(data []float64, shape ...int64) (*Tensor, error) {
	return fromSlice(DTypeF64, sliceData(data), len(data), 8, "[]float64", shape)
}

// Half wraps raw 16-bit floats (dtype DTypeF16 or DTypeBF16) as a tensor.
func Half(dtype DType, data []uint16, shape ...int64) (*Tensor, error) {
	if dtype != DTypeF16 && dtype != DTypeBF16 {
		return nil, errorf(StatusDTypeMismatch, "dtype: []uint16 holds F16 or BF16, got %s", dtype)
	}
	return fromSlice(dtype, sliceData(data), len(data), 2, "[]uint16", shape)
}

// Int32 wraps an int32 slice as an I32 tensor (indices, offsets, page tables).
func Int32(data []int32, shape ...int64) (*Tensor, error) {
	return fromSlice(DTypeI32, sliceData(data), len(data), 4, "[]int32", shape)
}

// Int64 wraps an int64 slice as an I64 tensor (stats).
func Int64(data []int64, shape ...int64) (*Tensor, error) {
	return fromSlice(DTypeI64, sliceData(data), len(data), 8, "[]int64", shape)
}

// Uint8 wraps a byte slice as a U8 tensor (block masks, layer flags).
func Uint8(data []uint8, shape ...int64) (*Tensor, error) {
	return fromSlice(DTypeU8, sliceData(data), len(data), 1, "[]uint8", shape)
}

// Int8 wraps an int8 slice as an I8 tensor.
func Int8(data []int8, shape ...int64) (*Tensor, error) {
	return fromSlice(DTypeI8, sliceData(data), len(data), 1, "[]int8", shape)
}

// Bytes wraps raw bytes as a tensor of any dtype; len(data) must equal the product of shape times the element
// size.
func Bytes(dtype DType, data []byte, shape ...int64) (*Tensor, error) {
	size := dtype.Size()
	if size == 0 {
		return nil, errorf(StatusDTypeMismatch, "dtype: expected a known sparsa dtype, got %d", int32(dtype))
	}
	if len(data)%size != 0 {
		return nil, errorf(StatusShapeMismatch, "data: %d bytes is not a whole number of %d-byte %s elements",
			len(data), size, dtype)
	}
	return fromSlice(dtype, sliceData(data), len(data)/size, size, "[]byte", shape)
}

// FromAddress describes memory Go does not manage (device memory, pinned host memory, C allocations) as a
// contiguous tensor. The caller keeps the memory valid during every call that uses the tensor.
func FromAddress(address uintptr, dtype DType, device DeviceType, deviceID int32, shape ...int64) (*Tensor, error) {
	if err := checkShape(shape); err != nil {
		return nil, err
	}
	if dtype.Size() == 0 {
		return nil, errorf(StatusDTypeMismatch, "dtype: expected a known sparsa dtype, got %d", int32(dtype))
	}
	return &Tensor{dtype: dtype, device: device, deviceID: deviceID, shape: append([]int64(nil), shape...),
		strides: contiguousStrides(shape), address: address}, nil
}

// WithStrides returns a view of the same memory with other strides (in elements). For Go memory, every element
// the view reaches must lie inside the slice.
func (t *Tensor) WithStrides(strides ...int64) (*Tensor, error) {
	if len(strides) != len(t.shape) {
		return nil, errorf(StatusShapeMismatch, "strides: expected %d strides (one per dim), got %d",
			len(t.shape), len(strides))
	}
	view := *t
	view.strides = append([]int64(nil), strides...)
	if t.isGo {
		if err := view.checkSpan(t.goBytes / t.dtype.Size()); err != nil {
			return nil, err
		}
	}
	return &view, nil
}

func fromSlice(dtype DType, data unsafe.Pointer, length, elementSize int, sliceType string,
	shape []int64) (*Tensor, error) {
	if dtype.Size() != elementSize {
		return nil, errorf(StatusDTypeMismatch, "dtype: %s holds %d-byte elements but %s is %d bytes",
			sliceType, elementSize, dtype, dtype.Size())
	}
	if err := checkShape(shape); err != nil {
		return nil, err
	}
	count := int64(1)
	for _, extent := range shape {
		count *= extent
	}
	if count != int64(length) {
		return nil, errorf(StatusShapeMismatch, "data: shape %v needs %d elements, the %s holds %d",
			shape, count, sliceType, length)
	}
	if length == 0 {
		data = nil
	}
	return &Tensor{dtype: dtype, device: DeviceCPU, shape: append([]int64(nil), shape...),
		strides: contiguousStrides(shape), goData: data, goBytes: length * elementSize, isGo: true}, nil
}

// sliceData returns the address of a slice's first element, nil for an empty slice.
func sliceData[T any](s []T) unsafe.Pointer {
	if len(s) == 0 {
		return nil
	}
	return unsafe.Pointer(&s[0])
}

func checkShape(shape []int64) error {
	if len(shape) < 1 || len(shape) > MaxDims {
		return errorf(StatusShapeMismatch, "shape: expected 1..%d dims, got %d", MaxDims, len(shape))
	}
	for i, extent := range shape {
		if extent < 0 {
			return errorf(StatusShapeMismatch, "shape: dim %d is %d, expected >= 0", i, extent)
		}
	}
	return nil
}

func contiguousStrides(shape []int64) []int64 {
	strides := make([]int64, len(shape))
	stride := int64(1)
	for i := len(shape) - 1; i >= 0; i-- {
		strides[i] = stride
		stride *= shape[i]
	}
	return strides
}

// checkSpan verifies that the farthest element the view reaches lies inside `elements` elements.
func (t *Tensor) checkSpan(elements int) error {
	last := int64(0)
	for i, extent := range t.shape {
		if extent == 0 {
			return nil
		}
		if t.strides[i] < 0 {
			return errorf(StatusShapeMismatch, "strides: dim %d has stride %d, expected >= 0", i, t.strides[i])
		}
		last += (extent - 1) * t.strides[i]
	}
	if last >= int64(elements) {
		return errorf(StatusShapeMismatch, "strides: the view reaches element %d but the slice holds %d",
			last, elements)
	}
	return nil
}

// tensorSlots collects the tensors of one call: descriptors (data NULL) for C, Go data pointers apart (see
// cwrappers.h for the cgo pointer rules this follows).
type tensorSlots struct {
	c      C.gs_tensors
	goData [C.GS_MAX_TENSORS]unsafe.Pointer
}

// set puts t (nil = absent) in slot i.
func (s *tensorSlots) set(i int, t *Tensor) {
	if t == nil {
		return
	}
	d := &s.c.desc[i]
	d.struct_size = C.uint32_t(unsafe.Sizeof(*d))
	d.dtype = C.int32_t(t.dtype)
	d.device_type = C.int32_t(t.device)
	d.device_id = C.int32_t(t.deviceID)
	d.ndim = C.int32_t(len(t.shape))
	for k := range t.shape {
		d.shape[k] = C.int64_t(t.shape[k])
		d.strides[k] = C.int64_t(t.strides[k])
	}
	s.c.address[i] = C.uintptr_t(t.address)
	s.c.present[i] = 1
	s.goData[i] = t.goData
}
