package org.sparsa;

import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.LinkedHashMap;
import java.util.Map;

/** Reader of the shared test vectors (tests/vectors/FORMAT.md): named tensors, i64, f64 and string entries. */
final class VectorFile {
  static final int TENSOR = 1;
  static final int INT = 2;
  static final int FLOAT = 3;
  static final int STRING = 4;
  private static final String MAGIC = "SPARSAV1";

  /** One entry; which fields are set depends on {@code type}. */
  static final class Entry {
    int type;
    int dtype;
    long[] shape;
    byte[] data;
    long intValue;
    double floatValue;
    String stringValue;
  }

  final Map<String, Entry> entries = new LinkedHashMap<>();

  static VectorFile read(Path path) throws IOException {
    ByteBuffer in = ByteBuffer.wrap(Files.readAllBytes(path)).order(ByteOrder.LITTLE_ENDIAN);
    byte[] magic = new byte[MAGIC.length()];
    in.get(magic);
    if (!MAGIC.equals(new String(magic, StandardCharsets.US_ASCII))) {
      throw new IOException(path + ": expected magic " + MAGIC);
    }
    long count = Integer.toUnsignedLong(in.getInt());
    VectorFile file = new VectorFile();
    for (long n = 0; n < count; n++) {
      byte[] name = new byte[Short.toUnsignedInt(in.getShort())];
      in.get(name);
      Entry entry = new Entry();
      entry.type = Byte.toUnsignedInt(in.get());
      switch (entry.type) {
        case TENSOR:
          entry.dtype = in.getInt();
          entry.shape = new long[Byte.toUnsignedInt(in.get())];
          for (int i = 0; i < entry.shape.length; i++) {
            entry.shape[i] = in.getLong();
          }
          entry.data = new byte[Math.toIntExact(in.getLong())];
          in.get(entry.data);
          break;
        case INT:
          entry.intValue = in.getLong();
          break;
        case FLOAT:
          entry.floatValue = in.getDouble();
          break;
        case STRING:
          byte[] text = new byte[in.getInt()];
          in.get(text);
          entry.stringValue = new String(text, StandardCharsets.US_ASCII);
          break;
        default:
          throw new IOException(path + ": entry " + n + " has unknown type " + entry.type);
      }
      String key = new String(name, StandardCharsets.US_ASCII);
      if (file.entries.put(key, entry) != null) {
        throw new IOException(path + ": duplicate entry " + key);
      }
    }
    if (in.hasRemaining()) {
      throw new IOException(path + ": " + in.remaining() + " trailing bytes");
    }
    return file;
  }

  boolean has(String name) {
    return entries.containsKey(name);
  }

  Entry get(String name, int type) {
    Entry entry = entries.get(name);
    if (entry == null) {
      throw new IllegalStateException("missing entry " + name);
    }
    if (entry.type != type) {
      throw new IllegalStateException(name + ": type " + entry.type + ", expected " + type);
    }
    return entry;
  }

  long intOr(String name, long fallback) {
    return has(name) ? get(name, INT).intValue : fallback;
  }

  double floatOr(String name, double fallback) {
    return has(name) ? get(name, FLOAT).floatValue : fallback;
  }
}
