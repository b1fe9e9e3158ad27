// embedding: gradient check, identity-encoded rows (a wrong row names its id), bad ids, errors,
// and CUDA vs CPU (f32, bf16) bit for bit, forward and backward, plus the device-side trap.
#include <cstdio>
#include <cstdlib>

#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

struct EmbResult {
  Tensor out, d_weight;  // on the CPU
};

EmbResult run_embedding(const Tensor& weight, const Tensor& ids, const Tensor& d_out, Device device) {
  Variable w(weight.to(device), true);
  Variable out = embedding(w, ids.to(device));
  out.backward(d_out.to(device));
  return {out.data().to(Device::cpu()), w.grad().to(Device::cpu())};
}

// weight[v, h] = v * 1000 + h: every output element says which row and column it came from.
Tensor identity_weight(int64_t vocab, int64_t hidden, DType dtype) {
  std::vector<double> v(size_t(vocab * hidden));
  for (int64_t r = 0; r < vocab; ++r)
    for (int64_t h = 0; h < hidden; ++h) v[size_t(r * hidden + h)] = double(r * 1000 + h);
  return Tensor::from_doubles(v, {vocab, hidden}, dtype);
}

}  // namespace

TEST(Embedding, Gradcheck) {
  Rng rng(test_seed());
  Tensor w = random_tensor(rng, {6, 4}, DType::f64);
  Tensor ids = Tensor::from_ints({0, 5, 2, 5, 5, 1}, {2, 3});
  EXPECT_TRUE(gradcheck([](const std::vector<Variable>& v) { return embedding(v[0], v[1].data()); }, {w, ids}));
}

TEST(Embedding, RowsAndScatterAdd) {
  Tensor ids = Tensor::from_ints({3, 0, 3, 7, 3, 1}, {2, 3});
  Variable w(identity_weight(8, 5, DType::f64), true);
  Variable out = embedding(w, ids);
  ASSERT_EQ(out.shape(), (Shape{2, 3, 5}));
  std::vector<double> o = out.data().to_doubles();
  std::vector<int64_t> id = ids.to_ints();
  for (size_t i = 0; i < id.size(); ++i)
    for (size_t h = 0; h < 5; ++h)
      ASSERT_EQ(o[i * 5 + h], double(id[i] * 1000 + int64_t(h))) << "position " << i << " column " << h;
  // d_out[i, h] = (i + 1) * 100 + h: d_weight[v, h] sums the positions that hold v.
  std::vector<double> d(30);
  for (size_t i = 0; i < 6; ++i)
    for (size_t h = 0; h < 5; ++h) d[i * 5 + h] = double((i + 1) * 100 + h);
  out.backward(Tensor::from_doubles(d, {2, 3, 5}));
  std::vector<double> g = w.grad().to_doubles();
  for (int64_t v = 0; v < 8; ++v)
    for (int64_t h = 0; h < 5; ++h) {
      double want = 0;
      for (size_t i = 0; i < 6; ++i)
        if (id[i] == v) want += double((int64_t(i) + 1) * 100 + h);
      ASSERT_EQ(g[size_t(v * 5 + h)], want) << "vocab row " << v << " column " << h;
    }
}

TEST(Embedding, Shapes) {
  Variable w(Tensor::zeros({4, 3}, DType::f32));
  EXPECT_EQ(embedding(w, Tensor::from_ints({2}, {})).shape(), (Shape{3}));  // one id, no batch dims
  EXPECT_EQ(embedding(w, Tensor::zeros({0}, DType::i32)).shape(), (Shape{0, 3}));
  EXPECT_EQ(embedding(w, Tensor::zeros({2, 0, 5}, DType::i32)).shape(), (Shape{2, 0, 5, 3}));
  Variable wg(Tensor::full({4, 3}, 1.0, DType::f32), true);
  Variable out = embedding(wg, Tensor::zeros({0}, DType::i32));
  out.backward(Tensor::zeros({0, 3}, DType::f32));
  EXPECT_TRUE(bit_equal(wg.grad(), Tensor::zeros({4, 3}, DType::f32)));  // no ids: zero gradient
}

TEST(Embedding, BadIdNamesIdAndPosition) {
  Variable w(Tensor::zeros({10, 4}, DType::f32));
  for (int64_t bad : {10, -1, 1 << 30}) {
    try {
      embedding(w, Tensor::from_ints({1, 2, bad, 3}, {4}));
      ADD_FAILURE() << "id " << bad << " did not throw";
    } catch (const Error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find("id " + std::to_string(bad) + " at position 2"), std::string::npos) << msg;
      EXPECT_NE(msg.find("[0, 10)"), std::string::npos) << msg;
    }
  }
}

TEST(Embedding, Errors) {
  Variable w(Tensor::zeros({10, 4}, DType::f32));
  Tensor ids = Tensor::from_ints({1, 2}, {2});
  try {
    embedding(w, Tensor::from_ints({1, 2}, {2}, DType::i64));
    ADD_FAILURE() << "i64 ids did not throw";
  } catch (const DTypeError& e) {
    EXPECT_NE(std::string(e.what()).find("i64[2]"), std::string::npos) << e.what();
  }
  try {
    embedding(Variable(Tensor::zeros({10}, DType::f32)), ids);
    ADD_FAILURE() << "1-d weight did not throw";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("f32[10]"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("i32[2]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(embedding(Variable(Tensor::zeros({2, 3, 4}, DType::f32)), ids), ShapeError);
  EXPECT_THROW(embedding(Variable(Tensor::zeros({10, 4}, DType::bf16)), ids), DTypeError);  // bf16 is GPU-only
  // A gradient of another dtype than the weight names both.
  Variable wg(Tensor::zeros({10, 4}, DType::f32), true);
  Variable out = embedding(wg, ids);
  try {
    out.backward(Tensor::zeros({2, 4}, DType::f64));
    ADD_FAILURE() << "f64 gradient for an f32 weight did not throw";
  } catch (const DTypeError& e) {
    EXPECT_NE(std::string(e.what()).find("f64[2, 4]"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("f32"), std::string::npos) << e.what();
  }
}

// Forward is a copy and backward sums each id's rows in fp32 in ascending position order on both
// sides, so f32 matches bit for bit; bf16 matches the f32 reference on the same bf16 values, rounded
// once. Duplicate-heavy cases (small vocab, one hot id) exercise the sorted segment sums.
TEST(EmbeddingCuda, MatchesCpuBitwise) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  struct Case {
    int64_t vocab, hidden, num_ids;
    bool hot;  // most ids equal to 3
  };
  for (Case c : {Case{5, 1, 0, false}, Case{7, 7, 1, false}, Case{50, 129, 300, false}, Case{1000, 1000, 64, false},
                 Case{16, 33, 5000, true}, Case{3, 8, 70000, false}, Case{8192, 2048, 4096, false}}) {
    SCOPED_TRACE(::testing::Message() << "vocab " << c.vocab << " hidden " << c.hidden << " ids " << c.num_ids);
    Tensor ids = rng.randint({c.num_ids}, 0, c.vocab);
    if (c.hot) {
      std::vector<int64_t> v = ids.to_ints();
      for (size_t i = 0; i < v.size(); ++i)
        if (i % 10 != 0) v[i] = 3;
      ids = Tensor::from_ints(v, {c.num_ids});
    }
    Tensor w = random_tensor(rng, {c.vocab, c.hidden}), d_out = random_tensor(rng, {c.num_ids, c.hidden});
    EmbResult ref = run_embedding(w, ids, d_out, Device::cpu());
    EmbResult got = run_embedding(w, ids, d_out, Device::cuda());
    EXPECT_TRUE(bit_equal(got.out, ref.out));
    EXPECT_TRUE(bit_equal(got.d_weight, ref.d_weight));

    Tensor wb = w.to(DType::bf16), d_outb = d_out.to(DType::bf16);
    EmbResult ref_b = run_embedding(wb.to(DType::f32), ids, d_outb.to(DType::f32), Device::cpu());
    EmbResult got_b = run_embedding(wb, ids, d_outb, Device::cuda());
    EXPECT_TRUE(bit_equal(got_b.out, ref_b.out.to(DType::bf16)));
    EXPECT_TRUE(bit_equal(got_b.d_weight, ref_b.d_weight.to(DType::bf16)));
  }
}

TEST(EmbeddingCuda, IdsShapeAndIdentity) {
  FLOWMOE_REQUIRE_CUDA();
  Tensor ids = Tensor::from_ints({3, 0, 3, 7, 3, 1}, {2, 3});
  EmbResult got =
      run_embedding(identity_weight(8, 5, DType::f32), ids, Tensor::full({2, 3, 5}, 1.0, DType::f32), Device::cuda());
  ASSERT_EQ(got.out.shape(), (Shape{2, 3, 5}));
  EXPECT_TRUE(bit_equal(got.out, embedding(Variable(identity_weight(8, 5, DType::f32)), ids).data()));
  EXPECT_EQ(got.d_weight.to_doubles()[3 * 5], 3.0);  // id 3 occurs three times
}

TEST(EmbeddingCuda, Errors) {
  FLOWMOE_REQUIRE_CUDA();
  Variable w(Tensor::zeros({10, 4}, DType::f32, Device::cuda()));
  EXPECT_THROW(embedding(w, Tensor::from_ints({1}, {1})), DeviceError);  // ids on the CPU
  EXPECT_THROW(embedding(w, Tensor::from_ints({1}, {1}, DType::i64, Device::cuda())), DTypeError);
  EXPECT_THROW(embedding(Variable(Tensor::zeros({10, 4}, DType::f64, Device::cuda())),
                         Tensor::from_ints({1}, {1}, DType::i32, Device::cuda())),
               DTypeError);
}

// A bad id on the GPU prints and traps; the error surfaces at the next synchronisation as a
// CudaError, and the context is unusable afterwards, so this runs in a child process.
TEST(EmbeddingCudaDeathTest, BadIdTraps) {
  FLOWMOE_REQUIRE_CUDA();
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // re-executes the binary: a fresh CUDA context
  auto run_bad = [] {
    Tensor w = Tensor::zeros({10, 4}, DType::f32, Device::cuda());
    Tensor ids = Tensor::from_ints({1, 2, 10}, {3}, DType::i32, Device::cuda());
    Variable out;
    try {
      out = embedding(Variable(w), ids);
      cuda_synchronize(0);
    } catch (const CudaError& e) {
      std::fprintf(stderr, "caught: %s\n", e.what());
      std::_Exit(3);
    }
    std::_Exit(0);
  };
  EXPECT_EXIT(run_bad(), ::testing::ExitedWithCode(3), "caught");
}
