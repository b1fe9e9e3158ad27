// Runs the built `flowmoe` command as a user would, for the tests of its subcommands (each test target is
// compiled with FLOWMOE_BINARY_DIR, the build folder that holds it).
#pragma once
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "tests/support/train_fixtures.h"

namespace flowmoe::test {

struct Ran {
  int code = -1;  // the exit status; 124 when the timeout ended it
  std::string out, err;
};

// `flowmoe args...` in `dir` under a timeout of timeout_s, stdin from `stdin_file` (default /dev/null); its
// stdout and stderr are kept in dir/out.txt and dir/err.txt.
inline Ran run_flowmoe_command(const std::filesystem::path& dir, const std::vector<std::string>& args, int timeout_s,
                               const std::string& stdin_file = "") {
  std::string cmd =
      "cd '" + dir.string() + "' && timeout " + std::to_string(timeout_s) + " " + FLOWMOE_BINARY_DIR + "/flowmoe";
  for (const std::string& a : args) cmd += " '" + a + "'";
  cmd += " <'" + (stdin_file.empty() ? std::string("/dev/null") : stdin_file) + "' >out.txt 2>err.txt";
  const int status = std::system(cmd.c_str());
  Ran r;
  if (status != -1 && WIFEXITED(status)) r.code = WEXITSTATUS(status);
  r.out = read_bytes(dir / "out.txt");
  r.err = read_bytes(dir / "err.txt");
  return r;
}

}  // namespace flowmoe::test
