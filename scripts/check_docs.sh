#!/usr/bin/env bash
# Checks that the docs cite only files that exist: every repository path or file name that README.md and
# docs/*.md cite in backticks or links, and every path that a comment in the sources cites, must be in the tree.
#   scripts/check_docs.sh               check this repository
#   scripts/check_docs.sh --root DIR    check the tree at DIR
#   scripts/check_docs.sh --self-test   show that a citation of a missing file fails (run by CTest)
# The rule, for each citation (in the docs a backticked word or a link target; in a comment a path that starts
# with a top-level folder, or a file name ending .h, .cpp, .cu, .cuh, .md, .sh, .py or .yaml):
#   - a URL, a placeholder (<op>, $VAR, ...), an option (--x) or a word with no file extension and no
#     top-level folder is not a path: skipped;
#   - braces expand (`config_schema.{h,cpp}` is two citations) and a * globs (it must match a file);
#   - a path starting with a top-level entry of the tree (`layers/moe.h`, `.ci/run`) must exist there;
#   - any other path or bare name (`moe.cpp`, `cuda/launch.cuh`) must end some file's path in the tree;
#   - a name in ALLOWED (below, each with its reason) is not a file of the tree and is fine.
# Each broken citation is printed as file:line: `citation`; the exit status is 1 when there is one.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

if [[ "${1:-}" == "--self-test" ]]; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  mkdir -p "$tmp/docs" "$tmp/layers" "$tmp/train"
  touch "$tmp/layers/moe.h" "$tmp/train/config_schema.h" "$tmp/train/config_schema.cpp"
  printf 'Read `layers/moe.h`, `moe.h`, `config_schema.{h,cpp}` and [the guide](docs/GUIDE.md); a run writes `metrics.jsonl`; see https://example.com/a.h.\n' >"$tmp/README.md"
  printf '# Guide\n\n`train/*.cpp` and `build/flowmoe`\n' >"$tmp/docs/GUIDE.md"
  printf '// The layer (docs/GUIDE.md).\n' >"$tmp/layers/moe.cpp"
  check="$0"
  source "$(dirname "$0")/self_test.sh"  # expect NAME STATUS PATTERN
  expect "citations of files that exist pass" 0 "check_docs: every citation"
  printf 'And `layers/config.h`.\n' >>"$tmp/docs/GUIDE.md"
  expect "a doc citing a missing file fails" 1 "docs/GUIDE.md:4: \`layers/config.h\`"
  printf 'See `train/run.{h,cpp}`.\n' >"$tmp/docs/GUIDE.md"
  expect "a brace form with a missing file fails" 1 "\`train/run.h\`"
  printf '# Guide\n' >"$tmp/docs/GUIDE.md"
  printf '// The layer (docs/MISSING.md).\n' >"$tmp/layers/moe.cpp"
  expect "a comment citing a missing doc fails" 1 "layers/moe.cpp:1: \`docs/MISSING.md\`"
  printf '// The layer (its header: moe_layer.h).\n' >"$tmp/layers/moe.cpp"
  expect "a comment citing a missing bare name fails" 1 "layers/moe.cpp:1: \`moe_layer.h\`"
  printf '// The layer (moe.h).\n' >"$tmp/layers/moe.cpp"
  printf 'See `gone.cpp`.\n' >"$tmp/docs/GUIDE.md"
  expect "a bare name found nowhere fails" 1 "\`gone.cpp\`"
  exit $((failures > 0))
fi
if [[ "${1:-}" == "--root" ]]; then
  root="$(cd "${2:?--root needs a directory}" && pwd)"
fi

exec python3 - "$root" <<'PY'
import glob, os, re, subprocess, sys

root = sys.argv[1]
os.chdir(root)

# Names that docs cite which are not files of the tree, each with why.
ALLOWED = {
    "metrics.jsonl": "a run writes it (docs/TRAINING.md, Outputs)",
    "metrics.csv": "a run writes it",
    "model.safetensors": "a checkpoint file a run writes",
    "optimizer.safetensors": "a checkpoint file a run writes",
    "meta.json": "a checkpoint file a run writes",
    "config.yaml": "the resolved config a run writes beside its metrics",
    "config.json": "a Hugging Face folder's file, written by export",
    "tokenizer.json": "a Hugging Face folder's file, written by export",
    "model.safetensors.index.json": "a Hugging Face folder's shard index",
    "mtp.safetensors": "a Hugging Face folder's file of the MTP layers, written by export",
    "loss.png": "the plot a run or `flowmoe plot` writes",
    "parity.json": "the report `flowmoe parity` writes",
    "parity.png": "the plot `flowmoe parity` writes",
    "fp8_error.json": "the report `flowmoe fp8-error` writes",
    "STOP": "the stop file a user creates in a run's folder",
    "tokens.bin": "the token file `prepare-data` writes",
    "train.bin": "a token file `prepare-data` writes",
    "val.bin": "a token file `prepare-data` writes",
    "tokenizer.bpe": "the tokenizer `prepare-data` writes",
    "tokenizer_config.json": "a Hugging Face folder's file, written by export",
    "cuda_runtime_api.h": "the CUDA toolkit's header",
    "nccl.h": "NCCL's header",
    "nccl_device.h": "NCCL's device API header",
    "GroupMMCommon.cuh": "a PyTorch source file that bench/torch_peer.py's comment names",
    "a.h": "not a file: layers/transformer.h's comment on the member h of a value a",
    "profile.txt": "the table `flowmoe train --profile N` writes",
}
# Whole citations that are examples or build outputs, not files of the tree, each with why.
ALLOWED_CITATIONS = {
    "a.txt": "docs/TRAINING.md's example of the order prepare-data reads a folder in",
    "a/b.txt": "the same example",
    "b.txt": "the same example",
    "configs/x.yaml": "an example file name in an error message's format",
    "scripts/mutants/NN-name.patch": "the pattern of a mutant's file name",
    "bench/bench_dispatch": "the benchmark program built from bench/bench_dispatch.cpp",
    "tests/mpi/test_comm": "the test program built from tests/mpi/*.cpp",
}
# Path prefixes that name outputs or installed files, not tracked sources.
ALLOWED_PREFIXES = {
    "build/": "the build tree (`build/flowmoe`, `build/test_*`)",
    "build-cpu/": "a CPU-only build tree",
    "build-mutants/": "scripts/mutants.sh's scratch copy",
    ".deps/": "what the install scripts put there (CUTLASS, Python packages)",
    "runs/": "run folders a user's runs write",
    "out/": "output folders",
    "checkpoints/": "a run's checkpoint folder",
    "data/": "prepared data a user writes",
    "/": "an absolute path on the user's machine (/usr/local/cuda, /tmp/...)",
    "~/": "a path in the user's home",
}
EXTENSIONS = ("h|cpp|cu|cuh|hpp|md|sh|py|yaml|yml|txt|json|jsonl|csv|png|safetensors|bin|cmake|patch|diff")
FILE_RE = re.compile(r"^[\w.*{},/~-]+\.(%s)$" % EXTENSIONS)

# The tree: git's files (tracked, and new ones not ignored) in a work tree, so that a build folder's files do not
# count; every file below the root elsewhere (the self-test's tree).
git = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                     capture_output=True, text=True)
if git.returncode == 0 and os.path.exists(".git"):
    listed = git.stdout.split("\0")
else:
    listed = [os.path.relpath(os.path.join(d, f)) for d, _, fs in os.walk(".") for f in fs]
files = sorted({f for f in listed if f and os.path.exists(f)})
dirs = {os.path.dirname(f) for f in files}
dirs |= {d[: i] for d in list(dirs) for i in range(len(d)) if d[i] == "/"}
top = {p.split("/")[0] for p in files}
COMMENT_NAME_RE = re.compile(r"(?<![\w./<>*{},-])([\w-]+\.(?:h|cpp|cu|cuh|md|sh|py|yaml))\b(?![\w/-])")
COMMENT_PATH_RE = re.compile(r"(?<![\w./-])((?:%s)/[\w.*{},/<>-]*[\w*}>])" % "|".join(
    re.escape(t) for t in sorted(top) if os.path.isdir(t) and not t.startswith(".")))


def expand(word):
    m = re.search(r"\{([^{}]*)\}", word)
    if not m:
        return [word]
    return [x for alt in m.group(1).split(",") for x in expand(word[: m.start()] + alt + word[m.end():])]


def exists(path):
    path = path.rstrip("/")
    if any(path == a.rstrip("/") or path.startswith(a) for a in ALLOWED_PREFIXES):
        return True
    if os.path.basename(path) in ALLOWED or path in ALLOWED_CITATIONS:
        return True
    if "*" in path:
        pattern = re.compile("^" + re.escape(path).replace(r"\*", "[^/]*") + "$")
        suffix = re.compile("(^|/)" + re.escape(path).replace(r"\*", "[^/]*") + "$")
        anchored = path.split("/")[0] in top
        return any((pattern if anchored else suffix).search(f) for f in files)
    if path.split("/")[0] in top:
        return path in files or path in dirs
    return any(f == path or f.endswith("/" + path) for f in files) or any(
        d == path or d.endswith("/" + path) for d in dirs)


def is_path(word):
    if not word or "://" in word or word.startswith(("-", "$", "http")) or re.search(r"[<>$=@:\"'()\[\]|]", word):
        return False
    if "..." in word or word in (".", ".."):
        return False
    # An upper-case folder is a placeholder the reader fills in (OUT/noise.md, DIR/x).
    if re.search(r"(^|/)[A-Z][A-Z_]*/", word):
        return False
    if FILE_RE.match(word):
        return True
    first = word.split("/")[0]
    return "/" in word and (first in top or first + "/" in ALLOWED_PREFIXES)


def words_of_markdown(text):
    """(line, word) for each whitespace-separated word of a backtick span or a link target."""
    for n, line in enumerate(text.splitlines(), 1):
        for span in re.findall(r"`([^`]+)`", line):
            for w in span.split():
                yield n, w
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            yield n, target.split("#")[0]


def words_of_source(text):
    """(line, word) for each path starting with a top-level folder, and each file name of a source or doc, in a
    comment (// or # lines)."""
    for n, line in enumerate(text.splitlines(), 1):
        m = re.search(r"(//|^\s*#(?!include|pragma|define|if|endif|else|undef))(.*)", line)
        if m:
            for w in COMMENT_PATH_RE.findall(m.group(2)) + COMMENT_NAME_RE.findall(m.group(2)):
                yield n, w


broken, checked = [], 0
docs = ["README.md"] + sorted(glob.glob("docs/*.md"))
# This script is left out: its self-test cites missing files on purpose.
sources = [f for f in files if re.search(r"(\.(h|cpp|cu|cuh|sh|py)|CMakeLists\.txt)$", f)
           and f != "scripts/check_docs.sh"]
for name, reader in [(d, words_of_markdown) for d in docs if os.path.exists(d)] + [
        (s, words_of_source) for s in sources]:
    with open(name, encoding="utf-8", errors="replace") as f:
        text = f.read()
    base = os.path.dirname(name)
    for n, word in reader(text):
        word = word.strip(".,;:").rstrip(")")
        if not is_path(word):
            continue
        for path in expand(word):
            checked += 1
            # A link in docs/ is relative to its page: figures/x.png is docs/figures/x.png.
            if exists(path) or (base and reader is words_of_markdown and os.path.exists(os.path.join(base, path))):
                continue
            broken.append(f"{name}:{n}: `{path}`")

if broken:
    print("check_docs: citations of files that are not in the tree:")
    print("\n".join("  " + b for b in broken))
    sys.exit(1)
print(f"check_docs: every citation ({checked}) in {len(docs)} docs and {len(sources)} sources names a file of the tree")
PY
