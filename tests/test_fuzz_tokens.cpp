// Seeded random damage to token files: header fields (magic, version, token count) changed, the
// file cut short or extended, random bytes overwritten. read_token_file must return exactly the
// tokens of a file that is still well formed and throw IoError naming the file for every other,
// never crash, throw another type, or allocate more than the file could hold (a single allocation
// over 64 MiB fails here, and the largest one is compared with the file size). FLOWMOE_FUZZ_CASES
// sets the number of cases (default 3000) and FLOWMOE_TEST_SEED the seed (default fixed).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <new>
#include <random>
#include <string>
#include <typeinfo>
#include <vector>

#include "dataset/data.h"
#include "kernels/common/error.h"
#include "tests/support/checks.h"

using namespace flowmoe;
namespace fs = std::filesystem;

// ---- allocation watch: this test binary's operator new ---------------------------------------------

namespace {
constexpr size_t kAllocationCap = size_t(64) << 20;
std::atomic<bool> g_watching{false};
std::atomic<size_t> g_largest{0};

void* watched_alloc(size_t n) {
  if (g_watching.load(std::memory_order_relaxed)) {
    if (n > kAllocationCap) throw std::bad_alloc();
    size_t prev = g_largest.load(std::memory_order_relaxed);
    while (n > prev && !g_largest.compare_exchange_weak(prev, n)) {
    }
  }
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
}  // namespace

void* operator new(size_t n) { return watched_alloc(n); }
void* operator new[](size_t n) { return watched_alloc(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }

namespace {

constexpr uint64_t kDefaultSeed = 20240520;
constexpr int64_t kDefaultCases = 3000;
constexpr size_t kHeaderBytes = 1024;

struct Damaged {
  std::string bytes;
  std::vector<std::string> damage;  // what was done, for the report
};

class Damager {
 public:
  explicit Damager(uint64_t seed) : rng_(seed) {}
  size_t pick(size_t n) { return n ? size_t(rng_() % n) : 0; }
  bool chance(double p) { return double(rng_() % 1000000) < p * 1e6; }

  // A well-formed file of a random number of tokens.
  std::string valid_file() {
    std::vector<uint16_t> tokens(pick(chance(0.1) ? 5 : 3000));
    for (auto& t : tokens) t = uint16_t(rng_());
    std::string b(kHeaderBytes + 2 * tokens.size(), '\0');
    const int32_t header[3] = {kTokenFileMagic, kTokenFileVersion, int32_t(tokens.size())};
    std::memcpy(b.data(), header, sizeof header);
    if (!tokens.empty()) std::memcpy(b.data() + kHeaderBytes, tokens.data(), 2 * tokens.size());
    return b;
  }

  void damage(Damaged& d) {
    std::string& b = d.bytes;
    switch (pick(6)) {
      case 0:
      case 1: {  // a header field
        const size_t field = pick(3);
        const int64_t count = b.size() >= 12 ? read_int(b, 8) : 0;
        auto wrap = [](int64_t v) { return int32_t(v); };  // modular, as the field would hold it
        const int32_t values[] = {0,
                                  -1,
                                  1,
                                  2,
                                  INT32_MIN,
                                  INT32_MAX,
                                  wrap(count + 1),
                                  wrap(count - 1),
                                  wrap(count + 1 + int64_t(pick(8))),
                                  wrap(count - 1 - int64_t(pick(8))),
                                  int32_t(rng_()),
                                  kTokenFileMagic,
                                  kTokenFileVersion};
        const int32_t v = values[pick(std::size(values))];
        d.damage.push_back(std::string(field == 0   ? "magic"
                                       : field == 1 ? "version"
                                                    : "count") +
                           "=" + std::to_string(v));
        if (b.size() >= 4 * field + 4) std::memcpy(b.data() + 4 * field, &v, 4);
        break;
      }
      case 2: {
        const size_t to = pick(b.size() + 1);
        d.damage.push_back("truncate to " + std::to_string(to));
        b.resize(to);
        break;
      }
      case 3: {
        const size_t extra = chance(0.5) ? 1 + pick(3) : 1 + pick(3000);
        d.damage.push_back("extend by " + std::to_string(extra));
        for (size_t i = 0; i < extra; ++i) b += char(rng_());
        break;
      }
      case 4: {
        const size_t n = 1 + pick(16);
        d.damage.push_back("overwrite " + std::to_string(n) + " random bytes");
        for (size_t i = 0; i < n && !b.empty(); ++i) b[pick(b.size())] = char(rng_());
        break;
      }
      default: {  // bytes anywhere in the header
        const size_t n = 1 + pick(4);
        d.damage.push_back("overwrite " + std::to_string(n) + " header bytes");
        for (size_t i = 0; i < n && !b.empty(); ++i) b[pick(std::min(b.size(), kHeaderBytes))] = char(rng_());
        break;
      }
    }
  }

  static int32_t read_int(const std::string& b, size_t at) {
    int32_t v = 0;
    std::memcpy(&v, b.data() + at, 4);
    return v;
  }

 private:
  std::mt19937_64 rng_;
};

// Whether the file is one read_token_file must accept: the format, exactly.
bool well_formed(const std::string& b) {
  if (b.size() < kHeaderBytes) return false;
  const int32_t magic = Damager::read_int(b, 0), version = Damager::read_int(b, 4), count = Damager::read_int(b, 8);
  return magic == kTokenFileMagic && version == kTokenFileVersion && count >= 0 &&
         b.size() == kHeaderBytes + 2 * size_t(count);
}

std::vector<uint16_t> body_tokens(const std::string& b) {
  std::vector<uint16_t> t((b.size() - kHeaderBytes) / 2);
  if (!t.empty()) std::memcpy(t.data(), b.data() + kHeaderBytes, 2 * t.size());
  return t;
}

std::string describe(int64_t i, uint64_t seed, const Damaged& d) {
  std::string s = "case " + std::to_string(i) + " (seed " + std::to_string(seed) + "), " +
                  std::to_string(d.bytes.size()) + " bytes:";
  for (const auto& x : d.damage) s += " " + x + ";";
  return s;
}

}  // namespace

TEST(FuzzTokens, DamagedTokenFilesLoadExactlyOrThrowIoError) {
  const test::FuzzPlan plan = test::fuzz_plan(kDefaultSeed, kDefaultCases);
  const uint64_t seed = plan.seed;
  const int64_t cases = plan.num_cases;
  const fs::path dir = fs::temp_directory_path() / ("flowmoe_fuzz_tokens_" + std::to_string(seed));
  fs::create_directories(dir);

  Damager rng(seed);
  int64_t loaded = 0, failures = 0;
  for (int64_t i = 0; i < cases && failures < 10; ++i) {
    Damaged d{rng.valid_file(), {}};
    for (size_t k = rng.chance(0.1) ? 0 : 1 + rng.pick(3); k > 0; --k) rng.damage(d);
    // A new file each time: rewriting one in place makes some filesystems flush it on every close.
    const std::string path = (dir / ("case_" + std::to_string(i) + ".bin")).string();
    std::ofstream(path, std::ios::binary) << d.bytes;
    const bool valid = well_formed(d.bytes);

    std::string problem;
    std::vector<uint16_t> tokens;
    g_largest = 0;
    g_watching = true;
    try {
      tokens = read_token_file(path);
      g_watching = false;
      ++loaded;
      if (!valid)
        problem = "accepted a malformed file";
      else if (tokens != body_tokens(d.bytes))
        problem = "returned other tokens than the file holds";
    } catch (const IoError& e) {
      g_watching = false;
      if (valid)
        problem = std::string("refused a well-formed file: ") + e.what();
      else if (std::string(e.what()).find(path) == std::string::npos)
        problem = std::string("the error does not name the file: ") + e.what();
    } catch (const std::exception& e) {
      g_watching = false;
      problem = std::string("threw a ") + typeid(e).name() + ", not an IoError: " + e.what();
    }
    // The tokens, an 8 KiB stream buffer and a few strings: nothing near a damaged header's count.
    if (problem.empty() && g_largest > d.bytes.size() + 65536)
      problem =
          "allocated " + std::to_string(g_largest) + " bytes at once for a file of " + std::to_string(d.bytes.size());
    if (!problem.empty()) {
      ++failures;
      ADD_FAILURE() << describe(i, seed, d) << "\n" << problem;
    }
    fs::remove(path);
  }
  std::printf("[fuzz] %lld of %lld files loaded\n", (long long)loaded, (long long)cases);
  EXPECT_GT(loaded, cases / 50) << "too few well-formed files: the damage no longer leaves any intact";
  EXPECT_LT(loaded, cases - cases / 4) << "too few damaged files";
  fs::remove_all(dir);
}

// Paths that are not token files at all.
TEST(FuzzTokens, NonFilesAreIoErrors) {
  const fs::path dir = fs::temp_directory_path() / ("flowmoe_fuzz_tokens_paths_" + std::to_string(test::test_seed()));
  fs::create_directories(dir);
  std::vector<std::string> paths = {dir.string(), (dir / "missing.bin").string(), ""};
  if (fs::exists("/dev/null")) paths.push_back("/dev/null");
  for (const std::string& p : paths)
    EXPECT_TRUE(test::throws_naming<IoError>([&] { read_token_file(p); }, {"token file", p.c_str()}))
        << "'" << p << "'";
  fs::remove_all(dir);
}
