package org.sparsa;

import java.io.File;

/**
 * Loads the JNI library {@code sparsa_java} (which links libsparsa) once, before the first native call: from the
 * system property {@code sparsa.library.path} (the library file, or the folder holding it) through
 * {@link System#load}, else through {@link System#loadLibrary} and {@code java.library.path}.
 */
public final class NativeLoader {
  /** Base name of the JNI library: libsparsa_java.so on Linux. */
  public static final String LIBRARY_NAME = "sparsa_java";
  /** System property naming the JNI library file or its folder. */
  public static final String PATH_PROPERTY = "sparsa.library.path";

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
}
