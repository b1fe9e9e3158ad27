// The safetensors format (checkpoint/safetensors.h) as its bytes: a small file of every dtype the writer knows,
// compared with the bytes the format gives it, written out here by hand; the same bytes read back. The round
// trip (tests/test_checkpoint.cpp) and Python's reader (ibid.) check the rest.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
#include "tests/support/train_fixtures.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

// A small file's bytes as the format spells them (safetensors.h), written out here by hand rather than taken
// from the writer's tables: the 8-byte little-endian header length (480), the JSON header with each dtype's name,
// shape and byte range, one space of padding to 8 bytes, the little-endian data. A writer and a reader that
// agreed on a wrong dtype name would still round-trip; here each meets the format itself.
TEST(Safetensors, EveryDtypeIsWrittenAndReadAsTheFormatSpellsIt) {
  const fs::path d = fresh_dir("ckpt_format_bytes");
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"BF16","shape":[1],"data_offsets":[8,10]},"c":{"dtype":"F64","shape":[1],"data_offsets":[10,18]},)"
      R"("d":{"dtype":"I32","shape":[1,1],"data_offsets":[18,22]},"e":{"dtype":"I64","shape":[1],"data_offsets":[22,30]},)"
      R"("f":{"dtype":"U8","shape":[2],"data_offsets":[30,32]},"g":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[32,33]},)"
      R"("h":{"dtype":"F8_E5M2","shape":[1],"data_offsets":[33,34]}})";
  ASSERT_EQ(header.size(), 479u);
  // 1.0f, -2.0f | bf16 1.0 | 0.5 | int32 -1 | int64 3 | u8 1, 2 | e4m3 1.0 | e5m2 1.0
  const std::vector<unsigned char> data = {0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0xc0, 0x80, 0x3f, 0x00, 0x00,
                                           0x00, 0x00, 0x00, 0x00, 0xe0, 0x3f, 0xff, 0xff, 0xff, 0xff, 0x03, 0x00,
                                           0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x02, 0x38, 0x3c};
  const std::string expected = std::string("\xe0\x01\0\0\0\0\0\0", 8) + header + " " +
                               std::string(reinterpret_cast<const char*>(data.data()), data.size());
  struct Entry {
    const char* name;
    DType dtype;
    Shape shape;
    size_t begin, end;  // its bytes in `data`
  };
  const std::vector<Entry> entries = {{"a", DType::f32, {2}, 0, 8},    {"b", DType::bf16, {1}, 8, 10},
                                      {"c", DType::f64, {1}, 10, 18},  {"d", DType::i32, {1, 1}, 18, 22},
                                      {"e", DType::i64, {1}, 22, 30},  {"f", DType::u8, {2}, 30, 32},
                                      {"g", DType::e4m3, {1}, 32, 33}, {"h", DType::e5m2, {1}, 33, 34}};
  std::vector<NamedTensor> ts;
  for (const Entry& e : entries) {
    Tensor t = Tensor::zeros(e.shape, e.dtype);
    ASSERT_EQ(t.nbytes(), e.end - e.begin) << e.name;
    std::memcpy(t.raw_data(), data.data() + e.begin, t.nbytes());
    ts.push_back({e.name, t});
  }
  const std::string written = (d / "written.safetensors").string();
  write_safetensors(written, ts, {{"format", "pt"}});
  EXPECT_EQ(read_bytes(written), expected);

  const std::string by_hand = (d / "by_hand.safetensors").string();
  std::ofstream(by_hand, std::ios::binary) << expected;
  std::map<std::string, std::string> meta;
  const std::vector<NamedTensor> back = read_safetensors(by_hand, &meta);
  EXPECT_EQ(meta, (std::map<std::string, std::string>{{"format", "pt"}}));
  ASSERT_EQ(back.size(), ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    SCOPED_TRACE(entries[i].name);
    EXPECT_EQ(back[i].name, entries[i].name);
    EXPECT_EQ(back[i].tensor.dtype(), entries[i].dtype);
    EXPECT_EQ(back[i].tensor.shape(), entries[i].shape);
    EXPECT_TRUE(bit_equal(back[i].tensor, ts[i].tensor));
  }
  EXPECT_EQ(back[0].tensor.to_doubles(), (std::vector<double>{1.0, -2.0}));
  EXPECT_EQ(back[1].tensor.to_doubles(), (std::vector<double>{1.0}));
  EXPECT_EQ(back[2].tensor.to_doubles(), (std::vector<double>{0.5}));
  EXPECT_EQ(back[3].tensor.to_doubles(), (std::vector<double>{-1.0}));
  EXPECT_EQ(back[4].tensor.to_doubles(), (std::vector<double>{3.0}));
  EXPECT_EQ(back[5].tensor.to_doubles(), (std::vector<double>{1.0, 2.0}));
  fs::remove_all(d);
}
