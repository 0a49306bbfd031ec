#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <optional>
#include <set>
#include <type_traits>

#include "framework/checkpoint/checkpoint.h"
#include "framework/core/crc32c.h"
#include "framework/core/hdf5_util.h"
#include "framework/core/rng.h"

namespace hp {
namespace {

constexpr int64_t kChunkBytes = int64_t{16} << 20;
// HDF5 limits one chunk to 4 GiB.
constexpr int64_t kMaxChunkBytes = (int64_t{1} << 32) - 1;
// The dataset attribute holding one CRC-32C per chunk.
constexpr const char* kCrcAttr = "crc32c";

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// CRC-32C of chunks [c0, c1) of a dataset of `rows` rows of `row_bytes`, chunked by `chunk_rows`,
// whose rows from `first_row` on lie at `data`; into crc[c]. Chunks are independent: threads.
void chunk_crcs(const char* data, int64_t first_row, int64_t rows, int64_t row_bytes,
                int64_t chunk_rows, int64_t c0, int64_t c1, uint32_t* crc) {
#pragma omp parallel for schedule(dynamic)
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t r0 = c * chunk_rows, r1 = std::min(rows, r0 + chunk_rows);
    crc[c] =
        crc32c(data + (r0 - first_row) * row_bytes, static_cast<size_t>((r1 - r0) * row_bytes));
  }
}

hid_t file_type(DType t) {
  switch (t) {
    case DType::kF32:
      return H5T_IEEE_F32LE;
    case DType::kF64:
      return H5T_IEEE_F64LE;
    case DType::kI64:
      return H5T_STD_I64LE;
    default:
      HP_FAIL(ErrorKind::kInternal, "checkpoint datasets hold f32, f64 or i64, not ",
              dtype_name(t));
  }
}

hid_t memory_type(DType t) {
  switch (t) {
    case DType::kF32:
      return H5T_NATIVE_FLOAT;
    case DType::kF64:
      return H5T_NATIVE_DOUBLE;
    case DType::kI64:
      return H5T_NATIVE_INT64;
    default:
      HP_FAIL(ErrorKind::kInternal, "checkpoint datasets hold f32, f64 or i64, not ",
              dtype_name(t));
  }
}

std::vector<hsize_t> to_hsize(const Shape& s) { return std::vector<hsize_t>(s.begin(), s.end()); }

int64_t row_elems(const Shape& s) {
  int64_t n = 1;
  for (size_t i = 1; i < s.size(); ++i) n *= s[i];
  return n;
}

// File space of `shape` with rows `rows` selected (none when rows.count == 0), and the matching
// memory space.
void select_rows(hid_t file_space, const Shape& shape, RowRange rows, hid_t* mem_space,
                 const std::string& where) {
  if (rows.count == 0) {
    H5_CHECK(H5Sselect_none(file_space), where);
    *mem_space = H5_CHECK(H5Scopy(file_space), where);
    H5_CHECK(H5Sselect_none(*mem_space), where);
    return;
  }
  std::vector<hsize_t> start(shape.size(), 0), count = to_hsize(shape);
  start[0] = static_cast<hsize_t>(rows.begin);
  count[0] = static_cast<hsize_t>(rows.count);
  H5_CHECK(
      H5Sselect_hyperslab(file_space, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr),
      where);
  *mem_space =
      H5_CHECK(H5Screate_simple(static_cast<int>(count.size()), count.data(), nullptr), where);
}

void fsync_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0 || ::fsync(fd) != 0) {
    const int err = errno;
    if (fd >= 0) ::close(fd);
    HP_FAIL(ErrorKind::kIo, "fsync of ", path, " failed: ", std::strerror(err));
  }
  ::close(fd);
}

}  // namespace

// HDF5 refuses to run under headers of another version than the library's (H5check_version), so
// the headers' numbers are the library's.
std::string hdf5_version_string() {
  return std::to_string(H5_VERS_MAJOR) + "." + std::to_string(H5_VERS_MINOR) + "." +
         std::to_string(H5_VERS_RELEASE);
}

int64_t checkpoint_chunk_rows(const Shape& global_shape, DType dtype) {
  HP_CHECK(!global_shape.empty() && global_shape[0] > 0, "chunking shape ",
           shape_str(global_shape));
  const int64_t row_bytes = row_elems(global_shape) * static_cast<int64_t>(dtype_size(dtype));
  HP_CHECK(row_bytes <= kMaxChunkBytes, "one leading-axis row of ", shape_str(global_shape),
           " exceeds HDF5's 4 GiB chunk limit");
  return std::max<int64_t>(
      1, std::min(global_shape[0], kChunkBytes / std::max<int64_t>(1, row_bytes)));
}

RowRange split_rows_by_chunk(int64_t rows, int64_t chunk_rows, int parts, int part) {
  HP_CHECK(chunk_rows > 0 && parts > 0 && part >= 0 && part < parts, "split_rows_by_chunk");
  const int64_t chunks = (rows + chunk_rows - 1) / chunk_rows;
  const int64_t c0 = chunks * part / parts, c1 = chunks * (part + 1) / parts;
  RowRange r;
  r.begin = std::min(rows, c0 * chunk_rows);
  r.count = std::min(rows, c1 * chunk_rows) - r.begin;
  return r;
}

// ---- writer ---------------------------------------------------------------------------------

// Created and destroyed under the HDF5 lock (its handles close there).
struct CheckpointWriter::Impl {
  Impl() {
    H5Lock lock;
    quiet.emplace();
  }
  ~Impl() {
    H5Lock lock;
    lcpl.reset();
    dxpl.reset();
    file.reset();
    quiet.reset();
  }
  std::optional<H5Quiet> quiet;
  H5Handle file;
  H5Handle dxpl;
  H5Handle lcpl;
};

// CheckpointGroup passes property lists as int64_t.
static_assert(std::is_same<hid_t, int64_t>::value, "HDF5 1.10 or later (64-bit hid_t)");

CheckpointWriter::CheckpointWriter(const std::string& path, const CheckpointGroup* group)
    : impl_(std::make_unique<Impl>()), path_(path), group_(group) {
  H5Lock lock;
  const std::string where = str_cat("checkpoint ", path_);
  H5Handle fapl(H5_CHECK(H5Pcreate(H5P_FILE_ACCESS), where), H5Pclose);
  if (parallel()) group_->use_mpio_driver(fapl.get());
  // No object times: HDF5 would record the creation second in every object header, and two
  // saves of the same state would differ in those bytes. Without them a checkpoint's bytes are a
  // function of what it holds (the root group here, the other groups and datasets below).
  H5Handle fcpl(H5_CHECK(H5Pcreate(H5P_FILE_CREATE), where), H5Pclose);
  H5_CHECK(H5Pset_obj_track_times(fcpl.get(), 0), where);
  // The 1.10 format: checksummed superblock, object headers and B-trees.
  H5_CHECK(H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_V110, H5F_LIBVER_V110), where);
  impl_->file = H5Handle(
      H5_CHECK(H5Fcreate(path_.c_str(), H5F_ACC_TRUNC, fcpl.get(), fapl.get()), where), H5Fclose);
  impl_->dxpl = H5Handle(H5_CHECK(H5Pcreate(H5P_DATASET_XFER), where), H5Pclose);
  if (parallel()) H5_CHECK(H5Pset_dxpl_mpio(impl_->dxpl.get(), H5FD_MPIO_COLLECTIVE), where);
  impl_->lcpl = H5Handle(H5_CHECK(H5Pcreate(H5P_LINK_CREATE), where), H5Pclose);
  H5_CHECK(H5Pset_create_intermediate_group(impl_->lcpl.get(), 1), where);
}

CheckpointWriter::~CheckpointWriter() { abandon(); }

void CheckpointWriter::abandon() noexcept {
  H5Lock lock;
  if (!impl_ || !impl_->file.valid()) return;
  impl_->dxpl.reset();
  impl_->lcpl.reset();
  impl_->file.reset();
}

void CheckpointWriter::set_attr(const std::string& name, const std::string& value) {
  H5Lock lock;
  const std::string where = str_cat(path_, " attribute '", name, "'");
  // Fixed-length, so the text is stored in the attribute itself, under the object header's
  // checksum (a variable-length string would live in the global heap, which has none).
  H5Handle type(H5_CHECK(H5Tcopy(H5T_C_S1), where), H5Tclose);
  H5_CHECK(H5Tset_size(type.get(), std::max<size_t>(1, value.size())), where);
  H5_CHECK(H5Tset_strpad(type.get(), H5T_STR_NULLPAD), where);
  H5_CHECK(H5Tset_cset(type.get(), H5T_CSET_UTF8), where);
  H5Handle space(H5_CHECK(H5Screate(H5S_SCALAR), where), H5Sclose);
  H5Handle attr(H5_CHECK(H5Acreate2(impl_->file.get(), name.c_str(), type.get(), space.get(),
                                    H5P_DEFAULT, H5P_DEFAULT),
                         where),
                H5Aclose);
  std::string padded = value;
  padded.resize(std::max<size_t>(1, value.size()), '\0');
  H5_CHECK(H5Awrite(attr.get(), type.get(), padded.data()), where);
}

void CheckpointWriter::set_attr(const std::string& name, int64_t value) {
  H5Lock lock;
  const std::string where = str_cat(path_, " attribute '", name, "'");
  H5Handle space(H5_CHECK(H5Screate(H5S_SCALAR), where), H5Sclose);
  H5Handle attr(H5_CHECK(H5Acreate2(impl_->file.get(), name.c_str(), H5T_STD_I64LE, space.get(),
                                    H5P_DEFAULT, H5P_DEFAULT),
                         where),
                H5Aclose);
  H5_CHECK(H5Awrite(attr.get(), H5T_NATIVE_INT64, &value), where);
}

void CheckpointWriter::set_attr(const std::string& name, const std::vector<int64_t>& value) {
  H5Lock lock;
  const std::string where = str_cat(path_, " attribute '", name, "'");
  const hsize_t n = value.size();
  H5Handle space(H5_CHECK(H5Screate_simple(1, &n, nullptr), where), H5Sclose);
  H5Handle attr(H5_CHECK(H5Acreate2(impl_->file.get(), name.c_str(), H5T_STD_I64LE, space.get(),
                                    H5P_DEFAULT, H5P_DEFAULT),
                         where),
                H5Aclose);
  H5_CHECK(H5Awrite(attr.get(), H5T_NATIVE_INT64, value.data()), where);
}

void CheckpointWriter::write_rows(const std::string& name, const Shape& shape, DType dtype,
                                  int64_t chunk_rows, RowRange rows, const void* data) {
  H5Lock lock;
  const std::string where = str_cat(path_, " dataset '", name, "'");
  HP_CHECK(!shape.empty() && shape[0] > 0 && chunk_rows > 0, where, ": shape ", shape_str(shape));
  HP_CHECK(rows.begin >= 0 && rows.count >= 0 && rows.begin + rows.count <= shape[0], where,
           ": rows [", rows.begin, ", ", rows.begin + rows.count, ") of ", shape[0]);
  const std::vector<hsize_t> dims = to_hsize(shape);
  std::vector<hsize_t> chunk = dims;
  chunk[0] = static_cast<hsize_t>(std::min(chunk_rows, shape[0]));
  H5Handle space(
      H5_CHECK(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), where),
      H5Sclose);
  H5Handle dcpl(H5_CHECK(H5Pcreate(H5P_DATASET_CREATE), where), H5Pclose);
  H5_CHECK(H5Pset_chunk(dcpl.get(), static_cast<int>(chunk.size()), chunk.data()), where);
  // Every element is written: no fill pass. Chunks are allocated at creation (as parallel HDF5
  // always does): with incremental allocation HDF5 1.10 drops the data of a dataset that is a
  // single unfiltered chunk written whole.
  H5_CHECK(H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER), where);
  H5_CHECK(H5Pset_alloc_time(dcpl.get(), H5D_ALLOC_TIME_EARLY), where);
  H5_CHECK(H5Pset_obj_track_times(dcpl.get(), 0), where);
  // The groups on the way, created here without object times (the link creation property's
  // intermediate groups would carry them).
  for (size_t at = name.find('/', 1); at != std::string::npos; at = name.find('/', at + 1)) {
    const std::string group = name.substr(0, at);
    if (H5_CHECK(H5Lexists(impl_->file.get(), group.c_str(), H5P_DEFAULT), where) > 0) continue;
    H5Handle gcpl(H5_CHECK(H5Pcreate(H5P_GROUP_CREATE), where), H5Pclose);
    H5_CHECK(H5Pset_obj_track_times(gcpl.get(), 0), where);
    H5Handle g(H5_CHECK(H5Gcreate2(impl_->file.get(), group.c_str(), H5P_DEFAULT, gcpl.get(),
                                   H5P_DEFAULT),
                        where),
               H5Gclose);
  }
  H5Handle ds(H5_CHECK(H5Dcreate2(impl_->file.get(), name.c_str(), file_type(dtype), space.get(),
                                  impl_->lcpl.get(), dcpl.get(), H5P_DEFAULT),
                       where),
              H5Dclose);
  // Checksums: the CRC-32C of every chunk's bytes, one writer per chunk (rows fall on chunk
  // boundaries); the writers' vectors are OR-ed together, so every rank holds the whole list
  // for the (collective) attribute write. The attribute is written before the data: adding it
  // to the object header afterwards loses the chunk address of a single-chunk dataset in
  // HDF5 1.10.
  const int64_t n_chunks = ceil_div(shape[0], chunk[0]);
  const int64_t end = rows.begin + rows.count;
  const auto cr = static_cast<int64_t>(chunk[0]);
  HP_CHECK(rows.count == 0 || (rows.begin % cr == 0 && (end % cr == 0 || end == shape[0])), where,
           ": rows [", rows.begin, ", ", end, ") do not fall on chunk boundaries of ", cr, " rows");
  std::vector<uint32_t> crc(static_cast<size_t>(n_chunks), 0);
  if (rows.count > 0)
    chunk_crcs(static_cast<const char*>(data), rows.begin, shape[0],
               row_elems(shape) * static_cast<int64_t>(dtype_size(dtype)), cr, rows.begin / cr,
               ceil_div(end, cr), crc.data());
  if (parallel()) {
    try {
      group_->bitwise_or(crc.data(), crc.size());
    } catch (const Error& e) {
      HP_FAIL(ErrorKind::kComm, where, ": reduction of the chunk checksums: ", e.what());
    }
  }
  const hsize_t n = static_cast<hsize_t>(n_chunks);
  H5Handle aspace(H5_CHECK(H5Screate_simple(1, &n, nullptr), where), H5Sclose);
  H5Handle attr(H5_CHECK(H5Acreate2(ds.get(), kCrcAttr, H5T_STD_U32LE, aspace.get(), H5P_DEFAULT,
                                    H5P_DEFAULT),
                         where),
                H5Aclose);
  H5_CHECK(H5Awrite(attr.get(), H5T_NATIVE_UINT32, crc.data()), where);
  hid_t mem_raw = -1;
  select_rows(space.get(), shape, rows, &mem_raw, where);
  H5Handle mem(mem_raw, H5Sclose);
  // A rank with nothing to write still takes part in the collective transfer.
  static const double kNothing = 0;
  H5_CHECK(H5Dwrite(ds.get(), memory_type(dtype), mem.get(), space.get(), impl_->dxpl.get(),
                    rows.count > 0 ? data : &kNothing),
           where);
  if (parallel()) {
    H5D_mpio_actual_io_mode_t mode = H5D_MPIO_NO_COLLECTIVE;
    H5_CHECK(H5Pget_mpio_actual_io_mode(impl_->dxpl.get(), &mode), where);
    if (mode == H5D_MPIO_NO_COLLECTIVE) {
      uint32_t local = 0, global = 0;
      H5_CHECK(H5Pget_mpio_no_collective_cause(impl_->dxpl.get(), &local, &global), where);
      fallbacks_.push_back(str_cat(name, " (no-collective cause bits local=0x", std::hex, local,
                                   " global=0x", global, ")"));
    }
  }
}

void CheckpointWriter::write_i64(const std::string& name, const std::vector<int64_t>& values,
                                 bool write) {
  const Shape shape{static_cast<int64_t>(std::max<size_t>(1, values.size()))};
  HP_CHECK(!values.empty(), path_, " dataset '", name, "' is empty");
  RowRange rows;
  if (write) rows.count = shape[0];
  write_rows(name, shape, DType::kI64, shape[0], rows, values.data());
}

void CheckpointWriter::close() {
  H5Lock lock;
  const std::string where = str_cat("checkpoint ", path_);
  impl_->dxpl.reset();
  impl_->lcpl.reset();
  if (impl_->file.valid()) {
    H5_CHECK(H5Fflush(impl_->file.get(), H5F_SCOPE_GLOBAL), where);
    H5_CHECK(impl_->file.reset(), where);
  }
  fsync_file(path_);
}

// ---- reader ---------------------------------------------------------------------------------

// Created and destroyed under the HDF5 lock (its file closes there).
struct CheckpointReader::Impl {
  Impl() {
    H5Lock lock;
    quiet.emplace();
  }
  ~Impl() {
    H5Lock lock;
    file.reset();
    quiet.reset();
  }
  std::optional<H5Quiet> quiet;
  H5Handle file;
};

CheckpointReader::CheckpointReader(const std::string& path)
    : impl_(std::make_unique<Impl>()), path_(path) {
  H5Lock lock;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    HP_USER_ERROR(ErrorKind::kData, "checkpoint ", path, ": ", std::strerror(errno));
  const std::string where = str_cat("checkpoint ", path_);
  impl_->file =
      H5Handle(H5_CHECK(H5Fopen(path_.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), where), H5Fclose);
  if (!has_attr("format") || string_attr("format") != kCheckpointFormat)
    HP_USER_ERROR(ErrorKind::kData, "checkpoint ", path_,
                  ": not a hotpath checkpoint (root attribute 'format' is not '", kCheckpointFormat,
                  "')");
  const int64_t version = int_attr("format_version");
  if (version < 1 || version > kCheckpointVersion)
    HP_USER_ERROR(ErrorKind::kData, "checkpoint ", path_, ": format_version ", version,
                  " is not supported (this hotpath reads version ", kCheckpointVersion, ")");
}

CheckpointReader::~CheckpointReader() = default;

bool CheckpointReader::has_attr(const std::string& name) const {
  H5Lock lock;
  const std::string where = str_cat(path_, " attribute '", name, "'");
  return H5_CHECK(H5Aexists(impl_->file.get(), name.c_str()), where) > 0;
}

std::string CheckpointReader::string_attr(const std::string& name) const {
  H5Lock lock;
  const std::string where = str_cat(path_, " attribute '", name, "'");
  H5Handle attr(H5_CHECK(H5Aopen(impl_->file.get(), name.c_str(), H5P_DEFAULT), where), H5Aclose);
  H5Handle type(H5_CHECK(H5Aget_type(attr.get()), where), H5Tclose);
  if (H5Tget_class(type.get()) != H5T_STRING)
    HP_USER_ERROR(ErrorKind::kData, where, " is not a string");
  H5Handle space(H5_CHECK(H5Aget_space(attr.get()), where), H5Sclose);
  if (H5_CHECK(H5Tis_variable_str(type.get()), where) > 0) {
    H5Handle mem(H5_CHECK(H5Tcopy(H5T_C_S1), where), H5Tclose);
    H5_CHECK(H5Tset_size(mem.get(), H5T_VARIABLE), where);
    H5_CHECK(H5Tset_cset(mem.get(), H5Tget_cset(type.get())), where);
    char* p = nullptr;
    H5_CHECK(H5Aread(attr.get(), mem.get(), &p), where);
    std::string s = p != nullptr ? p : "";
    H5_CHECK(H5Dvlen_reclaim(mem.get(), space.get(), H5P_DEFAULT, &p), where);
    return s;
  }
  const size_t n = H5Tget_size(type.get());
  if (n == 0 || n > H5Aget_storage_size(attr.get()))
    HP_USER_ERROR(ErrorKind::kData, where, " is damaged: a string of ", n,
                  " bytes in an attribute that stores ", H5Aget_storage_size(attr.get()));
  std::string s(n, '\0');
  H5_CHECK(H5Aread(attr.get(), type.get(), s.data()), where);
  s.resize(std::strlen(s.c_str()));
  return s;
}

int64_t CheckpointReader::int_attr(const std::string& name) const {
  H5Lock lock;
  std::vector<int64_t> v = ints_attr(name);
  if (v.size() != 1)
    HP_USER_ERROR(ErrorKind::kData, path_, " attribute '", name, "' holds ", v.size(),
                  " values, expected 1");
  return v[0];
}

std::vector<int64_t> CheckpointReader::ints_attr(const std::string& name) const {
  H5Lock lock;
  const std::string where = str_cat(path_, " attribute '", name, "'");
  H5Handle attr(H5_CHECK(H5Aopen(impl_->file.get(), name.c_str(), H5P_DEFAULT), where), H5Aclose);
  H5Handle space(H5_CHECK(H5Aget_space(attr.get()), where), H5Sclose);
  const hssize_t n = H5_CHECK(H5Sget_simple_extent_npoints(space.get()), where);
  std::vector<int64_t> v(static_cast<size_t>(n));
  if (n > 0) H5_CHECK(H5Aread(attr.get(), H5T_NATIVE_INT64, v.data()), where);
  return v;
}

bool CheckpointReader::has_dataset(const std::string& name) const {
  H5Lock lock;
  // Every component of the path must exist for H5Lexists to answer about the last one.
  // A negative answer is not "absent": HDF5 could not read the group or object header (its
  // checksum failed), which is damage, not a missing dataset.
  const auto corrupt = [&](const std::string& what) {
    HP_USER_ERROR(ErrorKind::kData, "checkpoint ", path_, ": the metadata of '", what,
                  "' cannot be read: the file is corrupt (", h5_error_text(), ")");
  };
  size_t pos = 0;
  while (true) {
    pos = name.find('/', pos + 1);
    const std::string prefix = name.substr(0, pos);
    if (!prefix.empty() && prefix != "/") {
      const htri_t e = H5Lexists(impl_->file.get(), prefix.c_str(), H5P_DEFAULT);
      if (e < 0) corrupt(prefix);
      if (e == 0) return false;
    }
    if (pos == std::string::npos) break;
  }
  H5O_info_t oi;
  if (H5Oget_info_by_name2(impl_->file.get(), name.c_str(), &oi, H5O_INFO_BASIC, H5P_DEFAULT) < 0)
    corrupt(name);
  return oi.type == H5O_TYPE_DATASET;
}

DatasetInfo CheckpointReader::info(const std::string& name) const {
  H5Lock lock;
  const std::string where = str_cat(path_, " dataset '", name, "'");
  if (!has_dataset(name)) HP_FAIL(ErrorKind::kHdf5, where, " is missing");
  H5Handle ds(H5_CHECK(H5Dopen2(impl_->file.get(), name.c_str(), H5P_DEFAULT), where), H5Dclose);
  DatasetInfo d;
  d.name = name;
  H5Handle space(H5_CHECK(H5Dget_space(ds.get()), where), H5Sclose);
  const int rank = H5_CHECK(H5Sget_simple_extent_ndims(space.get()), where);
  std::vector<hsize_t> dims(static_cast<size_t>(rank));
  H5_CHECK(H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr), where);
  d.shape.assign(dims.begin(), dims.end());
  H5Handle type(H5_CHECK(H5Dget_type(ds.get()), where), H5Tclose);
  const H5T_class_t cls = H5Tget_class(type.get());
  const size_t size = H5Tget_size(type.get());
  if (cls == H5T_FLOAT && size == 4) {
    d.dtype = DType::kF32;
  } else if (cls == H5T_FLOAT && size == 8) {
    d.dtype = DType::kF64;
  } else if (cls == H5T_INTEGER && size == 8) {
    d.dtype = DType::kI64;
  } else {
    HP_USER_ERROR(ErrorKind::kData, where, ": element type is not f32, f64 or i64");
  }
  H5Handle dcpl(H5_CHECK(H5Dget_create_plist(ds.get()), where), H5Pclose);
  if (H5_CHECK(H5Pget_layout(dcpl.get()), where) == H5D_CHUNKED && rank > 0) {
    std::vector<hsize_t> chunk(static_cast<size_t>(rank));
    H5_CHECK(H5Pget_chunk(dcpl.get(), rank, chunk.data()), where);
    d.chunk_rows = static_cast<int64_t>(chunk[0]);
  }
  const int nf = H5_CHECK(H5Pget_nfilters(dcpl.get()), where);
  for (int i = 0; i < nf; ++i) {
    unsigned flags = 0, cd[8];
    size_t ncd = 8;
    char fname[64];
    const H5Z_filter_t f = H5Pget_filter2(dcpl.get(), static_cast<unsigned>(i), &flags, &ncd, cd,
                                          sizeof fname, fname, nullptr);
    if (f == H5Z_FILTER_FLETCHER32) d.fletcher32 = true;
  }
  d.crc32c = H5_CHECK(H5Aexists(ds.get(), kCrcAttr), where) > 0;
  return d;
}

namespace {
// A walk over a file's groups for its datasets, in name order, depth first (as H5Ovisit gives
// them), through hard links only, each object once, to a bounded depth and count: a damaged file
// can link a group into itself or into an endless chain of new groups, and HDF5's own visit then
// does not end.
struct DatasetWalk {
  static constexpr int kMaxDepth = 16;
  static constexpr int64_t kMaxObjects = int64_t{1} << 18;
  std::vector<std::string> names;
  std::set<haddr_t> seen;  // object addresses
  int64_t objects = 0;
  bool too_large = false;
  int depth = 0;
  std::string prefix = "/";

  static herr_t step(hid_t group, const char* name, const H5L_info_t* link, void* data) {
    auto& w = *static_cast<DatasetWalk*>(data);
    if (link->type != H5L_TYPE_HARD) return 0;
    if (++w.objects > kMaxObjects) {
      w.too_large = true;
      return 1;  // stops the iteration
    }
    H5O_info_t oi;
    if (H5Oget_info_by_name2(group, name, &oi, H5O_INFO_BASIC, H5P_DEFAULT) < 0) return -1;
    if (!w.seen.insert(oi.addr).second) return 0;  // reached before
    const std::string path = w.prefix + name;
    if (oi.type == H5O_TYPE_DATASET) w.names.push_back(path);
    if (oi.type != H5O_TYPE_GROUP) return 0;
    if (w.depth + 1 > kMaxDepth) {
      w.too_large = true;
      return 1;
    }
    const hid_t sub = H5Gopen2(group, name, H5P_DEFAULT);
    if (sub < 0) return -1;
    const std::string saved = w.prefix;
    w.prefix = path + "/";
    ++w.depth;
    const herr_t rc = H5Literate(sub, H5_INDEX_NAME, H5_ITER_INC, nullptr, step, data);
    --w.depth;
    w.prefix = saved;
    H5Gclose(sub);
    return rc;
  }
};
}  // namespace

std::vector<DatasetInfo> CheckpointReader::datasets() const {
  H5Lock lock;
  const std::string where = str_cat("checkpoint ", path_);
  DatasetWalk walk;
  H5_CHECK(
      H5Literate(impl_->file.get(), H5_INDEX_NAME, H5_ITER_INC, nullptr, DatasetWalk::step, &walk),
      where);
  if (walk.too_large)
    HP_USER_ERROR(ErrorKind::kData, where, " is damaged: its groups nest deeper than ",
                  DatasetWalk::kMaxDepth, " levels or hold more than ", DatasetWalk::kMaxObjects,
                  " objects (a checkpoint's are two levels deep)");
  const std::vector<std::string>& names = walk.names;
  std::vector<DatasetInfo> out;
  for (const std::string& n : names) out.push_back(info(n));
  return out;
}

namespace {
// Checks the CRC-32C of every chunk that rows `rows` of dataset `ds` touch; `out` holds those
// rows, read as `dtype`. Throws UserError(kData) naming the chunk when one does not match.
void verify_chunks(hid_t ds, const DatasetInfo& d, RowRange rows, DType dtype, const void* out,
                   const std::string& where) {
  const int64_t cr = std::max<int64_t>(1, d.chunk_rows), n_chunks = ceil_div(d.shape[0], cr);
  std::vector<uint32_t> stored(static_cast<size_t>(n_chunks));
  {
    H5Handle attr(H5_CHECK(H5Aopen(ds, kCrcAttr, H5P_DEFAULT), where), H5Aclose);
    H5Handle space(H5_CHECK(H5Aget_space(attr.get()), where), H5Sclose);
    if (H5_CHECK(H5Sget_simple_extent_npoints(space.get()), where) != n_chunks)
      HP_USER_ERROR(ErrorKind::kData, where, ": attribute '", kCrcAttr, "' does not hold one ",
                    "checksum per chunk (", n_chunks, " chunks): the file is corrupt");
    H5_CHECK(H5Aread(attr.get(), H5T_NATIVE_UINT32, stored.data()), where);
  }
  // The chunks the rows touch. Read in the file's type on chunk boundaries, `out` holds their
  // bytes as stored; otherwise those chunks are read again, whole, in the file's type.
  const int64_t end = rows.begin + rows.count, c0 = rows.begin / cr, c1 = ceil_div(end, cr);
  const int64_t row_bytes = row_elems(d.shape) * static_cast<int64_t>(dtype_size(d.dtype));
  const int64_t r0 = c0 * cr, r1 = std::min(d.shape[0], c1 * cr);
  const char* bytes = static_cast<const char*>(out);
  std::vector<char> whole;
  if (dtype != d.dtype || r0 != rows.begin || r1 != end) {
    whole.resize(static_cast<size_t>((r1 - r0) * row_bytes));
    H5Handle space(H5_CHECK(H5Dget_space(ds), where), H5Sclose);
    hid_t mem_raw = -1;
    select_rows(space.get(), d.shape, RowRange{r0, r1 - r0}, &mem_raw, where);
    H5Handle mem(mem_raw, H5Sclose);
    H5_CHECK(H5Dread(ds, memory_type(d.dtype), mem.get(), space.get(), H5P_DEFAULT, whole.data()),
             where);
    bytes = whole.data();
  }
  std::vector<uint32_t> got(static_cast<size_t>(n_chunks), 0);
  chunk_crcs(bytes, r0, d.shape[0], row_bytes, cr, c0, c1, got.data());
  for (int64_t c = c0; c < c1; ++c)
    if (got[c] != stored[c])
      HP_USER_ERROR(ErrorKind::kData, where, ": chunk ", c, " (rows ", c * cr, "..",
                    std::min(d.shape[0], (c + 1) * cr) - 1,
                    ") fails its CRC-32C checksum (stored 0x", std::hex, stored[c], ", computed 0x",
                    got[c], std::dec, "): the file is corrupt");
}
}  // namespace

void CheckpointReader::read_rows(const std::string& name, RowRange rows, DType dtype,
                                 void* out) const {
  H5Lock lock;
  const std::string where = str_cat(path_, " dataset '", name, "'");
  const DatasetInfo d = info(name);
  if (d.shape.empty() || rows.begin < 0 || rows.count < 0 || rows.begin + rows.count > d.shape[0])
    HP_USER_ERROR(ErrorKind::kData, where, ": rows [", rows.begin, ", ", rows.begin + rows.count,
                  ") requested from shape ", shape_str(d.shape));
  if (rows.count == 0) return;
  H5Handle ds(H5_CHECK(H5Dopen2(impl_->file.get(), name.c_str(), H5P_DEFAULT), where), H5Dclose);
  H5Handle space(H5_CHECK(H5Dget_space(ds.get()), where), H5Sclose);
  hid_t mem_raw = -1;
  select_rows(space.get(), d.shape, rows, &mem_raw, where);
  H5Handle mem(mem_raw, H5Sclose);
  H5_CHECK(H5Dread(ds.get(), memory_type(dtype), mem.get(), space.get(), H5P_DEFAULT, out), where);
  if (d.crc32c) {
    verify_chunks(ds.get(), d, rows, dtype, out, where);
  } else if (!d.fletcher32) {
    // Every dataset hotpath writes carries its checksums; without them nothing can be verified.
    HP_USER_ERROR(ErrorKind::kData, where, ": no checksum (attribute '", kCrcAttr,
                  "' is missing): the file is damaged or was not written by hotpath");
  }
}

std::vector<int64_t> CheckpointReader::read_i64(const std::string& name) const {
  H5Lock lock;
  const DatasetInfo d = info(name);
  if (d.shape.size() != 1 || d.dtype != DType::kI64)
    HP_USER_ERROR(ErrorKind::kData, path_, " dataset '", name, "': expected a 1-D i64 array, got ",
                  dtype_name(d.dtype), " ", shape_str(d.shape));
  std::vector<int64_t> v(static_cast<size_t>(d.shape[0]));
  read_rows(name, RowRange{0, d.shape[0]}, DType::kI64, v.data());
  return v;
}

uint64_t CheckpointReader::verify(const std::string& name, int64_t* nonfinite) const {
  H5Lock lock;
  const DatasetInfo d = info(name);
  if (d.shape.empty()) HP_USER_ERROR(ErrorKind::kData, path_, " dataset '", name, "' is a scalar");
  const int64_t elem = static_cast<int64_t>(dtype_size(d.dtype));
  const int64_t row_bytes = std::max<int64_t>(1, row_elems(d.shape) * elem);
  // Whole chunks per read, so each chunk's checksum is verified on the bytes read.
  const int64_t cr = std::max<int64_t>(1, d.chunk_rows);
  const int64_t step = cr * std::max<int64_t>(1, ((int64_t{64} << 20) / row_bytes) / cr);
  std::vector<char> buf;
  uint64_t h = hash64("");
  for (int64_t r = 0; r < d.shape[0]; r += step) {
    const RowRange rows{r, std::min(step, d.shape[0] - r)};
    buf.resize(static_cast<size_t>(rows.count * row_bytes));
    read_rows(name, rows, d.dtype, buf.data());
    if (nonfinite != nullptr && d.dtype == DType::kF32) {
      const float* v = reinterpret_cast<const float*>(buf.data());
      for (size_t k = 0; k < buf.size() / sizeof(float); ++k) *nonfinite += !std::isfinite(v[k]);
    } else if (nonfinite != nullptr && d.dtype == DType::kF64) {
      const double* v = reinterpret_cast<const double*>(buf.data());
      for (size_t k = 0; k < buf.size() / sizeof(double); ++k) *nonfinite += !std::isfinite(v[k]);
    }
    for (char c : buf) {
      h ^= static_cast<unsigned char>(c);
      h *= 1099511628211ull;
    }
  }
  return h;
}

}  // namespace hp
