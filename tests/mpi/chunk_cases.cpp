// The row-chunk exchanges of parallel/communicator.h, shared by the test_comm files (declared in
// comm_test_util.h): all_to_all_chunks into an expert-major padded layout, and put_rows of several
// tensors along one pair of row tables, the zero-sync dispatch's exchange, on any communicator and
// device. Every value encodes its source rank, its destination and its row, so a misplaced row is named.
#include <algorithm>
#include <cstring>

#include "tests/mpi/comm_test_util.h"
#include "tests/support/checks.h"

namespace flowmoe::test {

namespace {

// all_to_all_chunks into an expert-major layout: every rank hosts kLocalExperts experts, and a
// pattern says how many rows rank src sends for expert e of rank dst (zero-row chunks included).
constexpr int kLocalExperts = 3;
constexpr uint8_t kSentinel = 0xA5;  // every byte of a row no chunk covers

struct ChunkPattern {
  std::string name;
  std::function<int64_t(int src, int dst, int e, int n)> rows;
};

std::vector<ChunkPattern> chunk_patterns() {
  return {
      {"varied", [](int s, int d, int e, int) -> int64_t { return (s * 5 + d * 3 + e * 2) % 4; }},
      {"everything to rank 0", [](int s, int d, int e, int) -> int64_t { return d == 0 ? s + e + 1 : 0; }},
      {"the last rank sends nothing",
       [](int s, int d, int e, int n) -> int64_t { return s == n - 1 ? 0 : (s + d + e) % 3 + 1; }},
  };
}

// Where rank src's rows for (dst, e) start in its send tensor, at [dst * kLocalExperts + e], and the
// total rows last: one spare row, then peers from the last down, so offsets do not follow the list order.
std::vector<int64_t> send_offsets(const ChunkPattern& p, int src, int n) {
  std::vector<int64_t> at(size_t(n) * kLocalExperts + 1);
  int64_t next = 1;
  for (int dst = n - 1; dst >= 0; --dst)
    for (int e = 0; e < kLocalExperts; ++e) {
      at[size_t(dst * kLocalExperts + e)] = next;
      next += p.rows(src, dst, e, n);
    }
  at.back() = next;
  return at;
}

Tensor sentinel_rows(int64_t rows, const Shape& row, DType dtype) {
  Shape shape = row;
  shape.insert(shape.begin(), rows);
  Tensor t = Tensor::empty(shape, dtype);
  if (t.nbytes()) std::memset(t.raw_data(), kSentinel, t.nbytes());
  return t;
}

// Fills `rows` rows of t from row `at`: rank src's rows from `src_row` on, for rank dst.
void encode_rows(const Tensor& t, int64_t at, int64_t rows, int src, int dst, int64_t src_row) {
  const int64_t width = t.size(0) ? t.numel() / t.size(0) : 0;
  const size_t size = dtype_size(t.dtype());
  auto* base = static_cast<uint8_t*>(t.raw_data());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t col = 0; col < width; ++col)
      encode(base + size_t((at + i) * width + col) * size, size, src, dst, src_row + i, col);
}

// Bitwise comparison naming the first element that differs and what its row should hold.
::testing::AssertionResult chunk_rows_equal(const Tensor& got_any, const Tensor& want,
                                            const std::vector<std::string>& should_hold, int me) {
  Tensor got = got_any.to(Device::cpu());
  const size_t size = dtype_size(want.dtype());
  const int64_t width = want.size(0) ? want.numel() / want.size(0) : 0;
  const auto* g = static_cast<const uint8_t*>(got.raw_data());
  const auto* w = static_cast<const uint8_t*>(want.raw_data());
  for (int64_t at = 0; at < want.size(0); ++at)
    for (int64_t col = 0; col < width; ++col) {
      size_t off = size_t(at * width + col) * size;
      if (std::memcmp(g + off, w + off, size) == 0) continue;
      auto fail = ::testing::AssertionFailure();
      fail << "rank " << me << " recv row " << at << " should hold " << should_hold[size_t(at)] << "; column " << col
           << " of " << dtype_name(want.dtype()) << ": ";
      if (size == 4) {
        float gv, wv;
        std::memcpy(&gv, g + off, 4);
        std::memcpy(&wv, w + off, 4);
        return fail << "got " << gv << " (" << decode_row_code(gv) << "), want " << wv << " (" << decode_row_code(wv)
                    << ")";
      }
      return fail << "got bits " << hex_bits(g + off, size) << ", want " << hex_bits(w + off, size);
    }
  return ::testing::AssertionSuccess();
}

// put_rows' tables for one chunk pattern, on rank me: the expert-major layout of
// check_all_to_all_chunks_cases with every segment padded to a multiple of 4 (pad rows too may be
// none here) and kTailRows rows after the last, the same rows on every rank (the device put needs it).
constexpr int64_t kTailRows = 5;
struct PutLayout {
  std::vector<int64_t> seg;                  // [L+1] this rank's segment starts
  std::vector<int64_t> covered;              // [L] the rows the peers send each segment
  std::vector<int64_t> out_table, in_table;  // [n, L, 3] each
  int64_t recv_rows = 0;
};

std::vector<int64_t> put_segments(const ChunkPattern& p, int r, int n) {
  std::vector<int64_t> seg(size_t(kLocalExperts) + 1, 0);
  for (int e = 0; e < kLocalExperts; ++e) {
    int64_t total = 0;
    for (int src = 0; src < n; ++src) total += p.rows(src, r, e, n);
    seg[size_t(e) + 1] = seg[size_t(e)] + (total + 3) / 4 * 4;
  }
  return seg;
}

PutLayout put_layout(const ChunkPattern& p, int me, int n) {
  const int L = kLocalExperts;
  PutLayout l;
  for (int r = 0; r < n; ++r) l.recv_rows = std::max(l.recv_rows, put_segments(p, r, n).back() + kTailRows);
  l.seg = put_segments(p, me, n);
  const std::vector<int64_t> mine = send_offsets(p, me, n);
  for (int q = 0; q < n; ++q) {  // to q's expert e: after the rows of the ranks before me
    const std::vector<int64_t> theirs = put_segments(p, q, n);
    for (int e = 0; e < L; ++e) {
      int64_t before = 0;
      for (int src = 0; src < me; ++src) before += p.rows(src, q, e, n);
      l.out_table.insert(l.out_table.end(), {mine[size_t(q * L + e)], theirs[size_t(e)] + before, p.rows(me, q, e, n)});
    }
  }
  l.covered.assign(size_t(L), 0);
  for (int src = 0; src < n; ++src) {  // from src, in the order src's out_table lists them for me
    const std::vector<int64_t> theirs = send_offsets(p, src, n);
    for (int e = 0; e < L; ++e) {
      const int64_t rows = p.rows(src, me, e, n);
      l.in_table.insert(l.in_table.end(), {l.seg[size_t(e)] + l.covered[size_t(e)], theirs[size_t(me * L + e)], rows});
      l.covered[size_t(e)] += rows;
    }
  }
  return l;
}

}  // namespace

void check_all_to_all_chunks_cases(Communicator& comm, Device device, DType dtype, const Shape& row) {
  const int me = comm.rank(), n = comm.size(), L = kLocalExperts;
  for (const ChunkPattern& p : chunk_patterns()) {
    SCOPED_TRACE("chunk pattern " + p.name + ", rows " + dtype_name(dtype) + shape_str(row));
    // Sender: its chunks listed expert by expert, peers interleaved; each peer sees its experts in order.
    std::vector<int64_t> mine = send_offsets(p, me, n);
    Tensor send = sentinel_rows(mine.back(), row, dtype);
    std::vector<Communicator::RowChunk> send_chunks;
    for (int e = 0; e < L; ++e)
      for (int q = 0; q < n; ++q) {
        int64_t at = mine[size_t(q * L + e)], rows = p.rows(me, q, e, n);
        send_chunks.push_back({q, at, rows});
        encode_rows(send, at, rows, me, q, at);
      }
    // Receiver: expert e's rows from peer p at pad_start[e] + the rows of peers before p; each expert's
    // block is padded to a multiple of 4 with at least one pad row, which must keep the sentinel.
    std::vector<int64_t> pad_start(size_t(L) + 1, 0);
    for (int e = 0; e < L; ++e) {
      int64_t total = 0;
      for (int src = 0; src < n; ++src) total += p.rows(src, me, e, n);
      pad_start[size_t(e) + 1] = pad_start[size_t(e)] + (total + 4) / 4 * 4;
    }
    Tensor want = sentinel_rows(pad_start.back(), row, dtype);
    std::vector<std::string> should_hold(size_t(pad_start.back()), "the sentinel (a pad row)");
    std::vector<Communicator::RowChunk> recv_chunks;
    std::vector<int64_t> filled(pad_start.begin(), pad_start.end() - 1);
    for (int src = 0; src < n; ++src) {
      std::vector<int64_t> theirs = send_offsets(p, src, n);
      for (int e = 0; e < L; ++e) {
        int64_t rows = p.rows(src, me, e, n), src_row = theirs[size_t(me * L + e)];
        recv_chunks.push_back({src, filled[size_t(e)], rows});
        encode_rows(want, filled[size_t(e)], rows, src, me, src_row);
        for (int64_t i = 0; i < rows; ++i) {
          std::string what = "rank " + std::to_string(src) + "'s row " + std::to_string(src_row + i);
          should_hold[size_t(filled[size_t(e)] + i)] = what + " (expert " + std::to_string(e) + ")";
        }
        filled[size_t(e)] += rows;
      }
    }
    Tensor recv = sentinel_rows(pad_start.back(), row, dtype).to(device);
    comm.all_to_all_chunks(send.to(device), send_chunks, recv, recv_chunks);
    comm.synchronize();
    EXPECT_TRUE(chunk_rows_equal(recv, want, should_hold, me));
  }
}

void check_put_rows_cases(Communicator& comm, Device device) {
  const int me = comm.rank(), n = comm.size(), L = kLocalExperts;
  struct Kind {
    DType dtype;
    Shape row;
    double pad;
  };
  // Store units of 4 (12-byte rows), 16 and 1 byte on the device path, and pad values of each kind.
  const Kind kinds[] = {
      {DType::f32, {3}, 1.0}, {DType::bf16, {8}, 0.0}, {DType::i32, {}, 7.0}, {DType::e4m3, {3}, 0.0}};
  const bool host_path = put_rows_through_host(comm);  // NaN bytes in the tail; the device put leaves it unwritten
  for (const ChunkPattern& p : chunk_patterns()) {
    SCOPED_TRACE("put_rows, chunk pattern " + p.name);
    const PutLayout l = put_layout(p, me, n);
    const std::vector<int64_t> mine = send_offsets(p, me, n);
    const int64_t seg_end = l.seg.back();
    std::vector<Communicator::RowPut> tensors;
    std::vector<Tensor> wants;
    std::vector<std::string> should_hold(size_t(seg_end), "the pad value");
    for (const Kind& k : kinds) {
      Tensor send = sentinel_rows(mine.back(), k.row, k.dtype);
      for (int q = 0; q < n; ++q)
        for (int e = 0; e < L; ++e) {
          const int64_t at = mine[size_t(q * L + e)];
          encode_rows(send, at, p.rows(me, q, e, n), me, q, at);
        }
      Shape shape = k.row;
      shape.insert(shape.begin(), seg_end);
      Tensor want = Tensor::full(shape, k.pad, k.dtype);
      for (int i = 0; i < n * L; ++i) {
        const int64_t* c = l.in_table.data() + 3 * i;
        encode_rows(want, c[0], c[2], i / L, me, c[1]);
        for (int64_t j = 0; j < c[2]; ++j)
          should_hold[size_t(c[0] + j)] = "rank " + std::to_string(i / L) + "'s row " + std::to_string(c[1] + j);
      }
      tensors.push_back({send.to(device), sentinel_rows(l.recv_rows, k.row, k.dtype).to(device), k.pad});
      wants.push_back(want);
    }
    auto table = [&](const std::vector<int64_t>& v, const Shape& shape) {
      return Tensor::from_ints(v, shape, DType::i32, device);
    };
    Communicator::PadSegments pad;
    pad.starts = table(l.seg, {L + 1}), pad.covered = table(l.covered, {L});
    comm.put_rows(tensors, table(l.out_table, {n, L, 3}), table(l.in_table, {n, L, 3}), pad);
    comm.synchronize();
    for (size_t k = 0; k < tensors.size(); ++k) {
      SCOPED_TRACE(std::string("tensor ") + dtype_name(kinds[k].dtype));
      const Tensor got = tensors[k].recv.to(Device::cpu());
      EXPECT_TRUE(chunk_rows_equal(got, wants[k], should_hold, me));
      if (!host_path) continue;
      const auto* bytes = static_cast<const uint8_t*>(got.raw_data());
      const size_t first = got.numel() ? size_t(seg_end) * got.nbytes() / size_t(got.size(0)) : 0;
      EXPECT_TRUE(std::all_of(bytes + first, bytes + got.nbytes(), [](uint8_t b) { return b == 0xFF; }))
          << "rank " << me << ": the tail past row " << seg_end << " is not NaN bytes";
    }
  }
  // An emptied exchange (its layout ran past the buffers, kernels/ep_layout.h): tables that move nothing and a
  // nonzero overflow. Every row of every recv, tail included, takes its pad value, on every path.
  SCOPED_TRACE("put_rows, an emptied exchange");
  const int64_t recv_rows = 40;
  std::vector<Communicator::RowPut> tensors;
  for (const Kind& k : kinds)
    tensors.push_back(
        {sentinel_rows(8, k.row, k.dtype).to(device), sentinel_rows(recv_rows, k.row, k.dtype).to(device), k.pad});
  const auto zeros = [&](const Shape& shape) { return Tensor::zeros(shape, DType::i32, device); };
  Communicator::PadSegments pad;
  pad.starts = zeros({L + 1}), pad.covered = zeros({L});
  pad.overflow = Tensor::from_ints({recv_rows + 1}, {1}, DType::i32, device);
  comm.put_rows(tensors, zeros({n, L, 3}), zeros({n, L, 3}), pad);
  comm.synchronize();
  for (size_t k = 0; k < tensors.size(); ++k) {
    Shape shape = kinds[k].row;
    shape.insert(shape.begin(), recv_rows);
    EXPECT_TRUE(bit_equal(tensors[k].recv.to(Device::cpu()), Tensor::full(shape, kinds[k].pad, kinds[k].dtype)))
        << "rank " << me << ", tensor " << dtype_name(kinds[k].dtype) << ": not every row is the pad value";
  }
}

}  // namespace flowmoe::test
