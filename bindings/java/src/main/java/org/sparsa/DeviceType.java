package org.sparsa;

/** Where memory lives (values of {@code sparsa_device_type}, which are DLPack's device codes). */
public enum DeviceType {
  CPU(1),
  CUDA(2),
  /** Pinned host memory. */
  CUDA_HOST(3),
  ROCM(10);

  private final int code;

  DeviceType(int code) {
    this.code = code;
  }

  public int code() {
    return code;
  }

  public static DeviceType fromCode(int code) {
    for (DeviceType device : values()) {
      if (device.code == code) {
        return device;
      }
    }
    throw new SparsaException(Status.INVALID_ARGUMENT, "device_type: unknown value " + code);
  }
}
