package org.sparsa;

import static org.junit.jupiter.api.Assertions.assertEquals;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.DoubleBuffer;
import java.nio.FloatBuffer;
import java.nio.IntBuffer;
import java.nio.LongBuffer;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import org.junit.jupiter.api.Test;

/**
 * Context-parallel TOKEN_SELECT decode (docs/context_parallel.md) on two simulated shards of one sequence: the
 * shards' index sets together equal the single-context selection, and the merged state its output. The same problem
 * as bindings/rust/sparsa/tests/context_parallel.rs.
 */
class ContextParallelTest {
  private static final int KEYS = 200;
  private static final int Q_HEADS = 4;
  private static final int KV_HEADS = 2;
  private static final int DIM = 8;
  private static final int TOP_K = 20;
  private static final int[] CUTS = {0, 77, KEYS}; // shards [0, 77) and [77, 200)
  private static final int SHARDS = CUTS.length - 1;
  private static final long[] Q_SHAPE = {1, 1, Q_HEADS, DIM};
  private static final long[] LSE_SHAPE = {1, Q_HEADS, 1};
  private static final long[] MAX_SHAPE = {1, Q_HEADS};
  private static final long[] SUM_SHAPE = {1, Q_HEADS, Context.CP_SUM_DIGITS};
  private static final long[] LIST_SHAPE = {1, 1, TOP_K};
  private static final long[] GATHERED_SHAPE = {SHARDS, 1, 1, TOP_K};
  private static final int POISON = -7;
  private static final double TOLERANCE = 1e-5; // relative: the merge reorders the fp32 softmax sums

  /** Deterministic inputs in [-1, 1). */
  private static float[] values(int n, int seed) {
    float[] values = new float[n];
    for (int i = 0; i < n; i++) {
      long hash = Integer.toUnsignedLong(i * (int) 2654435761L + seed) >>> 16; // u32 arithmetic, as in Rust
      values[i] = (hash % 200) / 100f - 1f;
    }
    return values;
  }

  private static Tensor floats(float[] values, long... shape) {
    ByteBuffer buffer = Tensor.allocate(DType.F32, shape);
    buffer.asFloatBuffer().put(values);
    return Tensor.of(buffer, DType.F32, shape);
  }

  private static Tensor ints(int[] values, long... shape) {
    ByteBuffer buffer = Tensor.allocate(DType.I32, shape);
    buffer.asIntBuffer().put(values);
    return Tensor.of(buffer, DType.I32, shape);
  }

  private static Tensor filled(DType dtype, double value, long... shape) {
    Tensor tensor = Tensor.of(Tensor.allocate(dtype, shape), dtype, shape);
    ByteBuffer buffer = tensor.buffer();
    for (int i = 0; i < buffer.capacity() / dtype.size(); i++) {
      switch (dtype) {
        case F32 -> buffer.putFloat(i * 4, (float) value);
        case F64 -> buffer.putDouble(i * 8, value);
        case I32 -> buffer.putInt(i * 4, (int) value);
        case I64 -> buffer.putLong(i * 8, (long) value);
        default -> throw new IllegalArgumentException(dtype.toString());
      }
    }
    return tensor;
  }

  /** Elements [first, first + count) of a gathered buffer as a tensor of the given shape, sharing its memory. */
  private static Tensor slot(Tensor gathered, DType dtype, int first, int count, long... shape) {
    int size = dtype.size();
    ByteBuffer view = gathered.buffer().slice(first * size, count * size).order(ByteOrder.nativeOrder());
    return Tensor.of(view, dtype, shape);
  }

  private static Policy tokenSelect() {
    return Policy.builder(PolicyKind.TOKEN_SELECT).selectNInit(4).selectNLocal(8).selectTopK(TOP_K)
        .selectCacheTheta(1f).build();
  }

  /** One shard: its keys, and the arguments of its run (the selection calls do not write out or lse). */
  private record Shard(AttentionArgs args, int keys, Tensor kvStart, Tensor out, Tensor lse) {
    static List<Shard> split(float[] q, float[] k, float[] v) {
      int rowSize = KV_HEADS * DIM;
      List<Shard> shards = new ArrayList<>();
      for (int g = 0; g < SHARDS; g++) {
        int keys = CUTS[g + 1] - CUTS[g];
        long[] shape = {1, keys, KV_HEADS, DIM};
        float[] shardK = Arrays.copyOfRange(k, CUTS[g] * rowSize, CUTS[g + 1] * rowSize);
        float[] shardV = Arrays.copyOfRange(v, CUTS[g] * rowSize, CUTS[g + 1] * rowSize);
        Tensor out = filled(DType.F32, POISON, Q_SHAPE);
        Tensor lse = filled(DType.F32, POISON, LSE_SHAPE);
        AttentionArgs args = AttentionArgs.builder().q(floats(q, Q_SHAPE)).k(floats(shardK, shape))
            .v(floats(shardV, shape)).out(out).lse(lse).build();
        shards.add(new Shard(args, keys, ints(new int[] {CUTS[g]}, 1), out, lse));
      }
      return shards;
    }
  }

  @Test
  void twoShardsSelectWhatOneContextSelectsAndMergeToItsOutput() {
    float[] q = values(Q_HEADS * DIM, 1);
    float[] k = values(KEYS * KV_HEADS * DIM, 2);
    float[] v = values(KEYS * KV_HEADS * DIM, 3);
    Policy policy = tokenSelect();
    long[] kvShape = {1, KEYS, KV_HEADS, DIM};
    try (Context ctx = Context.create()) {
      // One context over the whole cache.
      Tensor wantOut = filled(DType.F32, POISON, Q_SHAPE);
      Tensor wantLse = filled(DType.F32, POISON, LSE_SHAPE);
      Tensor selected = filled(DType.I32, POISON, 1, 1, KEYS);
      ctx.attention(AttentionArgs.builder().q(floats(q, Q_SHAPE)).k(floats(k, kvShape)).v(floats(v, kvShape))
          .out(wantOut).lse(wantLse).selectedIndices(selected).build(), policy);
      IntBuffer selectedIds = selected.buffer().asIntBuffer();
      List<Integer> want = new ArrayList<>();
      for (int i = 0; i < KEYS; i++) {
        if (selectedIds.get(i) >= 0) {
          want.add(selectedIds.get(i));
        }
      }

      // The four steps on every shard, the collectives done by hand in between.
      List<Shard> shards = Shard.split(q, k, v);
      Tensor kvTotal = ints(new int[] {KEYS}, 1);
      Tensor globalMax = filled(DType.F64, Double.NEGATIVE_INFINITY, MAX_SHAPE);
      for (Shard shard : shards) { // step 1, all-reduce max
        Tensor localMax = filled(DType.F64, POISON, MAX_SHAPE);
        ctx.cpSelectMax(shard.args(), policy, shard.kvStart(), kvTotal, localMax);
        DoubleBuffer local = localMax.buffer().asDoubleBuffer();
        DoubleBuffer global = globalMax.buffer().asDoubleBuffer();
        for (int h = 0; h < Q_HEADS; h++) {
          global.put(h, Math.max(global.get(h), local.get(h)));
        }
      }
      Tensor globalSum = filled(DType.I64, 0, SUM_SHAPE);
      for (Shard shard : shards) { // step 2, all-reduce sum
        Tensor localSum = filled(DType.I64, POISON, SUM_SHAPE);
        ctx.cpSelectSum(shard.args(), policy, shard.kvStart(), kvTotal, globalMax, localSum);
        LongBuffer local = localSum.buffer().asLongBuffer();
        LongBuffer global = globalSum.buffer().asLongBuffer();
        for (int i = 0; i < global.capacity(); i++) {
          global.put(i, global.get(i) + local.get(i));
        }
      }
      Tensor allVotes = filled(DType.F64, POISON, GATHERED_SHAPE);
      Tensor allPositions = filled(DType.I32, POISON, GATHERED_SHAPE);
      for (int g = 0; g < SHARDS; g++) { // step 3, all-gather: each shard writes its slot of the gathered lists
        Shard shard = shards.get(g);
        ctx.cpSelectTopk(shard.args(), policy, shard.kvStart(), kvTotal, globalMax, globalSum,
            slot(allVotes, DType.F64, g * TOP_K, TOP_K, LIST_SHAPE),
            slot(allPositions, DType.I32, g * TOP_K, TOP_K, LIST_SHAPE));
      }
      List<Integer> got = new ArrayList<>();
      for (int g = 0; g < SHARDS; g++) { // step 4, then the shard's TOKEN_INDICES run with LSE
        Shard shard = shards.get(g);
        Tensor ids = filled(DType.I32, POISON, 1, 1, shard.keys());
        ctx.cpSelectIndices(shard.args(), policy, shard.kvStart(), kvTotal, allVotes, allPositions, ids);
        IntBuffer local = ids.buffer().asIntBuffer();
        for (int i = 0; i < shard.keys(); i++) {
          if (local.get(i) >= 0) {
            got.add(local.get(i) + CUTS[g]);
          }
        }
        ctx.attention(shard.args(), Policy.builder(PolicyKind.TOKEN_INDICES).indices(ids).build());
      }
      got.sort(null);
      assertEquals(want, got, "the shards' index set against one context's");

      Tensor out = filled(DType.F32, POISON, Q_SHAPE);
      Tensor lse = filled(DType.F32, POISON, LSE_SHAPE);
      ctx.mergeStates(shards.get(0).out(), shards.get(0).lse(), shards.get(1).out(), shards.get(1).lse(), out, lse);
      FloatBuffer gotOut = out.buffer().asFloatBuffer();
      FloatBuffer oneOut = wantOut.buffer().asFloatBuffer();
      double scale = 0;
      for (int i = 0; i < oneOut.capacity(); i++) {
        scale = Math.max(scale, Math.abs(oneOut.get(i)));
      }
      for (int i = 0; i < oneOut.capacity(); i++) {
        assertEquals(oneOut.get(i), gotOut.get(i), TOLERANCE * scale, "out[" + i + "]");
      }
      FloatBuffer gotLse = lse.buffer().asFloatBuffer();
      FloatBuffer oneLse = wantLse.buffer().asFloatBuffer();
      for (int h = 0; h < Q_HEADS; h++) {
        assertEquals(oneLse.get(h), gotLse.get(h), TOLERANCE * Math.max(Math.abs(oneLse.get(h)), 1), "lse[" + h + "]");
      }
    }
  }

  /** Each tensor reaches the C parameter of its name, and a failed call writes nothing. */
  @Test
  void argumentsReachTheirParametersAndFailuresWriteNothing() {
    float[] q = values(Q_HEADS * DIM, 1);
    float[] k = values(KEYS * KV_HEADS * DIM, 2);
    Shard shard = Shard.split(q, k, k).get(1);
    Policy policy = tokenSelect();
    Tensor kvTotal = ints(new int[] {KEYS}, 1);
    Tensor wrong = filled(DType.F32, 0, 1); // F32 where every parameter wants another dtype
    Tensor max = filled(DType.F64, 0, MAX_SHAPE);
    Tensor sum = filled(DType.I64, 0, SUM_SHAPE);
    Tensor votes = filled(DType.F64, POISON, LIST_SHAPE);
    Tensor positions = filled(DType.I32, POISON, LIST_SHAPE);
    Tensor gathered = filled(DType.F64, 0, GATHERED_SHAPE);
    Tensor gatheredPositions = filled(DType.I32, 0, GATHERED_SHAPE);
    Tensor start = shard.kvStart();
    AttentionArgs args = shard.args();
    try (Context ctx = Context.create()) {
      List<Object[]> cases = List.of(
          new Object[] {"kv_start", (Runnable) () -> ctx.cpSelectMax(args, policy, wrong, kvTotal, max)},
          new Object[] {"kv_total", (Runnable) () -> ctx.cpSelectMax(args, policy, start, wrong, max)},
          new Object[] {"out_max", (Runnable) () -> ctx.cpSelectMax(args, policy, start, kvTotal, wrong)},
          new Object[] {"global_max", (Runnable) () -> ctx.cpSelectSum(args, policy, start, kvTotal, wrong, sum)},
          new Object[] {"out_sum", (Runnable) () -> ctx.cpSelectSum(args, policy, start, kvTotal, max, wrong)},
          new Object[] {"global_sum",
              (Runnable) () -> ctx.cpSelectTopk(args, policy, start, kvTotal, max, wrong, votes, positions)},
          new Object[] {"out_votes",
              (Runnable) () -> ctx.cpSelectTopk(args, policy, start, kvTotal, max, sum, wrong, positions)},
          new Object[] {"out_positions",
              (Runnable) () -> ctx.cpSelectTopk(args, policy, start, kvTotal, max, sum, votes, wrong)},
          new Object[] {"all_votes", (Runnable) () -> ctx.cpSelectIndices(args, policy, start, kvTotal, wrong,
              gatheredPositions, positions)},
          new Object[] {"all_positions",
              (Runnable) () -> ctx.cpSelectIndices(args, policy, start, kvTotal, gathered, wrong, positions)},
          new Object[] {"out_indices", (Runnable) () -> ctx.cpSelectIndices(args, policy, start, kvTotal, gathered,
              gatheredPositions, wrong)});
      for (Object[] c : cases) {
        Runnable call = (Runnable) c[1];
        ApiTest.expect(Status.DTYPE_MISMATCH, call::run, (String) c[0]);
      }

      // The protocol's own refusals: another policy, and a selection cache (each shard would keep a different part).
      Policy dense = Policy.builder(PolicyKind.DENSE).build();
      ApiTest.expect(Status.INVALID_ARGUMENT,
          () -> ctx.cpSelectTopk(args, dense, start, kvTotal, max, sum, votes, positions));
      try (SelectionCache cache = ctx.newSelectionCache(1, Q_HEADS, KV_HEADS, DIM, TOP_K)) {
        AttentionArgs cached = AttentionArgs.builder().q(floats(q, Q_SHAPE))
            .k(floats(Arrays.copyOf(k, 10 * KV_HEADS * DIM), 1, 10, KV_HEADS, DIM))
            .v(floats(Arrays.copyOf(k, 10 * KV_HEADS * DIM), 1, 10, KV_HEADS, DIM))
            .selectionCache(cache).build();
        ApiTest.expect(Status.INVALID_ARGUMENT,
            () -> ctx.cpSelectTopk(cached, policy, ints(new int[] {0}, 1), kvTotal, max, sum, votes, positions),
            "selection_cache");
      }
    }
    DoubleBuffer writtenVotes = votes.buffer().asDoubleBuffer();
    IntBuffer writtenPositions = positions.buffer().asIntBuffer();
    for (int i = 0; i < TOP_K; i++) {
      assertEquals(POISON, writtenVotes.get(i), "votes[" + i + "] written by a failed call");
      assertEquals(POISON, writtenPositions.get(i), "positions[" + i + "] written by a failed call");
    }
    FloatBuffer out = shard.out().buffer().asFloatBuffer();
    for (int i = 0; i < out.capacity(); i++) {
      assertEquals(POISON, out.get(i), "out[" + i + "] written by a selection call");
    }
  }
}
