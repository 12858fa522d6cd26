/*
 * SWIG interface of the Java binding: generates the raw JNI layer (package org.sparsa.jni) from sparsa.h.
 * The idiomatic API (package org.sparsa) is written by hand on top of it; users never see these classes.
 *
 * What this file adds to the plain header:
 *   - every function returning sparsa_status throws org.sparsa.SparsaException on failure, built INSIDE the same
 *     JNI call from sparsa_last_error_message() (the message is thread-local: reading it in a later call could
 *     return another call's message, or none);
 *   - small C shims (sparsa_java_*) for what Java cannot express through SWIG's default wrapping: a tensor's data
 *     address and fixed-size shape/strides arrays, direct ByteBuffer addresses, out-parameters (context and cache
 *     handles, counters), raw stream addresses.
 * Build: swig -java -package org.sparsa.jni -I<include> sparsa.i (bindings/java/CMakeLists.txt).
 */
%module(jniclassname="SparsaNativeJNI") SparsaNative

%{
#include <sparsa/sparsa.h>

#include <stdint.h>
#include <string.h>

/* Throws org.sparsa.SparsaException(status, message). If anything on the way fails, the JVM already holds a
   pending error (NoClassDefFoundError, OutOfMemoryError), which is then what Java sees. */
static void sparsa_java_throw(JNIEnv* jenv, sparsa_status status, const char* message) {
  jclass type = (*jenv)->FindClass(jenv, "org/sparsa/SparsaException");
  if (type == NULL) return;
  jmethodID constructor = (*jenv)->GetMethodID(jenv, type, "<init>", "(ILjava/lang/String;)V");
  if (constructor == NULL) return;
  jstring text = (*jenv)->NewStringUTF(jenv, message);
  if (text == NULL) return;
  jobject exception = (*jenv)->NewObject(jenv, type, constructor, (jint)status, text);
  if (exception != NULL) (*jenv)->Throw(jenv, (jthrowable)exception);
}

/* Throws for a failed sparsa call, with the message of this thread's last failure (i.e. this call's). */
static void sparsa_java_throw_last(JNIEnv* jenv, sparsa_status status) {
  sparsa_java_throw(jenv, status, sparsa_last_error_message());
}

/* The first byte of a direct buffer, or 0 for NULL; throws for a heap buffer. */
static void* sparsa_java_direct(JNIEnv* jenv, jobject buffer, const char* name) {
  if (buffer == NULL) return NULL;
  void* address = (*jenv)->GetDirectBufferAddress(jenv, buffer);
  if (address == NULL) sparsa_java_throw(jenv, SPARSA_STATUS_INVALID_ARGUMENT, name);
  return address;
}
%}

%include "stdint.i"
%include "enumtypeunsafe.swg"
%javaconst(1);
/* `1u << 0` is not Java. */
%javaconstvalue(1) SPARSA_POLICY_FLAG_DELTA;

/* Load the native library before the first native call, whichever class makes it. */
%pragma(java) jniclasscode=%{
  static {
    org.sparsa.NativeLoader.load();
  }
%}

/* Failure of any sparsa_status function becomes a SparsaException thrown from within the same JNI call. */
%typemap(out) sparsa_status %{
  if ($1 != SPARSA_STATUS_SUCCESS) {
    sparsa_java_throw_last(jenv, $1);
    return $null;
  }
  $result = (jint)$1;
%}

/* A JNIEnv* parameter of a shim is the wrapper's own environment, not a Java argument. */
%typemap(in, numinputs=0) JNIEnv* jenv_in %{ $1 = jenv; %}

/* Replaced by the shims below (out-parameters, void* and fixed arrays do not map to Java). */
%ignore SPARSA_VERSION;
%ignore sparsa_tensor_init;
%ignore sparsa_context_options_init;
%ignore sparsa_policy_init;
%ignore sparsa_attention_args_init;
%ignore sparsa_sparge_tune_options_init;
%ignore sparsa_tensor::data;
%ignore sparsa_tensor::shape;
%ignore sparsa_tensor::strides;
%ignore sparsa_context_options::stream;
%ignore sparsa_context_create;
%ignore sparsa_context_set_stream;
%ignore sparsa_context_device_type;
%ignore sparsa_context_scratch_bytes;
%ignore sparsa_selection_cache_create;
%ignore sparsa_selection_cache_counts;
%ignore sparsa_hilbert_permutation;

%include <sparsa/sparsa.h>

%inline %{
/* The init functions with this binding's sizeof as the caller's struct size (the layout SWIG compiled against). */
sparsa_status sparsa_java_context_options_init(sparsa_context_options* options) {
  return sparsa_context_options_init(options, sizeof *options);
}
sparsa_status sparsa_java_policy_init(sparsa_policy* policy, int32_t kind) {
  return sparsa_policy_init(policy, sizeof *policy, kind);
}
sparsa_status sparsa_java_attention_args_init(sparsa_attention_args* args) {
  return sparsa_attention_args_init(args, sizeof *args);
}
sparsa_status sparsa_java_sparge_tune_options_init(sparsa_sparge_tune_options* options) {
  return sparsa_sparge_tune_options_init(options, sizeof *options);
}

/* Describes `address` (0 = NULL) as a tensor of `ndim` dims; set the dims with sparsa_java_tensor_set_dim.
   The Java layer validates everything before, so nothing here can fail. */
void sparsa_java_tensor_describe(sparsa_tensor* t, int64_t address, int32_t dtype, int32_t device_type,
                                 int32_t device_id, int32_t ndim) {
  memset(t, 0, sizeof *t);
  t->struct_size = (uint32_t)sizeof *t;
  t->dtype = dtype;
  t->device_type = device_type;
  t->device_id = device_id;
  t->ndim = ndim;
  t->data = (void*)(intptr_t)address;
}

void sparsa_java_tensor_set_dim(sparsa_tensor* t, int32_t dim, int64_t extent, int64_t stride) {
  if (dim < 0 || dim >= SPARSA_MAX_DIMS) return;
  t->shape[dim] = extent;
  t->strides[dim] = stride;
}

/* Address of a direct ByteBuffer's first byte (its capacity starts there); throws for a heap buffer. */
int64_t sparsa_java_buffer_address(JNIEnv* jenv_in, jobject buffer) {
  return (int64_t)(intptr_t)sparsa_java_direct(jenv_in, buffer, "buffer: expected a direct ByteBuffer");
}

sparsa_context* sparsa_java_context_create(JNIEnv* jenv_in, const sparsa_context_options* options,
                                           int64_t stream) {
  sparsa_context_options local;
  sparsa_context_options_init(&local, sizeof local);
  if (options != NULL) local = *options;
  local.stream = (void*)(intptr_t)stream;
  sparsa_context* ctx = NULL;
  sparsa_status status = sparsa_context_create(&local, &ctx);
  if (status != SPARSA_STATUS_SUCCESS) sparsa_java_throw_last(jenv_in, status);
  return ctx;
}

sparsa_status sparsa_java_context_set_stream(sparsa_context* ctx, int64_t stream) {
  return sparsa_context_set_stream(ctx, (void*)(intptr_t)stream);
}

int32_t sparsa_java_context_device_type(JNIEnv* jenv_in, const sparsa_context* ctx) {
  int32_t device_type = 0;
  sparsa_status status = sparsa_context_device_type(ctx, &device_type);
  if (status != SPARSA_STATUS_SUCCESS) sparsa_java_throw_last(jenv_in, status);
  return device_type;
}

int64_t sparsa_java_context_scratch_bytes(JNIEnv* jenv_in, const sparsa_context* ctx) {
  uint64_t bytes = 0;
  sparsa_status status = sparsa_context_scratch_bytes(ctx, &bytes);
  if (status != SPARSA_STATUS_SUCCESS) sparsa_java_throw_last(jenv_in, status);
  return (int64_t)bytes;
}

sparsa_selection_cache* sparsa_java_selection_cache_create(JNIEnv* jenv_in, sparsa_context* ctx, int32_t max_batch,
                                                           int32_t num_q_heads, int32_t num_kv_heads,
                                                           int32_t head_dim, int32_t max_top_k) {
  sparsa_selection_cache* cache = NULL;
  sparsa_status status =
      sparsa_selection_cache_create(ctx, max_batch, num_q_heads, num_kv_heads, head_dim, max_top_k, &cache);
  if (status != SPARSA_STATUS_SUCCESS) sparsa_java_throw_last(jenv_in, status);
  return cache;
}

/* Writes {hits, misses} into `counts` (a long[2]). */
void sparsa_java_selection_cache_counts(JNIEnv* jenv_in, const sparsa_selection_cache* cache, jlongArray counts) {
  int64_t hits = 0, misses = 0;
  sparsa_status status = sparsa_selection_cache_counts(cache, &hits, &misses);
  if (status != SPARSA_STATUS_SUCCESS) {
    sparsa_java_throw_last(jenv_in, status);
    return;
  }
  jlong values[2] = {(jlong)hits, (jlong)misses};
  (*jenv_in)->SetLongArrayRegion(jenv_in, counts, 0, 2, values);
}

/* perm/inverse: direct buffers of t*h*w int32 (checked by the Java layer) or null; the capacity passed is what the
   smaller given buffer holds, so the library itself refuses a grid larger than the buffers. */
sparsa_status sparsa_java_hilbert_permutation(JNIEnv* jenv_in, int32_t t, int32_t h, int32_t w, jobject perm,
                                              jobject inverse) {
  int32_t* perm_data = (int32_t*)sparsa_java_direct(jenv_in, perm, "perm: expected a direct ByteBuffer");
  int32_t* inverse_data = (int32_t*)sparsa_java_direct(jenv_in, inverse, "inverse: expected a direct ByteBuffer");
  if ((*jenv_in)->ExceptionCheck(jenv_in)) return SPARSA_STATUS_SUCCESS; /* the pending exception wins */
  int64_t capacity = -1;
  jobject buffers[2] = {perm, inverse};
  for (int i = 0; i < 2; ++i) {
    if (buffers[i] == NULL) continue;
    int64_t entries = (int64_t)(*jenv_in)->GetDirectBufferCapacity(jenv_in, buffers[i]) / (int64_t)sizeof(int32_t);
    if (capacity < 0 || entries < capacity) capacity = entries;
  }
  return sparsa_hilbert_permutation(t, h, w, perm_data, inverse_data, capacity < 0 ? 0 : capacity);
}

void sparsa_java_policy_copy(sparsa_policy* destination, const sparsa_policy* source) { *destination = *source; }

void sparsa_java_attention_args_copy(sparsa_attention_args* destination, const sparsa_attention_args* source) {
  *destination = *source;
}
%}
