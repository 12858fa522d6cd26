package org.sparsa;

import java.io.File;
import java.net.URISyntaxException;
import java.security.CodeSource;
import java.util.ArrayList;
import java.util.List;

/**
 * Loads the JNI library {@code sparsa_java} (which links libsparsa) once, before the first native call: from the
 * system property {@code sparsa.library.path} (the library file, or the folder holding it) through
 * {@link System#load}; else from an install prefix's library folder next to libsparsa, found from the jar's own place
 * ({@code <prefix>/share/java/sparsa.jar} → {@code <prefix>/lib*}/libsparsa_java.so, as {@code cmake --install}
 * lays them out); else through {@link System#loadLibrary} and {@code java.library.path}.
 */
public final class NativeLoader {
  /** Base name of the JNI library: libsparsa_java.so on Linux. */
  public static final String LIBRARY_NAME = "sparsa_java";
  /** System property naming the JNI library file or its folder. */
  public static final String PATH_PROPERTY = "sparsa.library.path";

  /** Library folders of an install prefix, relative to the jar's folder ({@code <prefix>/share/java}). */
  private static final String[] PREFIX_LIBRARY_DIRS = {
    "../../lib", "../../lib64", "../../lib/x86_64-linux-gnu", "../../lib/aarch64-linux-gnu"
  };

  private static boolean loaded;

  private NativeLoader() {}

  /** Loads the library if not done yet; throws UnsatisfiedLinkError naming every place tried. */
  public static synchronized void load() {
    if (loaded) {
      return;
    }
    String configured = System.getProperty(PATH_PROPERTY);
    UnsatisfiedLinkError fromProperty = null;
    if (configured != null && !configured.isEmpty()) {
      File file = new File(configured);
      if (file.isDirectory()) {
        file = new File(file, System.mapLibraryName(LIBRARY_NAME));
      }
      try {
        System.load(file.getAbsolutePath());
        loaded = true;
        return;
      } catch (UnsatisfiedLinkError e) {
        fromProperty = e;
      }
    }
    for (File candidate : besideTheJar()) {
      if (candidate.isFile()) {
        try {
          System.load(candidate.getAbsolutePath());
          loaded = true;
          return;
        } catch (UnsatisfiedLinkError e) {
          // fall through to java.library.path; its error names where it looked
        }
      }
    }
    try {
      System.loadLibrary(LIBRARY_NAME);
      loaded = true;
    } catch (UnsatisfiedLinkError e) {
      String message = "cannot load " + System.mapLibraryName(LIBRARY_NAME) + " from java.library.path ("
          + System.getProperty("java.library.path") + "): " + e.getMessage();
      if (fromProperty != null) {
        message = PATH_PROPERTY + "=" + configured + ": " + fromProperty.getMessage() + "; then " + message;
      }
      throw new UnsatisfiedLinkError(message);
    }
  }

  /** Where an installed prefix keeps the JNI library, seen from the jar this class was loaded from (none when the
   * classes do not come from a jar file). */
  private static List<File> besideTheJar() {
    List<File> candidates = new ArrayList<>();
    CodeSource source = NativeLoader.class.getProtectionDomain().getCodeSource();
    if (source == null || source.getLocation() == null) {
      return candidates;
    }
    File jar;
    try {
      jar = new File(source.getLocation().toURI());
    } catch (URISyntaxException | IllegalArgumentException e) {
      return candidates;
    }
    if (!jar.isFile()) {
      return candidates;
    }
    for (String dir : PREFIX_LIBRARY_DIRS) {
      candidates.add(new File(new File(jar.getParentFile(), dir), System.mapLibraryName(LIBRARY_NAME)));
    }
    return candidates;
  }
}
