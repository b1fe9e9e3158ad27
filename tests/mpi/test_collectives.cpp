// The collectives of parallel/communicator.h on the world this test runs in: alone (backend none)
// or under mpirun (backend mpi). CPU tensors always; CUDA tensors through the same communicator
// (mpi stages them through host memory) and through nccl when there is a GPU per rank, skipped
// cleanly otherwise. Argument errors are raised before any communication, on every rank alike.
#include "kernels/common/device_api.h"
#include "parallel/backends.h"
#include "tests/mpi/comm_test_util.h"
#include "tests/support/checks.h"

namespace flowmoe::test {
namespace {

Device rank_gpu(const Communicator& comm) { return Device::cuda(comm.rank() % cuda_device_count()); }

TEST(Collectives, AllToAllMovesEveryRowToItsPeerBitForBit) { check_all_to_all_cases(test_world(), Device::cpu()); }

TEST(Collectives, AllToAllChunksLandsRowsInAnExpertMajorPaddedLayout) {
  check_all_to_all_chunks_cases(test_world(), Device::cpu(), DType::f32, {3});
  check_all_to_all_chunks_cases(test_world(), Device::cpu(), DType::bf16, {2, 2});
}

TEST(Collectives, PutRowsMovesSeveralTensorsAlongOneTableAndSetsOnlyThePadRows) {
  check_put_rows_cases(test_world(), Device::cpu());
}

TEST(Collectives, AllToAllChunksMovesFp8BytesBitForBit) {
  check_all_to_all_chunks_cases(test_world(), Device::cpu(), DType::e4m3, {128});
}

// Windows of exchange time, as training steps close and read them: each window holds the exchanges
// made before its close, the oldest is read first, and none left reads as 0.
void check_exchange_windows(Communicator& comm, Device device) {
  comm.take_exchange_ms();
  check_all_to_all_cases(comm, device);
  comm.close_exchange_window();
  comm.close_exchange_window();  // a window with no exchange in it
  check_all_to_all_cases(comm, device);
  comm.close_exchange_window();
  EXPECT_GT(comm.take_exchange_window_ms(), 0.0);
  EXPECT_EQ(comm.take_exchange_window_ms(), 0.0);
  EXPECT_GT(comm.take_exchange_window_ms(), 0.0);
  EXPECT_EQ(comm.take_exchange_window_ms(), 0.0);  // none left
  check_all_to_all_cases(comm, device);
  comm.close_exchange_window();
  EXPECT_GT(comm.take_exchange_ms(), 0.0);  // takes closed windows too
  EXPECT_EQ(comm.take_exchange_window_ms(), 0.0);
}

// The host-timed backends (none, mpi) sum the time of every all-to-all until it is taken.
TEST(Collectives, ExchangeTimeIsSummedUntilTaken) {
  Communicator& world = test_world();
  world.take_exchange_ms();
  check_all_to_all_cases(world, Device::cpu());
  EXPECT_GT(world.take_exchange_ms(), 0.0);
  EXPECT_EQ(world.take_exchange_ms(), 0.0);
  check_exchange_windows(world, Device::cpu());
}

TEST(Collectives, AllReduceSumsAndMaxesF32F64AndIntegers) { check_all_reduce_cases(test_world(), Device::cpu()); }

TEST(Collectives, AllGatherAndBroadcastFromEveryRoot) { check_all_gather_and_broadcast(test_world(), Device::cpu()); }

TEST(Collectives, ReduceScatterAndAllGatherInPlaceBySegment) { check_sharded_halves(test_world(), Device::cpu()); }

TEST(Collectives, BarrierAndSynchronizeReturn) {
  for (int i = 0; i < 3; ++i) test_world().barrier();
  test_world().synchronize();
}

TEST(Collectives, ZeroRowsEverywhereIsAValidAllToAll) {
  Communicator& comm = test_world();
  std::vector<int64_t> none(size_t(comm.size()), 0);
  Tensor send = Tensor::empty({0, 6}, DType::bf16);
  Tensor got = comm.all_to_all(send, none, none);
  EXPECT_EQ(got.shape(), Shape({0, 6}));
  Tensor gathered = comm.all_gather(Tensor::empty({0, 3}, DType::f32));
  EXPECT_EQ(gathered.shape(), Shape({0, 3}));
}

TEST(Collectives, BadArgumentsThrowTypedErrorsOnEveryRank) {
  Communicator& comm = test_world();
  const int64_t n = comm.size();
  std::vector<int64_t> ones(size_t(n), 1);
  Tensor send = Tensor::zeros({n, 4}, DType::f32);
  Tensor recv = Tensor::zeros({n, 4}, DType::f32);
  std::vector<int64_t> short_counts(size_t(n) + 1, 0);
  EXPECT_TRUE(throws_naming<ShapeError>([&] { comm.all_to_all(send, short_counts, recv, ones); }, {"send_rows has"}));
  std::vector<int64_t> negative = ones;
  negative[0] = -1;
  EXPECT_TRUE(throws_naming<ShapeError>([&] { comm.all_to_all(send, negative, recv, ones); }, {"negative"}));
  std::vector<int64_t> too_many = ones;
  too_many[0] = 2;
  EXPECT_TRUE(throws_naming<ShapeError>([&] { comm.all_to_all(send, too_many, recv, ones); }, {"add up to"}));
  Tensor wide = Tensor::zeros({n, 5}, DType::f32);
  EXPECT_TRUE(throws_naming<ShapeError>([&] { comm.all_to_all(send, ones, wide, ones); }, {"differ"}));
  Tensor ints = Tensor::zeros({n, 4}, DType::i32);
  EXPECT_TRUE(throws_naming<DTypeError>([&] { comm.all_to_all(send, ones, ints, ones); }, {"dtype mismatch"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { comm.all_to_all(send, ones, send, ones); }, {"share storage"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { comm.all_to_all(Tensor::zeros({}, DType::f32), ones, recv, ones); },
                                        {"at least one dim"}));
  EXPECT_TRUE(throws_naming<DTypeError>([&] { comm.all_reduce(Tensor::zeros({4}, DType::bf16), ReduceOp::sum); },
                                        {"all_reduce"}));
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] {
        comm.all_reduce(Tensor::zeros({3, 4}, DType::f32).transpose(0, 1), ReduceOp::sum);
      },
      {"contiguous"}));
  Tensor too_tall = Tensor::zeros({n * n + 1, 4}, DType::f32);
  EXPECT_TRUE(throws_naming<ShapeError>([&] { comm.all_gather(send, too_tall); }, {"should be"}));
  EXPECT_TRUE(throws_naming<CommError>([&] { comm.broadcast(send, int(n)); }, {"not a rank"}));
  Tensor flat = Tensor::zeros({2 * n}, DType::f32);
  EXPECT_TRUE(throws_naming<ShapeError>([&] { comm.reduce_scatter_in_place(send, ReduceOp::sum); }, {"1-D"}));
  if (n > 1) {
    EXPECT_TRUE(throws_naming<ShapeError>([&] { comm.all_gather_in_place(Tensor::zeros({2 * n + 1}, DType::f32)); },
                                          {"segments of equal size"}));
  }
  EXPECT_TRUE(throws_naming<DTypeError>(
      [&] { comm.reduce_scatter_in_place(Tensor::zeros({2 * n}, DType::i32), ReduceOp::sum); },
      {"reduce_scatter_in_place"}));
  EXPECT_TRUE(throws_naming<CommError>([&] { comm.reduce_scatter_in_place(flat, ReduceOp::max); }, {"not max"}));
  EXPECT_TRUE(throws_naming<CommError>([&] { comm.split(-1, 0); }, {"color"}));
  // FP8 scales that are not rowwise cannot travel with their rows.
  Tensor fp8 = Tensor::zeros({n, 128}, DType::e4m3);
  Tensor colwise = fp8.with_scales(Tensor::zeros({1, n}, DType::f32), ScalingMode::colwise_1x128);
  EXPECT_TRUE(throws_naming<DTypeError>([&] { comm.all_to_all(colwise, ones, ones); }, {"colwise_1x128"}));
  comm.barrier();  // every rank got here without a collective running: nothing is left pending
}

TEST(Collectives, AllToAllChunksBadArgumentsThrowTypedErrorsOnEveryRank) {
  using Chunks = std::vector<Communicator::RowChunk>;
  Communicator& comm = test_world();
  const int me = comm.rank(), n = comm.size();
  Tensor send = Tensor::zeros({4, 2}, DType::f32);
  Tensor recv = Tensor::zeros({4, 2}, DType::f32);
  auto chunks = [&](const Chunks& s, const Chunks& r, const Tensor& to = Tensor()) {
    return [&comm, &send, &recv, s, r, to] { comm.all_to_all_chunks(send, s, to.defined() ? to : recv, r); };
  };
  EXPECT_TRUE(throws_naming<ShapeError>(chunks({{me, 3, 2}}, {{me, 0, 2}}), {"send_chunks[0]", "past the end"}));
  EXPECT_TRUE(throws_naming<ShapeError>(chunks({}, {{me, 2, 3}}), {"recv_chunks[0]", "past the end"}));
  EXPECT_TRUE(throws_naming<ShapeError>(chunks({{me, -1, 1}}, {}), {"send_chunks[0]", "negative"}));
  EXPECT_TRUE(throws_naming<ShapeError>(chunks({}, {{0, 0, 2}, {0, 3, 1}, {0, 1, 2}}),
                                        {"recv_chunks[2] = rows [1, 3)", "recv_chunks[0] = rows [0, 2)", "overlap"}));
  EXPECT_TRUE(throws_naming<CommError>(chunks({{n, 0, 1}}, {}), {"send_chunks[0].peer", "not a rank"}));
  EXPECT_TRUE(throws_naming<CommError>(chunks({}, {{-1, 0, 1}}), {"recv_chunks[0].peer", "not a rank"}));
  EXPECT_TRUE(throws_naming<DTypeError>(chunks({}, {}, Tensor::zeros({4, 2}, DType::i32)), {"dtype mismatch"}));
  EXPECT_TRUE(throws_naming<ShapeError>(chunks({}, {}, Tensor::zeros({4, 3}, DType::f32)), {"differ"}));
  EXPECT_TRUE(throws_naming<ShapeError>(chunks({}, {}, send), {"share storage"}));
  EXPECT_TRUE(throws_naming<ShapeError>(chunks({{me, 0, 2}}, {{me, 0, 1}}),
                                        {"sends itself chunks of 2 rows", "receives from itself chunks of 1 rows"}));
  comm.barrier();  // every rank got here without a collective running: nothing is left pending
}

TEST(Collectives, PutRowsBadArgumentsThrowTypedErrorsOnEveryRank) {
  Communicator& comm = test_world();
  const int n = comm.size();
  const Tensor table = Tensor::zeros({n, 1, 3}, DType::i32);
  const Tensor send = Tensor::zeros({4, 2}, DType::f32), recv = Tensor::zeros({6, 2}, DType::f32);
  auto put = [&](const std::vector<Communicator::RowPut>& tensors, const Communicator::PadSegments& pad) {
    return [&comm, tensors, table, pad] { comm.put_rows(tensors, table, table, pad); };
  };
  EXPECT_TRUE(throws_naming<ShapeError>(put({}, {}), {"no tensors"}));
  EXPECT_TRUE(throws_naming<ShapeError>(
      put({{send, recv, 0.0}, {Tensor::zeros({3}, DType::i32), Tensor::zeros({6}, DType::i32), 0.0}}, {}),
      {"move along one table", "different rows"}));
  EXPECT_TRUE(throws_naming<ShapeError>(put({{send, Tensor::zeros({6, 3}, DType::f32), 0.0}}, {}), {"differ"}));
  EXPECT_TRUE(throws_naming<ShapeError>(
      put({{send, recv, 0.0}}, {Tensor::zeros({2}, DType::i32), Tensor::zeros({2}, DType::i32), Tensor()}),
      {"pad starts", "[S+1] and [S]"}));
  EXPECT_TRUE(throws_naming<ShapeError>(put({{send, recv, 0.0}}, {Tensor(), Tensor(), Tensor::zeros({2}, DType::i32)}),
                                        {"overflow", "[1] i32"}));
  EXPECT_TRUE(throws_naming<ShapeError>(put({{send, send, 0.0}}, {}), {"share storage"}));
  comm.barrier();  // every rank got here without a collective running: nothing is left pending
}

// CUDA tensors through the world communicator: copies at world size 1, host staging under mpi.
TEST(CollectivesCuda, GpuTensorsThroughTheWorldCommunicator) {
  FLOWMOE_REQUIRE_CUDA();
  Communicator& comm = test_world();
  check_all_to_all_cases(comm, rank_gpu(comm));
  check_all_to_all_chunks_cases(comm, rank_gpu(comm), DType::f32, {3});
  check_all_to_all_chunks_cases(comm, rank_gpu(comm), DType::e4m3, {128});
  check_put_rows_cases(comm, rank_gpu(comm));
  check_all_reduce_cases(comm, rank_gpu(comm));
  check_all_gather_and_broadcast(comm, rank_gpu(comm));
  check_sharded_halves(comm, rank_gpu(comm));
}

// nccl bootstrapped through the world: at world size 1 (the none backend hands the unique id over),
// or one GPU per rank under mpirun.
TEST(CollectivesCuda, NcclCommunicator) {
  if (!built_with_nccl()) GTEST_SKIP() << "built without NCCL: nccl test skipped";
  FLOWMOE_REQUIRE_CUDA();
  Communicator& world = test_world();
  if (cuda_device_count() < world.size())
    GTEST_SKIP() << "nccl needs one GPU per rank: " << world.size() << " ranks, " << cuda_device_count() << " GPUs";
  std::shared_ptr<Communicator> nccl = make_nccl_communicator(test_runtime().world, world.rank());
  EXPECT_STREQ(nccl->backend_name(), "nccl");
  EXPECT_EQ(nccl->rank(), world.rank());
  EXPECT_EQ(nccl->size(), world.size());
  const Device gpu = Device::cuda(world.rank());
  check_all_to_all_cases(*nccl, gpu);
  check_all_to_all_chunks_cases(*nccl, gpu, DType::f32, {3});
  check_all_to_all_chunks_cases(*nccl, gpu, DType::e4m3, {128});
  check_put_rows_cases(*nccl, gpu);  // on GPUs that reach each other: the device put
  // The exchanges were timed on the GPU by events; taking the time releases them and restarts the sum.
  EXPECT_GT(nccl->take_exchange_ms(), 0.0);
  EXPECT_EQ(nccl->take_exchange_ms(), 0.0);
  check_exchange_windows(*nccl, gpu);
  EXPECT_EQ(&nccl->host_communicator(), &nccl->host_communicator());
  EXPECT_TRUE(nccl->host_communicator().native_device().is_cpu());  // host values go through mpi
  check_all_reduce_cases(*nccl, gpu);
  check_all_gather_and_broadcast(*nccl, gpu);
  check_sharded_halves(*nccl, gpu);
  std::shared_ptr<Communicator> half = nccl->split(world.rank() % 2, world.rank());
  EXPECT_EQ(half->size(), (world.size() + 1 - world.rank() % 2) / 2);
  check_all_reduce_cases(*half, gpu);
  nccl->barrier();
  // A CPU tensor is refused: nccl moves GPU tensors of its own device.
  EXPECT_TRUE(throws_naming<DeviceError>([&] { nccl->all_reduce(Tensor::zeros({2}, DType::f32), ReduceOp::sum); },
                                         {"nccl all_reduce", "cpu"}));
}

TEST(Collectives, MissingBackendsSayWhatToInstall) {
  if (!built_with_mpi()) {
    EXPECT_TRUE(throws_naming<CommError>([] { make_mpi_world_communicator(); },
                                         {"built without MPI", "install libopenmpi-dev"}));
  }
  if (!built_with_nccl()) {
    EXPECT_TRUE(
        throws_naming<CommError>([] { make_nccl_communicator(make_none_communicator(), 0); }, {"built without NCCL"}));
  }
  if (built_with_mpi() && built_with_nccl()) GTEST_SKIP() << "this build has every backend";
}

}  // namespace
}  // namespace flowmoe::test
