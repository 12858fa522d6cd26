package org.sparsa;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;

import org.junit.jupiter.api.Test;

class ReadmeExampleTest {
  @Test
  void readmeExampleComputesWhatItSays() {
    assertArrayEquals(new float[] {1, 2, 2, 3}, ReadmeExample.run());
  }
}
