package org.sparsa;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;
import static org.junit.jupiter.api.Assertions.fail;

import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.Arrays;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;
import java.util.function.BiConsumer;
import java.util.stream.Collectors;
import java.util.stream.Stream;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.Assumptions;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.DynamicTest;
import org.junit.jupiter.api.TestFactory;

/** Runs every shared vector (tests/vectors/*.spv) and compares every output byte for byte. */
class VectorsTest {
  private static final byte POISON = (byte) 0xA5;
  private static Context context;

  @BeforeAll
  static void open() {
    context = Context.create();
  }

  @AfterAll
  static void close() {
    context.close();
  }

  static Path vectorsDir() {
    String dir = System.getenv("SPARSA_VECTORS_DIR");
    return dir != null && !dir.isEmpty() ? Paths.get(dir) : Paths.get("..", "..", "tests", "vectors");
  }

  @TestFactory
  Stream<DynamicTest> everyVector() throws IOException {
    Path dir = vectorsDir();
    Assumptions.assumeTrue(Files.isDirectory(dir), "no vectors folder at " + dir);
    List<Path> paths;
    try (Stream<Path> listing = Files.list(dir)) {
      paths = listing.filter(p -> p.toString().endsWith(".spv")).sorted().collect(Collectors.toList());
    }
    Assumptions.assumeFalse(paths.isEmpty(), "no *.spv vectors in " + dir);
    return paths.stream().map(path -> DynamicTest.dynamicTest(path.getFileName().toString(),
        () -> new Case(VectorFile.read(path)).run(context)));
  }

  /** One vector being run: its inputs as tensors and the outputs it compares. */
  static final class Case {
    private final VectorFile file;
    private final Map<String, ByteBuffer> outputs = new TreeMap<>();

    Case(VectorFile file) {
      this.file = file;
    }

    Tensor input(String name) {
      String full = "in." + name;
      if (!file.has(full)) {
        return null;
      }
      VectorFile.Entry entry = file.get(full, VectorFile.TENSOR);
      ByteBuffer buffer = Tensor.allocate(DType.U8, entry.data.length);
      buffer.put(entry.data).flip();
      return Tensor.of(buffer, DType.fromCode(entry.dtype), entry.shape);
    }

    ByteBuffer outputBuffer(String name) {
      String full = "out." + name;
      if (!file.has(full)) {
        return null;
      }
      VectorFile.Entry entry = file.get(full, VectorFile.TENSOR);
      ByteBuffer buffer = Tensor.allocate(DType.U8, entry.data.length);
      if (!name.equals("k_dst") && !name.equals("v_dst")) {
        byte[] poison = new byte[entry.data.length];
        Arrays.fill(poison, POISON);
        buffer.put(poison).flip();
      }
      outputs.put(full, buffer);
      return buffer;
    }

    Tensor output(String name) {
      ByteBuffer buffer = outputBuffer(name);
      if (buffer == null) {
        return null;
      }
      VectorFile.Entry entry = file.get("out." + name, VectorFile.TENSOR);
      return Tensor.of(buffer, DType.fromCode(entry.dtype), entry.shape);
    }

    Policy policy() {
      if (!file.has("policy.kind")) {
        return null;
      }
      Policy.Builder builder = Policy.builder((int) file.get("policy.kind", VectorFile.INT).intValue);
      for (Map.Entry<String, VectorFile.Entry> e : file.entries.entrySet()) {
        String name = e.getKey();
        if (!name.startsWith("policy.") || name.equals("policy.kind")) {
          continue;
        }
        BiConsumer<Policy.Builder, VectorFile.Entry> setter = POLICY_SETTERS.get(name.substring(7));
        if (setter == null) {
          fail(name + ": no Policy.Builder method for this C field");
        }
        setter.accept(builder, e.getValue());
      }
      return builder.blockMask(input("block_mask")).spargeHeadParams(input("sparge_head_params"))
          .indices(input("indices")).headMap(input("head_map")).build();
    }

    void call(Context ctx, String op) {
      switch (op) {
        case "attention":
          attention(ctx);
          return;
        case "merge_states":
          ctx.mergeStates(input("o_a"), input("lse_a"), input("o_b"), input("lse_b"), output("out"),
              output("out_lse"));
          return;
        case "topk_from_scores":
          ctx.topkFromScores(input("scores"), (int) file.intOr("arg.k", 0), (int) file.intOr("arg.block_size", 1),
              output("indices"));
          return;
        case "head_mapping":
          Sparsa.headMapping(input("draft"), input("target"), (int) file.intOr("arg.k", 0), output("map"));
          return;
        case "hilbert_permutation":
          Sparsa.hilbertPermutation((int) file.intOr("arg.t", 0), (int) file.intOr("arg.h", 0),
              (int) file.intOr("arg.w", 0), outputBuffer("perm"), outputBuffer("inverse"));
          return;
        case "drift_select_layers":
          Sparsa.driftSelectLayers(input("h_in"), input("h_out"), (float) file.floatOr("arg.delta", 0),
              output("ratio"), output("sparse"));
          return;
        case "kv_prefetch":
          ctx.kvPrefetch(input("k_src"), input("v_src"), input("indices"), output("k_dst"), output("v_dst"),
              output("positions"), output("remapped"), output("counts"));
          return;
        default:
          fail("unknown op " + op);
      }
    }

    private void attention(Context ctx) {
      AttentionArgs.Builder args = AttentionArgs.builder()
          .q(input("q")).k(input("k")).v(input("v")).out(output("out")).lse(output("lse"))
          .causal(file.intOr("arg.causal", 0) != 0)
          .softmaxScale((float) file.floatOr("arg.softmax_scale", 0))
          .cuSeqlensQ(input("cu_seqlens_q")).cuSeqlensK(input("cu_seqlens_k"))
          .pageTable(input("page_table")).seqLensK(input("seq_lens_k"))
          .selectedIndices(output("selected_indices")).blockMaskOut(output("block_mask_out"))
          .stats(output("stats"));
      Policy policy = policy();
      long runs = file.intOr("arg.cache_runs", 0);
      if (runs == 0) {
        ctx.attention(args.build(), policy);
        return;
      }
      VectorFile.Entry dims = file.get("in.cache_dims", VectorFile.TENSOR);
      ByteBuffer d = ByteBuffer.wrap(dims.data).order(java.nio.ByteOrder.LITTLE_ENDIAN);
      try (SelectionCache cache =
          ctx.newSelectionCache(d.getInt(0), d.getInt(4), d.getInt(8), d.getInt(12), d.getInt(16))) {
        AttentionArgs built = args.selectionCache(cache).build();
        for (long run = 0; run < runs; run++) {
          ctx.attention(built, policy);
        }
        long[] counts = cache.counts();
        assertEquals(file.intOr("out.cache_hits", counts[0]), counts[0], "cache hits");
        assertEquals(file.intOr("out.cache_misses", counts[1]), counts[1], "cache misses");
      }
    }

    void compareOutputs() {
      for (Map.Entry<String, ByteBuffer> e : outputs.entrySet()) {
        ByteBuffer got = e.getValue().duplicate();
        got.rewind();
        byte[] bytes = new byte[got.remaining()];
        got.get(bytes);
        assertArrayEquals(file.get(e.getKey(), VectorFile.TENSOR).data, bytes, e.getKey());
      }
    }

    void run(Context ctx) {
      String op = file.get("op", VectorFile.STRING).stringValue;
      if (op.equals("error")) {
        op = file.get("call", VectorFile.STRING).stringValue;
      }
      if (!file.has("expect.status")) {
        call(ctx, op);
        compareOutputs();
        return;
      }
      String callOp = op;
      SparsaException error = assertThrows(SparsaException.class, () -> call(ctx, callOp));
      assertEquals((int) file.get("expect.status", VectorFile.INT).intValue, error.statusCode(), error.getMessage());
      if (file.has("expect.message")) {
        String want = file.get("expect.message", VectorFile.STRING).stringValue;
        assertTrue(error.detail().contains(want), error.detail() + " does not contain " + want);
      }
      compareOutputs(); // a failed call writes nothing: the outputs still hold the poison
    }
  }

  private static final Map<String, BiConsumer<Policy.Builder, VectorFile.Entry>> POLICY_SETTERS = new TreeMap<>();

  static {
    POLICY_SETTERS.put("flags", (b, e) -> b.flags((int) e.intValue));
    POLICY_SETTERS.put("sink_tokens", (b, e) -> b.sinkTokens((int) e.intValue));
    POLICY_SETTERS.put("sink_window", (b, e) -> b.sinkWindow((int) e.intValue));
    POLICY_SETTERS.put("block_q", (b, e) -> b.blockQ((int) e.intValue));
    POLICY_SETTERS.put("block_k", (b, e) -> b.blockK((int) e.intValue));
    POLICY_SETTERS.put("sparge_theta", (b, e) -> b.spargeTheta((float) e.floatValue));
    POLICY_SETTERS.put("sparge_tau", (b, e) -> b.spargeTau((float) e.floatValue));
    POLICY_SETTERS.put("sparge_topk_fraction", (b, e) -> b.spargeTopkFraction((float) e.floatValue));
    POLICY_SETTERS.put("sparge_lambda", (b, e) -> b.spargeLambda((float) e.floatValue));
    POLICY_SETTERS.put("sparge_attention_sink", (b, e) -> b.spargeAttentionSink(e.intValue != 0));
    POLICY_SETTERS.put("sparge_quantized", (b, e) -> b.spargeQuantized(e.intValue != 0));
    POLICY_SETTERS.put("token_sparse_window", (b, e) -> b.tokenSparseWindow((int) e.intValue));
    POLICY_SETTERS.put("token_sparse_pool_kernel", (b, e) -> b.tokenSparsePoolKernel((int) e.intValue));
    POLICY_SETTERS.put("token_sparse_coverage", (b, e) -> b.tokenSparseCoverage((float) e.floatValue));
    POLICY_SETTERS.put("token_sparse_min_tokens", (b, e) -> b.tokenSparseMinTokens((int) e.intValue));
    POLICY_SETTERS.put("select_n_init", (b, e) -> b.selectNInit((int) e.intValue));
    POLICY_SETTERS.put("select_n_local", (b, e) -> b.selectNLocal((int) e.intValue));
    POLICY_SETTERS.put("select_top_k", (b, e) -> b.selectTopK((int) e.intValue));
    POLICY_SETTERS.put("select_scale_scores", (b, e) -> b.selectScaleScores(e.intValue != 0));
    POLICY_SETTERS.put("select_cache_theta", (b, e) -> b.selectCacheTheta((float) e.floatValue));
    POLICY_SETTERS.put("select_per_kv_head", (b, e) -> b.selectPerKvHead(e.intValue != 0));
    POLICY_SETTERS.put("index_block_size", (b, e) -> b.indexBlockSize((int) e.intValue));
    POLICY_SETTERS.put("index_n_init", (b, e) -> b.indexNInit((int) e.intValue));
    POLICY_SETTERS.put("index_n_local", (b, e) -> b.indexNLocal((int) e.intValue));
    POLICY_SETTERS.put("delta_gamma", (b, e) -> b.deltaGamma((int) e.intValue));
    POLICY_SETTERS.put("delta_tail_min", (b, e) -> b.deltaTailMin((int) e.intValue));
  }
}
