package org.sparsa;

/**
 * Every failure of the library (and of this binding's own checks, which use the same statuses): the status and the
 * message naming the argument, what was expected and what came. The message is read inside the native call that
 * failed, so it is always this call's message.
 */
public class SparsaException extends RuntimeException {
  private static final long serialVersionUID = 1L;

  private final int statusCode;
  private final String detail;

  /** Called from native code with a {@code sparsa_status} and the library's message. */
  public SparsaException(int statusCode, String detail) {
    super(Status.fromCode(statusCode).name() + ": " + detail);
    this.statusCode = statusCode;
    this.detail = detail;
  }

  SparsaException(Status status, String detail) {
    this(status.code(), detail);
  }

  /** The status class of the failure. */
  public Status status() {
    return Status.fromCode(statusCode);
  }

  /** The raw {@code sparsa_status} value (useful if a newer library returns a status this binding lacks). */
  public int statusCode() {
    return statusCode;
  }

  /** The library's message alone, without the status prefix. */
  public String detail() {
    return detail;
  }
}
