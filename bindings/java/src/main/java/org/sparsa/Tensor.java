package org.sparsa;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.Arrays;
import org.sparsa.jni.SparsaNative;
import org.sparsa.jni.sparsa_tensor;

/**
 * A non-owning view the library reads or writes during a call: a direct {@link ByteBuffer} in native byte order
 * (zero copy; the view starts at the buffer's position) or a raw address (device memory, pinned or foreign host
 * memory). Shapes and strides are in elements. A tensor over a buffer keeps the buffer alive.
 */
public final class Tensor {
  /** Largest rank a tensor may have. */
  public static final int MAX_DIMS = 8;

  private final sparsa_tensor descriptor;
  private final ByteBuffer buffer; // null for a raw address
  private final DType dtype;
  private final DeviceType device;
  private final long[] shape;
  private final long[] strides;

  private Tensor(long address, ByteBuffer buffer, DType dtype, DeviceType device, int deviceId, long[] shape,
      long[] strides) {
    this.buffer = buffer;
    this.dtype = dtype;
    this.device = device;
    this.shape = shape.clone();
    this.strides = strides.clone();
    this.descriptor = new sparsa_tensor();
    SparsaNative.sparsa_java_tensor_describe(descriptor, address, dtype.code(), device.code(), deviceId,
        shape.length);
    for (int i = 0; i < shape.length; i++) {
      SparsaNative.sparsa_java_tensor_set_dim(descriptor, i, shape[i], strides[i]);
    }
  }

  /** A direct buffer of {@code product(shape)} elements in native byte order, zero-filled. */
  public static ByteBuffer allocate(DType dtype, long... shape) {
    long bytes = elementCount(shape) * dtype.size();
    if (bytes > Integer.MAX_VALUE) {
      throw new SparsaException(Status.SHAPE_MISMATCH,
          "shape: " + Arrays.toString(shape) + " needs " + bytes + " bytes, more than one ByteBuffer holds");
    }
    return ByteBuffer.allocateDirect((int) bytes).order(ByteOrder.nativeOrder());
  }

  /** A contiguous row-major view of the buffer's remaining bytes, which must be exactly product(shape) elements. */
  public static Tensor of(ByteBuffer buffer, DType dtype, long... shape) {
    checkBuffer(buffer);
    long needed = elementCount(shape) * dtype.size();
    if (buffer.remaining() != needed) {
      throw new SparsaException(Status.SHAPE_MISMATCH, "buffer: shape " + Arrays.toString(shape) + " of " + dtype
          + " needs " + needed + " bytes, the buffer has " + buffer.remaining() + " remaining");
    }
    return new Tensor(addressOf(buffer), buffer, dtype, DeviceType.CPU, 0, shape, contiguousStrides(shape));
  }

  /** A strided view (strides in elements) of the buffer from its position; every element must lie inside. */
  public static Tensor strided(ByteBuffer buffer, DType dtype, long[] shape, long[] strides) {
    checkBuffer(buffer);
    checkShape(shape);
    if (strides.length != shape.length) {
      throw new SparsaException(Status.SHAPE_MISMATCH,
          "strides: expected " + shape.length + " strides (one per dim), got " + strides.length);
    }
    long last = 0;
    boolean empty = false;
    for (int i = 0; i < shape.length; i++) {
      if (strides[i] < 0) {
        throw new SparsaException(Status.SHAPE_MISMATCH, "strides: dim " + i + " has stride " + strides[i]
            + ", expected >= 0");
      }
      empty |= shape[i] == 0;
      last += (shape[i] - 1) * strides[i];
    }
    if (!empty && (last + 1) * dtype.size() > buffer.remaining()) {
      throw new SparsaException(Status.SHAPE_MISMATCH, "strides: the view reaches element " + last
          + " but the buffer holds " + buffer.remaining() / dtype.size() + " " + dtype + " elements");
    }
    return new Tensor(addressOf(buffer), buffer, dtype, DeviceType.CPU, 0, shape, strides);
  }

  /**
   * A contiguous view of memory Java does not manage (a CUDA/ROCm device pointer, pinned host memory). The caller
   * keeps the memory valid during every call that uses the tensor.
   */
  public static Tensor ofAddress(long address, DType dtype, DeviceType device, int deviceId, long... shape) {
    checkShape(shape);
    return new Tensor(address, null, dtype, device, deviceId, shape, contiguousStrides(shape));
  }

  public DType dtype() {
    return dtype;
  }

  public DeviceType device() {
    return device;
  }

  public long[] shape() {
    return shape.clone();
  }

  public long[] strides() {
    return strides.clone();
  }

  /** The buffer this tensor views, or null for a raw address. */
  public ByteBuffer buffer() {
    return buffer;
  }

  sparsa_tensor descriptor() {
    return descriptor;
  }

  /** The descriptor of an optional tensor (null = absent). */
  static sparsa_tensor descriptorOf(Tensor tensor) {
    return tensor == null ? null : tensor.descriptor;
  }

  private static void checkBuffer(ByteBuffer buffer) {
    if (buffer == null) {
      throw new SparsaException(Status.NULL_POINTER, "buffer: expected a direct ByteBuffer, got null");
    }
    if (!buffer.isDirect()) {
      throw new SparsaException(Status.INVALID_ARGUMENT,
          "buffer: expected a direct ByteBuffer (ByteBuffer.allocateDirect), got a heap buffer");
    }
    if (buffer.order() != ByteOrder.nativeOrder()) {
      throw new SparsaException(Status.INVALID_ARGUMENT, "buffer: byte order " + buffer.order()
          + ", expected the native " + ByteOrder.nativeOrder() + " (call order(ByteOrder.nativeOrder()))");
    }
  }

  private static long addressOf(ByteBuffer buffer) {
    if (buffer.capacity() == 0) {
      return 0; // an empty direct buffer may have no address at all
    }
    return SparsaNative.sparsa_java_buffer_address(buffer) + buffer.position();
  }

  private static void checkShape(long[] shape) {
    if (shape.length < 1 || shape.length > MAX_DIMS) {
      throw new SparsaException(Status.SHAPE_MISMATCH,
          "shape: expected 1.." + MAX_DIMS + " dims, got " + shape.length);
    }
    for (int i = 0; i < shape.length; i++) {
      if (shape[i] < 0) {
        throw new SparsaException(Status.SHAPE_MISMATCH, "shape: dim " + i + " is " + shape[i] + ", expected >= 0");
      }
    }
  }

  private static long elementCount(long[] shape) {
    checkShape(shape);
    long count = 1;
    for (long extent : shape) {
      count = Math.multiplyExact(count, extent);
    }
    return count;
  }

  private static long[] contiguousStrides(long[] shape) {
    long[] strides = new long[shape.length];
    long stride = 1;
    for (int i = shape.length - 1; i >= 0; i--) {
      strides[i] = stride;
      stride *= shape[i];
    }
    return strides;
  }
}
