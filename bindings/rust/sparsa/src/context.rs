//! The context (one backend, its stream and its scratch memory) and TokenSelect's selection cache.
use std::ffi::c_void;
use std::marker::PhantomData;
use std::ptr;

use sparsa_sys as sys;

use crate::error::{check, Result};
use crate::tensor::Device;

/// Options of `Context::new`; `Default` is the CPU backend with one worker per core.
#[derive(Clone, Copy, Debug)]
pub struct ContextOptions {
    /// Backend: `Device::Cpu`, `Device::Cuda(id)` or `Device::Rocm(id)`.
    pub device: Device,
    /// cudaStream_t / hipStream_t every GPU run enqueues on; null = the default stream.
    pub stream: *mut c_void,
    /// CPU worker threads; 0 = one per online core.
    pub num_threads: i32,
}

impl Default for ContextOptions {
    fn default() -> Self {
        ContextOptions { device: Device::Cpu, stream: ptr::null_mut(), num_threads: 0 }
    }
}

/// A sparsa context: runs go through it. Used by one thread at a time (it is `Send`, not `Sync`); destroyed on drop.
pub struct Context {
    raw: *mut sys::sparsa_context,
}

// SAFETY: sparsa.h allows a context to move between threads as long as one thread uses it at a time; `&mut`-free
// methods only read it, and Context is not Sync, so no two threads can call into it at once.
unsafe impl Send for Context {}

impl Context {
    /// Creates a context; `Status::BackendUnavailable` when that backend was not built or has no device.
    pub fn new(options: ContextOptions) -> Result<Context> {
        // SAFETY: plain data, filled by the init call.
        let mut c: sys::sparsa_context_options = unsafe { std::mem::zeroed() };
        check(unsafe { sys::sparsa_context_options_init(&mut c, std::mem::size_of_val(&c)) })?;
        (c.device_type, c.device_id) = options.device.codes();
        c.stream = options.stream;
        c.num_threads = options.num_threads;
        let mut raw = ptr::null_mut();
        // SAFETY: valid options and out-pointer; `raw` is written only on success.
        check(unsafe { sys::sparsa_context_create(&c, &mut raw) })?;
        Ok(Context { raw })
    }

    /// A CPU context with default options.
    pub fn cpu() -> Result<Context> {
        Context::new(ContextOptions::default())
    }

    /// Later GPU runs enqueue on `stream` (ignored by the CPU backend).
    ///
    /// # Safety
    /// `stream` must be a valid stream of the context's device (or null) for as long as runs use it.
    pub unsafe fn set_stream(&mut self, stream: *mut c_void) -> Result<()> {
        check(sys::sparsa_context_set_stream(self.raw, stream))
    }

    /// The backend's `sparsa_device_type` code.
    pub fn device_type(&self) -> Result<i32> {
        let mut value = 0;
        // SAFETY: live context, valid out-pointer.
        check(unsafe { sys::sparsa_context_device_type(self.raw, &mut value) })?;
        Ok(value)
    }

    /// Bytes of scratch memory the context holds.
    pub fn scratch_bytes(&self) -> Result<u64> {
        let mut value = 0;
        // SAFETY: live context, valid out-pointer.
        check(unsafe { sys::sparsa_context_scratch_bytes(self.raw, &mut value) })?;
        Ok(value)
    }

    pub(crate) fn raw(&self) -> *mut sys::sparsa_context {
        self.raw
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: created by sparsa_context_create, destroyed exactly once.
        unsafe { sys::sparsa_context_destroy(self.raw) }
    }
}

/// TokenSelect's per-layer selection cache (§6.5), borrowed from the context it lives on.
pub struct SelectionCache<'ctx> {
    raw: *mut sys::sparsa_selection_cache,
    _context: PhantomData<&'ctx Context>,
}

impl<'ctx> SelectionCache<'ctx> {
    /// An empty cache for up to `max_batch` sequences of these sizes (`max_top_k` tokens per selection).
    pub fn new(
        ctx: &'ctx Context,
        max_batch: i32,
        num_q_heads: i32,
        num_kv_heads: i32,
        head_dim: i32,
        max_top_k: i32,
    ) -> Result<Self> {
        let mut raw = ptr::null_mut();
        // SAFETY: live context, valid out-pointer written only on success.
        check(unsafe {
            sys::sparsa_selection_cache_create(
                ctx.raw(),
                max_batch,
                num_q_heads,
                num_kv_heads,
                head_dim,
                max_top_k,
                &mut raw,
            )
        })?;
        Ok(SelectionCache { raw, _context: PhantomData })
    }

    /// Empties every slot and zeroes the counts.
    pub fn reset(&mut self) -> Result<()> {
        // SAFETY: live cache.
        check(unsafe { sys::sparsa_selection_cache_reset(self.raw) })
    }

    /// (hits, misses) since creation or the last reset.
    pub fn counts(&self) -> Result<(i64, i64)> {
        let (mut hits, mut misses) = (0, 0);
        // SAFETY: live cache, valid out-pointers.
        check(unsafe { sys::sparsa_selection_cache_counts(self.raw, &mut hits, &mut misses) })?;
        Ok((hits, misses))
    }

    pub(crate) fn raw(&mut self) -> *mut sys::sparsa_selection_cache {
        self.raw
    }
}

impl Drop for SelectionCache<'_> {
    fn drop(&mut self) {
        // SAFETY: created by sparsa_selection_cache_create, destroyed exactly once, before its context.
        unsafe { sys::sparsa_selection_cache_destroy(self.raw) }
    }
}
