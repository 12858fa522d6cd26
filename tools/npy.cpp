// .npy format (numpy/lib/format.py): the magic "\x93NUMPY", a major and minor version byte, the header length
// (uint16 little-endian in v1, uint32 in v2/v3), then an ASCII Python dict literal
//   {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
// padded with spaces and a final '\n' so that the payload starts at a multiple of 64 bytes.
#include "npy.h"

#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "cli_common.h"

namespace sparsa_cli {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicSize = 6;
constexpr size_t kPreludeV1 = kMagicSize + 2 + 2;  // magic, version, uint16 header length
constexpr size_t kPreludeV2 = kMagicSize + 2 + 4;  // magic, version, uint32 header length
constexpr size_t kHeaderAlignment = 64;
constexpr size_t kMaxV1HeaderSize = 65535;

// The value text after `'key':` in the header dict, with leading spaces skipped.
std::string dict_value(const std::string& header, const std::string& key, const std::string& path) {
  const std::string quoted = "'" + key + "'";
  size_t at = header.find(quoted);
  if (at == std::string::npos) throw UsageError(path + ": .npy header has no '" + key + "' entry");
  at = header.find(':', at + quoted.size());
  if (at == std::string::npos) throw UsageError(path + ": malformed .npy header near '" + key + "'");
  ++at;
  while (at < header.size() && header[at] == ' ') ++at;
  return header.substr(at);
}

std::string normalise_descr(std::string descr) {
  // Single-byte types have no byte order; numpy writes '|u1', other writers '<u1' or '=u1'.
  if (descr.size() == 3 && (descr[1] == 'u' || descr[1] == 'i' || descr[1] == 'b') && descr[2] == '1') descr[0] = '|';
  return descr;
}

std::vector<int64_t> parse_shape(const std::string& text, const std::string& path) {
  if (text.empty() || text[0] != '(') throw UsageError(path + ": .npy shape is not a tuple");
  std::vector<int64_t> shape;
  size_t at = 1;
  while (at < text.size() && text[at] != ')') {
    if (std::isdigit(static_cast<unsigned char>(text[at]))) {
      size_t used = 0;
      shape.push_back(std::stoll(text.substr(at), &used));
      at += used;
    } else if (text[at] == ',' || text[at] == ' ' || text[at] == 'L') {
      ++at;
    } else {
      throw UsageError(path + ": unexpected character '" + std::string(1, text[at]) + "' in .npy shape");
    }
  }
  if (at >= text.size()) throw UsageError(path + ": unterminated .npy shape");
  return shape;
}

// Why the last open/write failed, from errno ("No such file or directory", "Permission denied", ...).
std::string system_reason() { return errno != 0 ? std::strerror(errno) : "unknown reason"; }

}  // namespace

void check_output_path(const std::string& path) {
  std::error_code ec;
  const std::filesystem::path file(path);
  if (std::filesystem::is_directory(file, ec)) throw UsageError(path + ": is a directory (expected a file name)");
  const std::filesystem::path folder = file.parent_path();
  if (!folder.empty() && !std::filesystem::is_directory(folder, ec)) {
    throw UsageError(path + ": cannot write: folder " + folder.string() + " does not exist");
  }
}

void make_output_folder(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);  // no error when it exists already
  if (ec) throw UsageError(dir + ": cannot create folder: " + ec.message());
  if (!std::filesystem::is_directory(dir, ec)) throw UsageError(dir + ": exists and is not a folder");
}

size_t npy_descr_size(const std::string& descr) {
  static const struct {
    const char* descr;
    size_t size;
  } kSupported[] = {{"<f4", 4}, {"<f2", 2}, {"<u2", 2}, {"<i4", 4}, {"<i8", 8}, {"<f8", 8}, {"|u1", 1}, {"|i1", 1}};
  for (const auto& entry : kSupported) {
    if (descr == entry.descr) return entry.size;
  }
  return 0;
}

int64_t NpyArray::element_count() const {
  int64_t n = 1;
  for (int64_t extent : shape) n *= extent;
  return n;
}

size_t NpyArray::element_size() const { return npy_descr_size(descr); }

NpyArray read_npy(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw UsageError(path + ": is a directory (expected a .npy file)");
  errno = 0;
  std::ifstream file(path, std::ios::binary);
  if (!file) throw UsageError(path + ": cannot open for reading: " + system_reason());
  const std::string content((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());

  if (content.size() < kPreludeV1 || content.compare(0, kMagicSize, kMagic, kMagicSize) != 0) {
    throw UsageError(path + ": not a .npy file (no \\x93NUMPY magic)");
  }
  const int major = static_cast<unsigned char>(content[kMagicSize]);
  size_t header_size = 0;
  size_t prelude = 0;
  auto byte = [&](size_t i) { return size_t(static_cast<unsigned char>(content[i])); };
  if (major == 1) {
    prelude = kPreludeV1;
    header_size = byte(8) | byte(9) << 8;
  } else if (major == 2 || major == 3) {
    if (content.size() < kPreludeV2) throw UsageError(path + ": truncated .npy header");
    prelude = kPreludeV2;
    header_size = byte(8) | byte(9) << 8 | byte(10) << 16 | byte(11) << 24;
  } else {
    throw UsageError(path + ": .npy format version " + std::to_string(major) + " (expected 1, 2 or 3)");
  }
  if (content.size() < prelude + header_size) throw UsageError(path + ": truncated .npy header");
  const std::string header = content.substr(prelude, header_size);

  NpyArray array;
  const std::string descr_text = dict_value(header, "descr", path);
  if (descr_text.empty() || descr_text[0] != '\'') throw UsageError(path + ": .npy descr is not a simple dtype");
  array.descr = normalise_descr(descr_text.substr(1, descr_text.find('\'', 1) - 1));
  if (array.element_size() == 0) {
    throw UsageError(
        path + ": dtype '" + array.descr +
        "' is not supported (expected <f4, <f2, <u2 for bfloat16, <i4, <i8, <f8, u1 or i1, little-endian)");
  }
  if (dict_value(header, "fortran_order", path).rfind("False", 0) != 0) {
    throw UsageError(path + ": Fortran-order array; save it in C order (numpy.ascontiguousarray)");
  }
  array.shape = parse_shape(dict_value(header, "shape", path), path);

  const size_t payload = static_cast<size_t>(array.element_count()) * array.element_size();
  const size_t offset = prelude + header_size;
  if (content.size() - offset < payload) {
    throw UsageError(path + ": payload has " + std::to_string(content.size() - offset) +
                     " bytes, the header promises " + std::to_string(payload));
  }
  array.bytes.assign(content.begin() + static_cast<std::ptrdiff_t>(offset),
                     content.begin() + static_cast<std::ptrdiff_t>(offset + payload));
  return array;
}

void write_npy(const std::string& path, const NpyArray& array) {
  std::ostringstream dict;
  dict << "{'descr': '" << array.descr << "', 'fortran_order': False, 'shape': (";
  for (size_t i = 0; i < array.shape.size(); ++i) dict << array.shape[i] << (i + 1 < array.shape.size() ? ", " : "");
  dict << (array.shape.size() == 1 ? ",), }" : "), }");
  std::string header = dict.str();

  const bool v2 = header.size() + kPreludeV1 + kHeaderAlignment > kMaxV1HeaderSize;
  const size_t prelude = v2 ? kPreludeV2 : kPreludeV1;
  const size_t unpadded = prelude + header.size() + 1;  // + the final '\n'
  header.append((kHeaderAlignment - unpadded % kHeaderAlignment) % kHeaderAlignment, ' ');
  header.push_back('\n');

  std::string prelude_bytes(kMagic, kMagicSize);
  prelude_bytes.push_back(static_cast<char>(v2 ? 2 : 1));
  prelude_bytes.push_back(0);
  const size_t size_bytes = v2 ? 4 : 2;
  for (size_t i = 0; i < size_bytes; ++i) prelude_bytes.push_back(static_cast<char>((header.size() >> (8 * i)) & 0xff));

  check_output_path(path);
  errno = 0;
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  if (!file) throw UsageError(path + ": cannot open for writing: " + system_reason());
  file.write(prelude_bytes.data(), static_cast<std::streamsize>(prelude_bytes.size()));
  file.write(header.data(), static_cast<std::streamsize>(header.size()));
  file.write(reinterpret_cast<const char*>(array.bytes.data()), static_cast<std::streamsize>(array.bytes.size()));
  file.flush();
  if (!file) throw RuntimeError(path + ": write failed: " + system_reason());
}

}  // namespace sparsa_cli
