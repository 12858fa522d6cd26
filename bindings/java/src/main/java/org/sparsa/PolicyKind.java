package org.sparsa;

/** Which keys each query row attends to (values of {@code sparsa_policy_kind}; ALGORITHMS.md §1–§7). */
public enum PolicyKind {
  DENSE(0),
  SINK_WINDOW(1),
  BLOCK_SPARSE(2),
  SPARGE(3),
  TOKEN_SPARSE(4),
  TOKEN_SELECT(5),
  TOKEN_INDICES(6);

  private final int code;

  PolicyKind(int code) {
    this.code = code;
  }

  public int code() {
    return code;
  }
}
