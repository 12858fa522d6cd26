package org.sparsa;

import org.sparsa.jni.SparsaNative;
import org.sparsa.jni.sparsa_sparge_tune_options;

/** Targets of the SpargeAttn tuner (§4); starts from the library's defaults. */
public final class SpargeTuneOptions {
  private float l1;
  private float pvL1;
  private int searchSteps;
  private float denseBelow;
  private float lambdaMin;

  public SpargeTuneOptions() {
    sparsa_sparge_tune_options defaults = new sparsa_sparge_tune_options();
    try {
      SparsaNative.sparsa_java_sparge_tune_options_init(defaults);
      l1 = defaults.getL1();
      pvL1 = defaults.getPv_l1();
      searchSteps = defaults.getSearch_steps();
      denseBelow = defaults.getDense_below();
      lambdaMin = defaults.getLambda_min();
    } finally {
      defaults.delete();
    }
  }

  public SpargeTuneOptions l1(float value) {
    l1 = value;
    return this;
  }

  public SpargeTuneOptions pvL1(float value) {
    pvL1 = value;
    return this;
  }

  public SpargeTuneOptions searchSteps(int value) {
    searchSteps = value;
    return this;
  }

  public SpargeTuneOptions denseBelow(float value) {
    denseBelow = value;
    return this;
  }

  public SpargeTuneOptions lambdaMin(float value) {
    lambdaMin = value;
    return this;
  }

  void fill(sparsa_sparge_tune_options raw) {
    raw.setL1(l1);
    raw.setPv_l1(pvL1);
    raw.setSearch_steps(searchSteps);
    raw.setDense_below(denseBelow);
    raw.setLambda_min(lambdaMin);
  }
}
