package org.sparsa;

/** Options of {@link Context#create(ContextOptions)}; the defaults are the library's (CPU, all cores). */
public final class ContextOptions {
  private DeviceType device = DeviceType.CPU;
  private int deviceId;
  private long stream;
  private int numThreads;

  /** Backend: CPU (default), CUDA or ROCM. */
  public ContextOptions device(DeviceType device) {
    this.device = device;
    return this;
  }

  /** GPU ordinal; ignored on CPU. */
  public ContextOptions deviceId(int deviceId) {
    this.deviceId = deviceId;
    return this;
  }

  /** cudaStream_t / hipStream_t address every GPU run enqueues on; 0 = default stream. */
  public ContextOptions stream(long stream) {
    this.stream = stream;
    return this;
  }

  /** CPU worker threads; 0 = one per online core. */
  public ContextOptions numThreads(int numThreads) {
    this.numThreads = numThreads;
    return this;
  }

  DeviceType device() {
    return device;
  }

  int deviceId() {
    return deviceId;
  }

  long stream() {
    return stream;
  }

  int numThreads() {
    return numThreads;
  }
}
