package org.sparsa;

import org.sparsa.jni.SWIGTYPE_p_sparsa_selection_cache;
import org.sparsa.jni.SparsaNative;

/**
 * TokenSelect's per-layer selection cache (§6.5), made by {@link Context#newSelectionCache}; pass it to
 * {@link AttentionArgs.Builder#selectionCache}. Use from one thread at a time; close it before its context
 * ({@link #close()} is idempotent).
 */
public final class SelectionCache implements AutoCloseable {
  private SWIGTYPE_p_sparsa_selection_cache handle;
  private Context context; // keeps the context reachable while the cache lives

  SelectionCache(Context context, SWIGTYPE_p_sparsa_selection_cache handle) {
    this.context = context;
    this.handle = handle;
  }

  @Override
  public synchronized void close() {
    if (handle != null) {
      SparsaNative.sparsa_selection_cache_destroy(handle);
      handle = null;
      context = null;
    }
  }

  SWIGTYPE_p_sparsa_selection_cache handle() {
    SWIGTYPE_p_sparsa_selection_cache current = handle;
    if (current == null) {
      throw new SparsaException(Status.NULL_POINTER, "selection_cache: the SelectionCache is closed");
    }
    return current;
  }

  /** Empties every slot and zeroes the counts. */
  public void reset() {
    SparsaNative.sparsa_selection_cache_reset(handle());
  }

  /** Hits since creation or the last reset. */
  public long hits() {
    return counts()[0];
  }

  /** Misses since creation or the last reset. */
  public long misses() {
    return counts()[1];
  }

  /** {hits, misses} since creation or the last reset. */
  public long[] counts() {
    long[] counts = new long[2];
    SparsaNative.sparsa_java_selection_cache_counts(handle(), counts);
    return counts;
  }
}
