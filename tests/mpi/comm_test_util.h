// Shared by the test_comm files: the world this process was started in (made once by the test main
// through init_distributed, as a training run makes it) and the row patterns the collective tests
// send. Every value encodes where it came from, so a row that arrives in the wrong place is named.
#pragma once
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "parallel/communicator.h"
#include "parallel/distributed.h"

namespace flowmoe::test {

DistributedRuntime& test_runtime();
inline Communicator& test_world() { return *test_runtime().world; }

// Rows that rank src sends rank dst, for a world of n ranks.
struct CountPattern {
  std::string name;
  std::function<int64_t(int src, int dst, int n)> rows;
};
// even; skewed; one rank sends nothing and one receives nothing; everyone sends to rank 0 only.
std::vector<CountPattern> count_patterns();
std::vector<int64_t> send_counts(const CountPattern& p, int me, int n);
std::vector<int64_t> recv_counts(const CountPattern& p, int me, int n);

// The f32 value of element (j, col) of the block src sends dst: exact in f32 (24 bits), decodable.
float row_code(int src, int dst, int64_t j, int64_t col);
std::string decode_row_code(float v);  // "rank 1's row 3 for rank 0, column 2"
// Writes element (j, col) of block src -> dst in `size` bytes: row_code's f32 bits (size 4), or a
// mix of them folded to 2 or 1 bytes, bit patterns that are not valid numbers included.
void encode(void* dst_bytes, size_t size, int src, int dst, int64_t j, int64_t col);
std::string hex_bits(const uint8_t* p, size_t size);  // an element's bytes as one little-endian number

// Why this run cannot test nccl with a GPU per rank and several ranks ("" when it can): the build has
// no NCCL, one rank, or fewer GPUs than ranks. A test skips with it.
std::string why_no_nccl_gpu_per_rank();

// Whether comm's put_rows moves rows through the host (every backend but nccl's device puts), which
// writes NaN bytes into the rows no chunk or pad segment covers. Collective the first time (nccl).
bool put_rows_through_host(Communicator& comm);

// Every collective test on `comm` with tensors on `device` (CPU, CUDA through staging, or nccl).
void check_all_to_all_cases(Communicator& comm, Device device);
// all_to_all_chunks into an expert-major padded layout, rows of `row` elements of `dtype` (chunk_cases.cpp).
void check_all_to_all_chunks_cases(Communicator& comm, Device device, DType dtype, const Shape& row);
// put_rows of four tensors (f32, bf16, i32 and FP8 rows, each with its pad value) along one pair of
// row tables into that layout with a tail: the chunks, the pad rows, and NaN bytes in the tail where
// the rows moved through the host (chunk_cases.cpp).
void check_put_rows_cases(Communicator& comm, Device device);
void check_all_reduce_cases(Communicator& comm, Device device);
void check_all_gather_and_broadcast(Communicator& comm, Device device);
// reduce_scatter_in_place (sum, avg) and all_gather_in_place of rank-coded flat tensors, segments of
// 1, 5 and 0 elements; each rank checks its own segment, then every segment after the gather.
void check_sharded_halves(Communicator& comm, Device device);

}  // namespace flowmoe::test
