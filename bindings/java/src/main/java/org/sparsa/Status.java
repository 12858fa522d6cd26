package org.sparsa;

/** Values of {@code sparsa_status_code} (never renumbered). */
public enum Status {
  SUCCESS(0),
  INVALID_ARGUMENT(1),
  NULL_POINTER(2),
  DTYPE_MISMATCH(3),
  SHAPE_MISMATCH(4),
  INDEX_OUT_OF_RANGE(5),
  DEVICE_MISMATCH(6),
  STRUCT_SIZE(7),
  UNSUPPORTED(8),
  BACKEND_UNAVAILABLE(9),
  OUT_OF_MEMORY(10),
  DEVICE_ERROR(11),
  INTERNAL(12),
  /** A status this binding does not know (from a newer library); see {@link SparsaException#statusCode()}. */
  UNKNOWN(-1);

  private final int code;

  Status(int code) {
    this.code = code;
  }

  public int code() {
    return code;
  }

  public static Status fromCode(int code) {
    for (Status status : values()) {
      if (status.code == code) {
        return status;
      }
    }
    return UNKNOWN;
  }
}
