// A minimal reader/writer of NumPy .npy files (format versions 1, 2 and 3), enough for the sparsa CLI:
// little-endian <f4, <f2, <u2 (bfloat16 bits), <i4, <i8, <f8 and u1/i1, C order only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sparsa_cli {

struct NpyArray {
  std::string descr;           // NumPy dtype string as written in the header, normalised: "<f4", "|u1", ...
  std::vector<int64_t> shape;  // extents, C order
  std::vector<uint8_t> bytes;  // the elements, C order

  int64_t element_count() const;
  size_t element_size() const;  // from descr
};

// Reads `path`. Throws UsageError (cli_common.h) naming the file and the reason (the system's, e.g. "No such file or
// directory") for a missing or unreadable file, a directory, a malformed header, a Fortran-order array, a big-endian
// or unsupported dtype, or a truncated payload.
NpyArray read_npy(const std::string& path);

// Writes `array` to `path` as .npy version 1.0 (2.0 when the header needs it). Throws UsageError when the file
// cannot be opened (check_output_path's cases, permissions: with the system's reason), RuntimeError when writing
// fails midway (e.g. a full disk).
void write_npy(const std::string& path, const NpyArray& array);

// Throws UsageError when `path` cannot name an output file: it is a directory, or its folder does not exist. Lets a
// command refuse a bad output path before it computes anything.
void check_output_path(const std::string& path);

// Creates folder `dir` (and its parents) unless it exists; throws UsageError with the reason when it cannot.
void make_output_folder(const std::string& dir);

// Size in bytes of one element of a supported descr, 0 when unsupported.
size_t npy_descr_size(const std::string& descr);

}  // namespace sparsa_cli
