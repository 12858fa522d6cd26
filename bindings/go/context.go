package sparsa

/*
#include "cwrappers.h"
*/
import "C"

import (
	"runtime"
	"unsafe"
)

// ContextOptions choose the backend of a Context.
type ContextOptions struct {
	Device     DeviceType // DeviceCPU (default), DeviceCUDA or DeviceROCm
	DeviceID   int32      // GPU ordinal; ignored on CPU
	Stream     uintptr    // cudaStream_t / hipStream_t every GPU run enqueues on; 0 = default stream
	NumThreads int32      // CPU worker threads; 0 = one per online core
}

// DefaultContextOptions returns the library's defaults (CPU, device 0, default stream, all cores).
func DefaultContextOptions() ContextOptions {
	var options C.sparsa_context_options
	C.sparsa_context_options_init(&options, C.size_t(unsafe.Sizeof(options)))
	return ContextOptions{Device: DeviceType(options.device_type), DeviceID: int32(options.device_id),
		NumThreads: int32(options.num_threads)}
}

// Context runs attention and the device utilities on one backend and owns their scratch memory. Use it from one
// goroutine at a time; Close it when done (Close is idempotent). Close its SelectionCaches first.
type Context struct {
	ptr *C.sparsa_context
}

// NewContext creates a context; nil options = DefaultContextOptions(). A backend that was not built or has no
// device fails with ErrBackendUnavailable.
func NewContext(options *ContextOptions) (*Context, error) {
	var cOptions C.sparsa_context_options
	C.sparsa_context_options_init(&cOptions, C.size_t(unsafe.Sizeof(cOptions)))
	if options != nil {
		cOptions.device_type = C.int32_t(options.Device)
		cOptions.device_id = C.int32_t(options.DeviceID)
		cOptions.num_threads = C.int32_t(options.NumThreads)
	}
	var ptr *C.sparsa_context
	if err := check(C.gs_context_create(&cOptions, &ptr)); err != nil {
		return nil, err
	}
	ctx := &Context{ptr: ptr}
	// The stream is a foreign address held as a uintptr; the wrapper converts it in C, where that is legal (Go's
	// unsafe rules forbid turning an arbitrary uintptr into an unsafe.Pointer).
	if options != nil && options.Stream != 0 {
		if err := ctx.SetStream(options.Stream); err != nil {
			ctx.Close()
			return nil, err
		}
	}
	// A safety net for a forgotten Close, not the contract.
	runtime.SetFinalizer(ctx, (*Context).Close)
	return ctx, nil
}

// Close destroys the context and its scratch memory. Calling it again does nothing.
func (c *Context) Close() {
	if c.ptr == nil {
		return
	}
	C.sparsa_context_destroy(c.ptr)
	c.ptr = nil
	runtime.SetFinalizer(c, nil)
}

func (c *Context) handle() (*C.sparsa_context, error) {
	if c == nil || c.ptr == nil {
		return nil, errorf(StatusNullPointer, "ctx: the Context is closed (or nil)")
	}
	return c.ptr, nil
}

// SetStream changes the stream later GPU runs enqueue on (ignored by the CPU backend).
func (c *Context) SetStream(stream uintptr) error {
	ptr, err := c.handle()
	if err != nil {
		return err
	}
	defer runtime.KeepAlive(c)
	return check(C.gs_context_set_stream(ptr, C.uintptr_t(stream)))
}

// DeviceType returns the context's backend.
func (c *Context) DeviceType() (DeviceType, error) {
	ptr, err := c.handle()
	if err != nil {
		return 0, err
	}
	defer runtime.KeepAlive(c)
	var device C.int32_t
	if err := check(C.gs_context_device_type(ptr, &device)); err != nil {
		return 0, err
	}
	return DeviceType(device), nil
}

// ScratchBytes returns the bytes of scratch memory the context holds.
func (c *Context) ScratchBytes() (uint64, error) {
	ptr, err := c.handle()
	if err != nil {
		return 0, err
	}
	defer runtime.KeepAlive(c)
	var bytes C.uint64_t
	if err := check(C.gs_context_scratch_bytes(ptr, &bytes)); err != nil {
		return 0, err
	}
	return uint64(bytes), nil
}

// SelectionCache is TokenSelect's per-layer selection cache (§6.5): pass it in AttentionArgs.SelectionCache. Keep
// one per layer, use it from one goroutine at a time, Close it before its Context (Close is idempotent).
type SelectionCache struct {
	ptr *C.sparsa_selection_cache
	ctx *Context // keeps the context reachable while the cache lives
}

// NewSelectionCache creates an empty cache for up to maxBatch sequences of numQHeads/numKVHeads heads of headDim,
// and selections of up to maxTopK tokens.
func (c *Context) NewSelectionCache(maxBatch, numQHeads, numKVHeads, headDim, maxTopK int32) (*SelectionCache,
	error) {
	ptr, err := c.handle()
	if err != nil {
		return nil, err
	}
	defer runtime.KeepAlive(c)
	var cache *C.sparsa_selection_cache
	if err := check(C.gs_selection_cache_create(ptr, C.int32_t(maxBatch), C.int32_t(numQHeads),
		C.int32_t(numKVHeads), C.int32_t(headDim), C.int32_t(maxTopK), &cache)); err != nil {
		return nil, err
	}
	result := &SelectionCache{ptr: cache, ctx: c}
	runtime.SetFinalizer(result, (*SelectionCache).Close)
	return result, nil
}

// Close destroys the cache. Calling it again does nothing.
func (s *SelectionCache) Close() {
	if s.ptr == nil {
		return
	}
	C.sparsa_selection_cache_destroy(s.ptr)
	s.ptr = nil
	s.ctx = nil
	runtime.SetFinalizer(s, nil)
}

func (s *SelectionCache) handle() (*C.sparsa_selection_cache, error) {
	if s == nil || s.ptr == nil {
		return nil, errorf(StatusNullPointer, "selection_cache: the SelectionCache is closed (or nil)")
	}
	return s.ptr, nil
}

// Reset empties every slot and zeroes the hit/miss counts.
func (s *SelectionCache) Reset() error {
	ptr, err := s.handle()
	if err != nil {
		return err
	}
	defer runtime.KeepAlive(s)
	return check(C.gs_selection_cache_reset(ptr))
}

// Counts returns the hits and misses counted since creation or the last Reset.
func (s *SelectionCache) Counts() (hits, misses int64, err error) {
	ptr, err := s.handle()
	if err != nil {
		return 0, 0, err
	}
	defer runtime.KeepAlive(s)
	var cHits, cMisses C.int64_t
	if err := check(C.gs_selection_cache_counts(ptr, &cHits, &cMisses)); err != nil {
		return 0, 0, err
	}
	return int64(cHits), int64(cMisses), nil
}
