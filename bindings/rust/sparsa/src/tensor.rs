//! Tensor views over caller memory: `TensorRef` (read) and `TensorMut` (written), from slices or, unsafely, from
//! raw (device) pointers. A view is the C `sparsa_tensor` descriptor plus the borrow that keeps the memory alive.
use std::ffi::c_void;
use std::marker::PhantomData;

use sparsa_sys as sys;

use crate::error::{Error, Result, Status};

/// Element types (`sparsa_dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    F32,
    F16,
    BF16,
    F64,
    I32,
    I64,
    U8,
    I8,
}

impl Dtype {
    pub fn code(self) -> i32 {
        (match self {
            Dtype::F32 => sys::SPARSA_DTYPE_F32,
            Dtype::F16 => sys::SPARSA_DTYPE_F16,
            Dtype::BF16 => sys::SPARSA_DTYPE_BF16,
            Dtype::F64 => sys::SPARSA_DTYPE_F64,
            Dtype::I32 => sys::SPARSA_DTYPE_I32,
            Dtype::I64 => sys::SPARSA_DTYPE_I64,
            Dtype::U8 => sys::SPARSA_DTYPE_U8,
            Dtype::I8 => sys::SPARSA_DTYPE_I8,
        }) as i32
    }

    pub fn from_code(code: i32) -> Option<Dtype> {
        [Dtype::F32, Dtype::F16, Dtype::BF16, Dtype::F64, Dtype::I32, Dtype::I64, Dtype::U8, Dtype::I8]
            .into_iter()
            .find(|d| d.code() == code)
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        // SAFETY: a pure function of its argument.
        unsafe { sys::sparsa_dtype_size(self.code()) }
    }
}

/// Rust element types with a sparsa dtype. Half-precision data is passed as `u16` bits with an explicit dtype
/// (`TensorRef::f16`, `TensorRef::bf16`, `TensorRef::with_dtype`).
pub trait Element: Copy {
    const DTYPE: Dtype;
}
impl Element for f32 {
    const DTYPE: Dtype = Dtype::F32;
}
impl Element for f64 {
    const DTYPE: Dtype = Dtype::F64;
}
impl Element for i32 {
    const DTYPE: Dtype = Dtype::I32;
}
impl Element for i64 {
    const DTYPE: Dtype = Dtype::I64;
}
impl Element for u8 {
    const DTYPE: Dtype = Dtype::U8;
}
impl Element for i8 {
    const DTYPE: Dtype = Dtype::I8;
}

/// Where a tensor's memory lives (`sparsa_device_type` + ordinal).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    Cuda(i32),
    /// Pinned host memory, readable by the CPU and by CUDA copies.
    CudaHost,
    Rocm(i32),
}

impl Device {
    pub(crate) fn codes(self) -> (i32, i32) {
        match self {
            Device::Cpu => (sys::SPARSA_DEVICE_CPU as i32, 0),
            Device::Cuda(id) => (sys::SPARSA_DEVICE_CUDA as i32, id),
            Device::CudaHost => (sys::SPARSA_DEVICE_CUDA_HOST as i32, 0),
            Device::Rocm(id) => (sys::SPARSA_DEVICE_ROCM as i32, id),
        }
    }
}

const MAX_DIMS: usize = sys::SPARSA_MAX_DIMS as usize;

/// Row-major strides (in elements) of `shape`.
fn contiguous_strides(shape: &[i64]) -> Vec<i64> {
    let mut strides = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1].max(1);
    }
    strides
}

/// Builds the C descriptor after checking rank, extents, strides and (for slices) that every addressed element
/// lies inside the `available` elements.
fn describe(
    data: *mut c_void,
    dtype: Dtype,
    shape: &[i64],
    strides: Option<&[i64]>,
    available: Option<usize>,
    device: Device,
) -> Result<sys::sparsa_tensor> {
    if shape.is_empty() || shape.len() > MAX_DIMS {
        return Err(Error::new(Status::ShapeMismatch, format!("tensor: rank {} outside 1..={MAX_DIMS}", shape.len())));
    }
    if shape.iter().any(|&e| e < 0) {
        return Err(Error::new(Status::ShapeMismatch, format!("tensor: negative extent in shape {shape:?}")));
    }
    let strides = match strides {
        Some(s) if s.len() != shape.len() => {
            return Err(Error::new(
                Status::ShapeMismatch,
                format!("tensor: {} strides for shape {shape:?} of rank {}", s.len(), shape.len()),
            ))
        }
        Some(s) if s.iter().any(|&x| x < 0) => {
            return Err(Error::new(Status::ShapeMismatch, format!("tensor: negative stride in {s:?}")))
        }
        Some(s) => s.to_vec(),
        None => contiguous_strides(shape),
    };
    if let Some(available) = available {
        let empty = shape.contains(&0);
        let needed: i64 = if empty { 0 } else { 1 + shape.iter().zip(&strides).map(|(e, s)| (e - 1) * s).sum::<i64>() };
        if needed as u128 > available as u128 {
            return Err(Error::new(
                Status::ShapeMismatch,
                format!(
                    "tensor: shape {shape:?} with strides {strides:?} reaches {needed} \
                                           elements but the slice holds {available}"
                ),
            ));
        }
    }
    // SAFETY: sparsa_tensor is plain data; every field is set below.
    let mut raw: sys::sparsa_tensor = unsafe { std::mem::zeroed() };
    raw.struct_size = std::mem::size_of::<sys::sparsa_tensor>() as u32;
    raw.dtype = dtype.code();
    (raw.device_type, raw.device_id) = device.codes();
    raw.ndim = shape.len() as i32;
    raw.data = data;
    raw.shape[..shape.len()].copy_from_slice(shape);
    raw.strides[..shape.len()].copy_from_slice(&strides);
    Ok(raw)
}

fn check_element_size<T>(dtype: Dtype) -> Result<()> {
    if std::mem::size_of::<T>() != dtype.size() {
        return Err(Error::new(
            Status::DtypeMismatch,
            format!(
                "tensor: {}-byte elements cannot hold {dtype:?} ({} bytes)",
                std::mem::size_of::<T>(),
                dtype.size()
            ),
        ));
    }
    Ok(())
}

/// A read-only view of caller memory for the duration of the borrow `'a`.
#[derive(Clone, Copy)]
pub struct TensorRef<'a> {
    raw: sys::sparsa_tensor,
    _borrow: PhantomData<&'a ()>,
}

impl<'a> TensorRef<'a> {
    /// A contiguous row-major CPU tensor over `data`.
    pub fn new<T: Element>(data: &'a [T], shape: &[i64]) -> Result<Self> {
        Self::with_dtype(data, T::DTYPE, shape)
    }
    /// A strided CPU tensor over `data` (strides in elements).
    pub fn strided<T: Element>(data: &'a [T], shape: &[i64], strides: &[i64]) -> Result<Self> {
        let raw =
            describe(data.as_ptr() as *mut c_void, T::DTYPE, shape, Some(strides), Some(data.len()), Device::Cpu)?;
        Ok(TensorRef { raw, _borrow: PhantomData })
    }
    /// Contiguous IEEE half-precision data given as bits.
    pub fn f16(data: &'a [u16], shape: &[i64]) -> Result<Self> {
        Self::with_dtype(data, Dtype::F16, shape)
    }
    /// Contiguous bfloat16 data given as bits.
    pub fn bf16(data: &'a [u16], shape: &[i64]) -> Result<Self> {
        Self::with_dtype(data, Dtype::BF16, shape)
    }
    /// Contiguous data of any element type whose size matches `dtype`.
    pub fn with_dtype<T: Copy>(data: &'a [T], dtype: Dtype, shape: &[i64]) -> Result<Self> {
        check_element_size::<T>(dtype)?;
        let raw = describe(data.as_ptr() as *mut c_void, dtype, shape, None, Some(data.len()), Device::Cpu)?;
        Ok(TensorRef { raw, _borrow: PhantomData })
    }
    /// A view of memory the caller manages, e.g. a CUDA device pointer. `strides` None = row-major.
    ///
    /// # Safety
    /// `data` must address every element the shape and strides reach, on `device`, for as long as the view is used.
    pub unsafe fn from_raw(
        data: *const c_void,
        dtype: Dtype,
        shape: &[i64],
        strides: Option<&[i64]>,
        device: Device,
    ) -> Result<Self> {
        let raw = describe(data as *mut c_void, dtype, shape, strides, None, device)?;
        Ok(TensorRef { raw, _borrow: PhantomData })
    }
    pub fn shape(&self) -> &[i64] {
        &self.raw.shape[..self.raw.ndim as usize]
    }
    pub fn dtype(&self) -> Option<Dtype> {
        Dtype::from_code(self.raw.dtype)
    }
    pub(crate) fn raw(&self) -> &sys::sparsa_tensor {
        &self.raw
    }
}

/// A writable view of caller memory for the duration of the exclusive borrow `'a`.
pub struct TensorMut<'a> {
    raw: sys::sparsa_tensor,
    _borrow: PhantomData<&'a mut ()>,
}

impl<'a> TensorMut<'a> {
    /// A contiguous row-major CPU tensor over `data`.
    pub fn new<T: Element>(data: &'a mut [T], shape: &[i64]) -> Result<Self> {
        Self::with_dtype(data, T::DTYPE, shape)
    }
    /// A strided CPU tensor over `data` (strides in elements).
    pub fn strided<T: Element>(data: &'a mut [T], shape: &[i64], strides: &[i64]) -> Result<Self> {
        let raw =
            describe(data.as_mut_ptr() as *mut c_void, T::DTYPE, shape, Some(strides), Some(data.len()), Device::Cpu)?;
        Ok(TensorMut { raw, _borrow: PhantomData })
    }
    /// Contiguous IEEE half-precision output given as bits.
    pub fn f16(data: &'a mut [u16], shape: &[i64]) -> Result<Self> {
        Self::with_dtype(data, Dtype::F16, shape)
    }
    /// Contiguous bfloat16 output given as bits.
    pub fn bf16(data: &'a mut [u16], shape: &[i64]) -> Result<Self> {
        Self::with_dtype(data, Dtype::BF16, shape)
    }
    /// Contiguous output of any element type whose size matches `dtype`.
    pub fn with_dtype<T: Copy>(data: &'a mut [T], dtype: Dtype, shape: &[i64]) -> Result<Self> {
        check_element_size::<T>(dtype)?;
        let raw = describe(data.as_mut_ptr() as *mut c_void, dtype, shape, None, Some(data.len()), Device::Cpu)?;
        Ok(TensorMut { raw, _borrow: PhantomData })
    }
    /// A view of writable memory the caller manages, e.g. a CUDA device pointer. `strides` None = row-major.
    ///
    /// # Safety
    /// `data` must address every element the shape and strides reach, on `device`, writable and not otherwise
    /// accessed for as long as the view is used.
    pub unsafe fn from_raw(
        data: *mut c_void,
        dtype: Dtype,
        shape: &[i64],
        strides: Option<&[i64]>,
        device: Device,
    ) -> Result<Self> {
        let raw = describe(data, dtype, shape, strides, None, device)?;
        Ok(TensorMut { raw, _borrow: PhantomData })
    }
    pub fn shape(&self) -> &[i64] {
        &self.raw.shape[..self.raw.ndim as usize]
    }
    pub fn dtype(&self) -> Option<Dtype> {
        Dtype::from_code(self.raw.dtype)
    }
    pub(crate) fn raw(&self) -> &sys::sparsa_tensor {
        &self.raw
    }
}
