package org.sparsa;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.FloatBuffer;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.function.Executable;

/** The idiomatic API: handles, error classes, validation, and that a failed call writes nothing. */
class ApiTest {
  private static final float UNTOUCHED = -7f;

  static SparsaException expect(Status status, Executable call, String... words) {
    SparsaException error = assertThrows(SparsaException.class, call);
    assertEquals(status, error.status(), error.getMessage());
    assertFalse(error.detail().isEmpty(), "empty message");
    for (String word : words) {
      assertTrue(error.detail().contains(word), error.detail() + " does not mention " + word);
    }
    return error;
  }

  static Tensor floats(long... shape) {
    ByteBuffer buffer = Tensor.allocate(DType.F32, shape);
    FloatBuffer values = buffer.asFloatBuffer();
    for (int i = 0; i < values.capacity(); i++) {
      values.put(i, (i % 7) * 0.25f);
    }
    return Tensor.of(buffer, DType.F32, shape);
  }

  static Tensor poisoned(long... shape) {
    Tensor tensor = Tensor.of(Tensor.allocate(DType.F32, shape), DType.F32, shape);
    FloatBuffer values = tensor.buffer().asFloatBuffer();
    for (int i = 0; i < values.capacity(); i++) {
      values.put(i, UNTOUCHED);
    }
    return tensor;
  }

  static void assertUntouched(Tensor tensor) {
    FloatBuffer values = tensor.buffer().asFloatBuffer();
    for (int i = 0; i < values.capacity(); i++) {
      assertEquals(UNTOUCHED, values.get(i), "element " + i + " written by a failed call");
    }
  }

  @Test
  void version() {
    assertEquals(Sparsa.HEADER_VERSION, Sparsa.version());
    int v = Sparsa.HEADER_VERSION;
    assertEquals(v / 10000 + "." + v / 100 % 100 + "." + v % 100, Sparsa.versionString());
    assertEquals("SPARSA_STATUS_SHAPE_MISMATCH", Sparsa.statusName(Status.SHAPE_MISMATCH));
    assertEquals("SPARGE", Sparsa.policyKindName(PolicyKind.SPARGE));
  }

  @Test
  void closeTwiceAndUseAfterClose() {
    Context ctx = Context.create(new ContextOptions().numThreads(1));
    assertEquals(DeviceType.CPU, ctx.deviceType());
    assertTrue(ctx.scratchBytes() >= 0);
    ctx.setStream(0);
    SelectionCache cache = ctx.newSelectionCache(1, 2, 1, 4, 8);
    cache.reset();
    assertArrayEquals(new long[] {0, 0}, cache.counts());
    cache.close();
    cache.close();
    expect(Status.NULL_POINTER, cache::hits, "closed");
    ctx.close();
    ctx.close();
    expect(Status.NULL_POINTER, ctx::scratchBytes, "closed");
  }

  @Test
  void backendUnavailable() {
    try (Context ctx = Context.create(new ContextOptions().device(DeviceType.ROCM))) {
      assertEquals(DeviceType.ROCM, ctx.deviceType()); // a ROCm backend and device are present
    } catch (SparsaException error) {
      assertEquals(Status.BACKEND_UNAVAILABLE, error.status());
    }
  }

  @Test
  void policyDefaults() {
    Policy sparge = Policy.builder(PolicyKind.SPARGE).build();
    assertEquals(PolicyKind.SPARGE.code(), sparge.kindCode());
    assertEquals(0.6f, sparge.spargeTheta());
    assertEquals(128, sparge.blockQ());
    assertEquals(Float.NEGATIVE_INFINITY, sparge.spargeLambda());
    assertEquals(2048, sparge.selectTopK());
    Policy changed = Policy.builder(PolicyKind.SINK_WINDOW).sinkTokens(4).flags(Policy.FLAG_DELTA).build();
    assertEquals(4, changed.sinkTokens());
    assertEquals(Policy.FLAG_DELTA, changed.flags());
    expect(Status.INVALID_ARGUMENT, () -> Policy.builder(99));
  }

  @Test
  void wrongDType() {
    try (Context ctx = Context.create()) {
      long[] shape = {1, 4, 2, 4};
      Tensor halfK = Tensor.of(Tensor.allocate(DType.F16, shape), DType.F16, shape);
      Tensor out = poisoned(shape);
      AttentionArgs args = AttentionArgs.builder().q(floats(shape)).k(halfK).v(floats(shape)).out(out).build();
      expect(Status.DTYPE_MISMATCH, () -> ctx.attention(args), "k");
      assertUntouched(out);
    }
    expect(Status.DTYPE_MISMATCH, () -> DType.fromCode(42), "42");
  }

  @Test
  void wrongSize() {
    expect(Status.SHAPE_MISMATCH, () -> Tensor.of(Tensor.allocate(DType.F32, 5), DType.F32, 2, 3), "[2, 3]");
    expect(Status.SHAPE_MISMATCH, () -> Tensor.of(Tensor.allocate(DType.F32, 1), DType.F32, new long[9]), "dims");
    expect(Status.INVALID_ARGUMENT, () -> Tensor.of(ByteBuffer.allocate(4), DType.F32, 1), "direct");
    expect(Status.INVALID_ARGUMENT,
        () -> Tensor.of(ByteBuffer.allocateDirect(4).order(ByteOrder.BIG_ENDIAN), DType.F32, 1), "order");
    expect(Status.SHAPE_MISMATCH, () -> Tensor.strided(Tensor.allocate(DType.F32, 6), DType.F32,
        new long[] {2, 3}, new long[] {4, 1}), "reaches");
    try (Context ctx = Context.create()) {
      Tensor out = poisoned(1, 3, 2, 4);
      AttentionArgs args = AttentionArgs.builder()
          .q(floats(1, 4, 2, 4)).k(floats(1, 4, 2, 4)).v(floats(1, 4, 2, 4)).out(out).build();
      expect(Status.SHAPE_MISMATCH, () -> ctx.attention(args), "out");
      assertUntouched(out);
      Tensor indices = Tensor.of(Tensor.allocate(DType.I32, 1, 1, 4), DType.I32, 1, 1, 4);
      expect(Status.SHAPE_MISMATCH, () -> ctx.topkFromScores(floats(1, 1, 3), 4, 1, indices), "k");
    }
  }

  @Test
  void indexOutOfRange() {
    try (Context ctx = Context.create()) {
      ByteBuffer ids = Tensor.allocate(DType.I32, 1, 1, 2);
      ids.asIntBuffer().put(new int[] {0, 99});
      Policy policy = Policy.builder(PolicyKind.TOKEN_INDICES).indices(Tensor.of(ids, DType.I32, 1, 1, 2)).build();
      Tensor out = poisoned(1, 4, 2, 4);
      AttentionArgs args = AttentionArgs.builder()
          .q(floats(1, 4, 2, 4)).k(floats(1, 4, 2, 4)).v(floats(1, 4, 2, 4)).out(out).build();
      expect(Status.INDEX_OUT_OF_RANGE, () -> ctx.attention(args, policy), "indices");
      assertUntouched(out);
    }
  }

  @Test
  void attentionPlansRunsAndCounts() {
    try (Context ctx = Context.create()) {
      long[] shape = {1, 4, 2, 4};
      Tensor out = poisoned(shape);
      ByteBuffer stats = Tensor.allocate(DType.I64, AttentionArgs.Stat.COUNT);
      AttentionArgs args = AttentionArgs.builder().q(floats(shape)).k(floats(shape)).v(floats(shape)).out(out)
          .causal(true).stats(Tensor.of(stats, DType.I64, AttentionArgs.Stat.COUNT)).build();
      ctx.plan(args, null);
      assertUntouched(out);
      ctx.attention(args, Policy.builder(PolicyKind.DENSE).build());
      assertEquals(20, stats.asLongBuffer().get(AttentionArgs.Stat.PAIRS_COMPUTED));
      assertEquals(20, stats.asLongBuffer().get(AttentionArgs.Stat.PAIRS_DENSE));
    }
  }

  @Test
  void deviceAddressOnACpuContext() {
    try (Context ctx = Context.create()) {
      Tensor device = Tensor.ofAddress(0x10000, DType.F32, DeviceType.CUDA, 0, 1, 1, 3);
      Tensor indices = Tensor.of(Tensor.allocate(DType.I32, 1, 1, 1), DType.I32, 1, 1, 1);
      expect(Status.DEVICE_MISMATCH, () -> ctx.topkFromScores(device, 1, 1, indices));
    }
  }

  @Test
  void hilbertPermutation() {
    int[][] result = Sparsa.hilbertPermutation(2, 3, 5);
    int[] perm = result[0];
    int[] inverse = result[1];
    boolean[] seen = new boolean[perm.length];
    for (int i = 0; i < perm.length; i++) {
      assertFalse(seen[perm[i]]);
      seen[perm[i]] = true;
      assertEquals(i, inverse[perm[i]]);
    }
    expect(Status.SHAPE_MISMATCH,
        () -> Sparsa.hilbertPermutation(2, 3, 5, Tensor.allocate(DType.I32, 29), null), "perm");
    assertThrows(SparsaException.class, () -> Sparsa.hilbertPermutation(-1, 3, 5));
  }

  @Test
  void spargeTuneAndClosedCache() {
    try (Context ctx = Context.create()) {
      long[] shape = {1, 64, 2, 4};
      AttentionArgs args = AttentionArgs.builder().q(floats(shape)).k(floats(shape)).v(floats(shape))
          .out(poisoned(shape)).build();
      ByteBuffer params = Tensor.allocate(DType.F32, 2, 4);
      ctx.spargeTune(args, null, new SpargeTuneOptions().searchSteps(3), Tensor.of(params, DType.F32, 2, 4),
          Tensor.of(Tensor.allocate(DType.F32, 2, 2), DType.F32, 2, 2));
      for (int head = 0; head < 2; head++) {
        float theta = params.asFloatBuffer().get(head * 4);
        assertTrue(theta >= -1 && theta <= 1, "theta " + theta);
      }
      expect(Status.SHAPE_MISMATCH,
          () -> ctx.spargeTune(args, null, null, Tensor.of(Tensor.allocate(DType.F32, 3), DType.F32, 3), null));

      SelectionCache cache = ctx.newSelectionCache(1, 2, 2, 4, 64);
      AttentionArgs cached = AttentionArgs.builder().q(floats(1, 1, 2, 4)).k(floats(shape)).v(floats(shape))
          .out(poisoned(1, 1, 2, 4)).selectionCache(cache).build();
      // A selection smaller than the 64 keys, so the run selects (and consults the cache) instead of going dense.
      Policy select = Policy.builder(PolicyKind.TOKEN_SELECT).selectNInit(1).selectNLocal(1).selectTopK(8).build();
      ctx.attention(cached, select);
      assertEquals(1, cache.hits() + cache.misses());
      cache.close();
      expect(Status.NULL_POINTER, () -> ctx.attention(cached, null), "closed");
    }
  }

  /** Failing calls on many threads at once: each exception carries its own call's message. */
  @Test
  void messageReadInTheFailingCall() throws Exception {
    ExecutorService pool = Executors.newFixedThreadPool(4);
    try {
      List<Future<?>> results = new ArrayList<>();
      for (int task = 0; task < 8; task++) {
        int id = task;
        results.add(pool.submit(() -> {
          Tensor draft = floats(1, 1, 4);
          Tensor target = floats(1, 1, 4);
          Tensor map = Tensor.of(Tensor.allocate(DType.I32, 1), DType.I32, 1);
          for (int round = 0; round < 100; round++) {
            int k = 100 + id * 1000 + round;
            SparsaException error =
                assertThrows(SparsaException.class, () -> Sparsa.headMapping(draft, target, k, map));
            assertTrue(error.detail().contains(Integer.toString(k)), error.detail());
          }
        }));
      }
      for (Future<?> result : results) {
        result.get();
      }
    } finally {
      pool.shutdown();
      pool.awaitTermination(10, TimeUnit.SECONDS);
    }
  }
}
