// Row patterns and the collective checks shared by the test_comm files (see comm_test_util.h). The
// checks use EXPECT, never ASSERT, between collectives: a rank that returned early would leave its
// peers waiting in the next collective.
#include "tests/mpi/comm_test_util.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/common/device_api.h"
#include "parallel/backends.h"

namespace flowmoe::test {

std::vector<CountPattern> count_patterns() {
  return {
      {"even", [](int, int, int) -> int64_t { return 3; }},
      {"skewed", [](int s, int d, int) -> int64_t { return (s * 7 + d * 3) % 5 + (s == d ? 4 : 0); }},
      {"empty peers", [](int s, int d, int n) -> int64_t { return s == n - 1 || d == 0 ? 0 : 2; }},
      {"all to one", [](int s, int d, int) -> int64_t { return d == 0 ? s + 2 : 0; }},
  };
}

std::vector<int64_t> send_counts(const CountPattern& p, int me, int n) {
  std::vector<int64_t> c;
  for (int d = 0; d < n; ++d) c.push_back(p.rows(me, d, n));
  return c;
}

std::vector<int64_t> recv_counts(const CountPattern& p, int me, int n) {
  std::vector<int64_t> c;
  for (int s = 0; s < n; ++s) c.push_back(p.rows(s, me, n));
  return c;
}

std::string why_no_nccl_gpu_per_rank() {
  if (!built_with_nccl()) return "built without NCCL";
  const int n = test_world().size();
  if (n < 2 || cuda_device_count() < n)
    return "nccl needs a GPU per rank and several ranks: " + std::to_string(n) + " ranks, " +
           std::to_string(cuda_device_count()) + " GPUs";
  return "";
}

bool put_rows_through_host(Communicator& comm) {
  return std::string(comm.backend_name()) != "nccl" || !comm.device_puts();
}

float row_code(int src, int dst, int64_t j, int64_t col) {
  return float((int64_t(src) << 20) | (int64_t(dst) << 16) | ((j & 0xFF) << 8) | (col & 0xFF));
}

std::string decode_row_code(float v) {
  int64_t c = int64_t(v);
  if (float(c) != v || c < 0 || c >= (int64_t(1) << 24)) return "not a row code";
  return "rank " + std::to_string(c >> 20) + "'s row " + std::to_string((c >> 8) & 0xFF) + " for rank " +
         std::to_string((c >> 16) & 0xF) + ", column " + std::to_string(c & 0xFF);
}

// The bytes element (j, col) of block src -> dst holds, for a dtype of `size` bytes: the f32 code, or a
// mix of it folded to 2 (bf16) or 1 (FP8) bytes, bit patterns that are not valid numbers included.
void encode(void* dst_bytes, size_t size, int src, int dst, int64_t j, int64_t col) {
  float code = row_code(src, dst, j, col);
  uint32_t bits = uint32_t(code);
  uint32_t mixed = bits * 2654435761u;
  mixed ^= mixed >> 15;
  if (size == 4) std::memcpy(dst_bytes, &code, 4);
  if (size == 2) {
    uint16_t h = uint16_t(mixed);
    std::memcpy(dst_bytes, &h, 2);
  }
  if (size == 1) *static_cast<uint8_t*>(dst_bytes) = uint8_t(mixed ^ (mixed >> 8));
}

// An element's bits as hex (little-endian bytes read as one number), e.g. "0x3f80".
std::string hex_bits(const uint8_t* p, size_t size) {
  static const char digits[] = "0123456789abcdef";
  std::string out = "0x";
  for (size_t i = size; i-- > 0;) {
    out += digits[p[i] >> 4];
    out += digits[p[i] & 15];
  }
  return out;
}

namespace {

// Rows [count, width...] of blocks (peer, me) or (me, peer) laid out peer after peer, on the CPU.
Tensor make_rows(const std::vector<int64_t>& counts, const Shape& row, DType dtype, int me, bool outgoing) {
  Shape shape = row;
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  shape.insert(shape.begin(), total);
  Tensor t = Tensor::empty(shape, dtype);
  const int64_t width = shape_numel(row);
  const size_t size = dtype_size(dtype);
  auto* base = static_cast<uint8_t*>(t.raw_data());
  int64_t at = 0;
  for (int peer = 0; peer < int(counts.size()); ++peer)
    for (int64_t j = 0; j < counts[size_t(peer)]; ++j, ++at)
      for (int64_t col = 0; col < width; ++col)
        encode(base + size_t(at * width + col) * size, size, outgoing ? me : peer, outgoing ? peer : me, j, col);
  return t;
}

// Bitwise comparison naming the first element that differs, by where it should have come from.
::testing::AssertionResult rows_equal(const Tensor& got_any, const Tensor& want, const std::vector<int64_t>& from,
                                      int me) {
  Tensor got = got_any.to(Device::cpu());
  if (got.shape() != want.shape())
    return ::testing::AssertionFailure() << "shape " << shape_str(got.shape()) << ", want " << shape_str(want.shape());
  const size_t size = dtype_size(want.dtype());
  const int64_t width = want.size(0) ? want.numel() / want.size(0) : 0;
  const auto* g = static_cast<const uint8_t*>(got.raw_data());
  const auto* w = static_cast<const uint8_t*>(want.raw_data());
  int64_t at = 0;
  for (int peer = 0; peer < int(from.size()); ++peer)
    for (int64_t j = 0; j < from[size_t(peer)]; ++j, ++at)
      for (int64_t col = 0; col < width; ++col) {
        size_t off = size_t(at * width + col) * size;
        if (std::memcmp(g + off, w + off, size) == 0) continue;
        auto fail = ::testing::AssertionFailure();
        fail << "rank " << me << " recv row " << at << " (rank " << peer << "'s row " << j << " for it), column " << col
             << " of " << dtype_name(want.dtype()) << ": ";
        if (size == 4) {
          float gv, wv;
          std::memcpy(&gv, g + off, 4);
          std::memcpy(&wv, w + off, 4);
          return fail << "got " << gv << " (" << decode_row_code(gv) << "), want " << wv;
        }
        return fail << "got bits " << hex_bits(g + off, size) << ", want " << hex_bits(w + off, size);
      }
  return ::testing::AssertionSuccess();
}

}  // namespace

void check_all_to_all_cases(Communicator& comm, Device device) {
  const int me = comm.rank(), n = comm.size();
  struct RowKind {
    DType dtype;
    Shape row;
  };
  // f32 of odd width, bf16 rows of two dims, FP8 bytes of a 256-wide row with its two f32 block scales.
  const RowKind kinds[] = {{DType::f32, {5}}, {DType::bf16, {2, 4}}, {DType::e4m3, {256}}, {DType::f32, {2}}};
  for (const CountPattern& p : count_patterns()) {
    SCOPED_TRACE("pattern " + p.name);
    std::vector<int64_t> sc = send_counts(p, me, n), rc = recv_counts(p, me, n);
    EXPECT_EQ(comm.exchange_counts(sc), rc);
    for (const RowKind& k : kinds) {
      SCOPED_TRACE(std::string("rows ") + dtype_name(k.dtype) + shape_str(k.row));
      Tensor send = make_rows(sc, k.row, k.dtype, me, true).to(device);
      Tensor want = make_rows(rc, k.row, k.dtype, me, false);
      Shape recv_shape = want.shape();
      Tensor recv = Tensor::empty(recv_shape, k.dtype, device);
      comm.all_to_all(send, sc, recv, rc);
      comm.synchronize();
      EXPECT_TRUE(rows_equal(recv, want, rc, me));
    }
    // An FP8 tensor with its rowwise scales attached: the allocating form moves both.
    Tensor data = make_rows(sc, {256}, DType::e4m3, me, true).to(device);
    Tensor scales = make_rows(sc, {2}, DType::f32, me, true).to(device);
    Tensor got = comm.all_to_all(data.with_scales(scales, ScalingMode::rowwise_1x128), sc, rc);
    comm.synchronize();
    EXPECT_TRUE(rows_equal(got, make_rows(rc, {256}, DType::e4m3, me, false), rc, me));
    ASSERT_TRUE(got.fp8_scales() != nullptr);
    EXPECT_EQ(got.fp8_scales()->mode, ScalingMode::rowwise_1x128);
    EXPECT_TRUE(rows_equal(got.fp8_scales()->scale_inv, make_rows(rc, {2}, DType::f32, me, false), rc, me));
  }
}

void check_all_reduce_cases(Communicator& comm, Device device) {
  const int me = comm.rank(), n = comm.size();
  const int64_t len = 7;
  std::vector<double> f, fmax;
  std::vector<int64_t> i64, i32;
  for (int64_t i = 0; i < len; ++i) {
    f.push_back(me + 0.5 * double(i));
    fmax.push_back(double((me * 5 + i * 3) % 11));
    i64.push_back((int64_t(1) << 40) + me * i);
    i32.push_back(me - i);
  }
  Tensor tf32 = Tensor::from_doubles(f, {len}, DType::f32, device);
  Tensor tf64 = Tensor::from_doubles(f, {len}, DType::f64, device);
  Tensor tmax = Tensor::from_doubles(fmax, {len}, DType::f32, device);
  Tensor ti64 = Tensor::from_ints(i64, {len}, DType::i64, device);
  Tensor ti32 = Tensor::from_ints(i32, {len}, DType::i32, device);
  comm.all_reduce(tf32, ReduceOp::sum);
  comm.all_reduce(tf64, ReduceOp::sum);
  comm.all_reduce(tmax, ReduceOp::max);
  comm.all_reduce(ti64, ReduceOp::sum);
  comm.all_reduce(ti32, ReduceOp::max);
  comm.synchronize();
  std::vector<float> got32 = tf32.to_floats(), gotmax = tmax.to_floats();
  std::vector<double> got64 = tf64.to_doubles();
  std::vector<int64_t> goti64 = ti64.to_ints(), goti32 = ti32.to_ints();
  const double ranks_sum = double(n) * double(n - 1) / 2;
  for (int64_t i = 0; i < len; ++i) {
    double want_max = 0;
    for (int r = 0; r < n; ++r) want_max = std::max(want_max, double((r * 5 + i * 3) % 11));
    EXPECT_EQ(got32[size_t(i)], float(ranks_sum + n * 0.5 * double(i))) << "f32 sum, element " << i;
    EXPECT_EQ(got64[size_t(i)], ranks_sum + n * 0.5 * double(i)) << "f64 sum, element " << i;
    EXPECT_EQ(gotmax[size_t(i)], float(want_max)) << "f32 max, element " << i;
    EXPECT_EQ(goti64[size_t(i)], n * (int64_t(1) << 40) + i * int64_t(ranks_sum)) << "i64 sum, element " << i;
    EXPECT_EQ(goti32[size_t(i)], n - 1 - i) << "i32 max, element " << i;
  }
  // avg: the mean of values whose sum and mean are exact at 1, 2 and 4 ranks; integers are refused.
  Tensor avg32 = Tensor::from_doubles(f, {len}, DType::f32, device),
         avg64 = Tensor::from_doubles(f, {len}, DType::f64, device);
  comm.all_reduce(avg32, ReduceOp::avg);
  comm.all_reduce(avg64, ReduceOp::avg);
  comm.synchronize();
  const std::vector<float> gotavg32 = avg32.to_floats();
  const std::vector<double> gotavg64 = avg64.to_doubles();
  for (int64_t i = 0; i < len; ++i) {
    EXPECT_EQ(gotavg32[size_t(i)], float((ranks_sum + n * 0.5 * double(i)) / n)) << "f32 avg, element " << i;
    EXPECT_EQ(gotavg64[size_t(i)], (ranks_sum + n * 0.5 * double(i)) / n) << "f64 avg, element " << i;
  }
  EXPECT_THROW(comm.all_reduce(Tensor::from_ints({1}, {1}, DType::i32, device), ReduceOp::avg), DTypeError);
}

void check_all_gather_and_broadcast(Communicator& comm, Device device) {
  const int me = comm.rank(), n = comm.size();
  // all_gather: rank r's two rows are its rows "for rank 0"; the result is every rank's, in rank order.
  Tensor mine = make_rows(std::vector<int64_t>{2}, {3}, DType::f32, me, true);
  Tensor gathered = comm.all_gather(mine.to(device));
  comm.synchronize();
  std::vector<int64_t> from(size_t(n), 2);
  std::vector<float> w;
  for (int r = 0; r < n; ++r)
    for (int64_t j = 0; j < 2; ++j)
      for (int64_t c = 0; c < 3; ++c) w.push_back(row_code(r, 0, j, c));
  EXPECT_TRUE(rows_equal(gathered, Tensor::from_floats(w, {2 * int64_t(n), 3}), from, me));

  // broadcast from every root in turn, of FP8 bytes (a tensor of any dtype moves as bytes).
  for (int root = 0; root < n; ++root) {
    SCOPED_TRACE("root " + std::to_string(root));
    Tensor block = make_rows(std::vector<int64_t>{4}, {16}, DType::e4m3, root, true);
    Tensor t = me == root ? block.to(device) : Tensor::zeros({4, 16}, DType::e4m3, device);
    comm.broadcast(t, root);
    comm.synchronize();
    std::vector<int64_t> from_root(size_t(n), 0);
    from_root[size_t(root)] = 4;
    EXPECT_TRUE(rows_equal(t, block, from_root, me));
  }
}

void check_sharded_halves(Communicator& comm, Device device) {
  const int me = comm.rank(), n = comm.size();
  for (int64_t seg : {int64_t(1), int64_t(5), int64_t(0)}) {
    SCOPED_TRACE("segment of " + std::to_string(seg));
    // Rank r holds r * 1000 + i at element i: every sum is exact in f32.
    std::vector<float> mine(size_t(seg * n));
    for (size_t i = 0; i < mine.size(); ++i) mine[i] = float(me * 1000 + int64_t(i));
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg}) {
      Tensor t = Tensor::from_floats(mine, {seg * n}).to(device);
      comm.reduce_scatter_in_place(t, op);
      comm.synchronize();
      const std::vector<float> got = t.to_floats();
      for (int64_t i = me * seg; i < (me + 1) * seg; ++i) {
        const double sum = 1000.0 * n * (n - 1) / 2 + double(n) * double(i);
        const double want = op == ReduceOp::sum ? sum : sum / n;
        EXPECT_NEAR(got[size_t(i)], want, 1e-6 * std::abs(want)) << "element " << i;
      }
    }
    // all_gather_in_place: only this rank's segment is set; the others are NaN until gathered.
    std::vector<float> own(size_t(seg * n), NAN);
    for (int64_t i = me * seg; i < (me + 1) * seg; ++i) own[size_t(i)] = float(me * 1000 + i);
    Tensor t = Tensor::from_floats(own, {seg * n}).to(device);
    comm.all_gather_in_place(t);
    comm.synchronize();
    const std::vector<float> got = t.to_floats();
    for (int64_t i = 0; i < seg * n; ++i) EXPECT_EQ(got[size_t(i)], float((i / seg) * 1000 + i)) << "element " << i;
  }
}

}  // namespace flowmoe::test
