package org.sparsa;

/** Element types (values of {@code sparsa_dtype}). F16 and BF16 are raw 16-bit patterns in the buffer. */
public enum DType {
  F32(1, 4),
  F16(2, 2),
  BF16(3, 2),
  F64(4, 8),
  I32(5, 4),
  I64(6, 8),
  U8(7, 1),
  I8(8, 1);

  private final int code;
  private final int size;

  DType(int code, int size) {
    this.code = code;
    this.size = size;
  }

  public int code() {
    return code;
  }

  /** Bytes per element. */
  public int size() {
    return size;
  }

  public static DType fromCode(int code) {
    for (DType dtype : values()) {
      if (dtype.code == code) {
        return dtype;
      }
    }
    throw new SparsaException(Status.DTYPE_MISMATCH, "dtype: expected a known sparsa dtype, got " + code);
  }
}
