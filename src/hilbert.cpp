// §4 SpargeAttn's Hilbert permutation of a T×H×W token grid.
//
// Walks a 3-D Hilbert curve over the enclosing power-of-two cube (side 2^bits) in curve order and keeps the cells
// inside the grid (pruning sub-cubes that lie wholly outside). Curve index → coordinates uses John Skilling's transpose
// algorithm ("Programming the Hilbert curve", AIP Conf. Proc. 707, 2004), with axes (t, h, w) = (X[0], X[1], X[2]);
// consecutive cube cells are face-adjacent, which the tests check.
#include <array>
#include <cstdint>
#include <limits>

#include "error.h"
#include "host_utilities.h"

namespace sparsa {
namespace {

constexpr int kDims = 3;  // axes t, h, w

// Skilling's TransposetoAxes: the Hilbert index in "transposed" form (its bits dealt round-robin over the axes,
// most significant first) becomes the cell's coordinates, in place.
void transpose_to_axes(std::array<uint32_t, kDims>& x, int bits) {
  const uint32_t side = uint32_t{1} << bits;
  // Gray decode by H ^ (H / 2).
  uint32_t t = x[kDims - 1] >> 1;
  for (int i = kDims - 1; i > 0; --i) x[i] ^= x[i - 1];
  x[0] ^= t;
  // Undo the excess work of the forward transform.
  for (uint32_t q = 2; q != side && side > 1; q <<= 1) {
    const uint32_t p = q - 1;
    for (int i = kDims - 1; i >= 0; --i) {
      if (x[i] & q) {
        x[0] ^= p;
      } else {
        t = (x[0] ^ x[i]) & p;
        x[0] ^= t;
        x[i] ^= t;
      }
    }
  }
}

// Deals the bits of curve index `d` (kDims * bits bits) into transposed form: bit (j * kDims + kDims-1-i) of d is
// bit j of axis i.
std::array<uint32_t, kDims> index_to_transpose(uint64_t d, int bits) {
  std::array<uint32_t, kDims> x{0, 0, 0};
  for (int j = 0; j < bits; ++j) {
    for (int i = 0; i < kDims; ++i) {
      const uint64_t bit = (d >> (j * kDims + (kDims - 1 - i))) & 1u;
      x[size_t(i)] |= uint32_t(bit) << j;
    }
  }
  return x;
}

// Visits the curve in order, skipping whole sub-cubes outside the grid: the 8^level cells starting at an index
// aligned to 8^level fill one aligned sub-cube of side 2^level, so a flat or thin grid costs O(n · bits), not the
// whole enclosing cube.
struct HilbertWalk {
  int bits;
  std::array<uint32_t, kDims> extent;  // t, h, w
  int32_t* perm;
  int32_t* inverse;
  int64_t visited;

  void visit(uint64_t first, int level) {
    std::array<uint32_t, kDims> x = index_to_transpose(first, bits);
    transpose_to_axes(x, bits);
    const uint32_t corner_mask = ~((uint32_t{1} << level) - 1);
    for (int i = 0; i < kDims; ++i) {
      if ((x[size_t(i)] & corner_mask) >= extent[size_t(i)]) return;  // the sub-cube lies outside the grid
    }
    if (level == 0) {
      const int32_t token = int32_t((int64_t(x[0]) * extent[1] + x[1]) * extent[2] + x[2]);
      if (perm) perm[visited] = token;
      if (inverse) inverse[token] = int32_t(visited);
      ++visited;
      return;
    }
    const uint64_t child_cells = uint64_t{1} << (kDims * (level - 1));
    for (uint64_t child = 0; child < (uint64_t{1} << kDims); ++child) visit(first + child * child_cells, level - 1);
  }
};

}  // namespace

void hilbert_permutation(int32_t t, int32_t h, int32_t w, int32_t* perm, int32_t* inverse, int64_t capacity) {
  const std::pair<int32_t, const char*> extents[] = {{t, "t"}, {h, "h"}, {w, "w"}};
  for (const auto& [value, name] : extents) {
    if (value < 1) fail(SPARSA_STATUS_INVALID_ARGUMENT, name, ": expected >= 1, got ", value);
  }
  // t*h*w can reach 2^93: multiply with overflow detection before comparing (a wrapped product once passed this
  // check and sent the walk over a huge cube, writing past perm).
  int64_t n = 0;
  if (__builtin_mul_overflow(int64_t(t) * h, int64_t(w), &n) || n > std::numeric_limits<int32_t>::max()) {
    fail(SPARSA_STATUS_INVALID_ARGUMENT, "t*h*w: ", t, " * ", h, " * ", w, " tokens do not fit int32 ids");
  }
  if (capacity < 0) fail(SPARSA_STATUS_INVALID_ARGUMENT, "capacity: expected >= 0, got ", capacity);
  if ((perm != nullptr || inverse != nullptr) && capacity < n) {
    fail(SPARSA_STATUS_SHAPE_MISMATCH, "capacity: the buffers hold ", capacity, " int32 entries but the ", t, "x", h,
         "x", w, " grid needs ", n);
  }
  if (perm == nullptr && inverse == nullptr) return;  // nothing to write: the walk would only burn time
  const int32_t longest = std::max(t, std::max(h, w));
  int bits = 0;
  while ((int64_t{1} << bits) < longest) ++bits;
  HilbertWalk walk{bits, {uint32_t(t), uint32_t(h), uint32_t(w)}, perm, inverse, 0};
  walk.visit(0, bits);
}

}  // namespace sparsa
