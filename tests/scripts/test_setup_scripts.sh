#!/usr/bin/env bash
# The set-up scripts' decisions, with stand-ins for nvcc, nvidia-smi, dpkg, apt-get and sudo first on PATH:
# scripts/quickstart.sh builds CUDA only with nvcc AND a GPU (QUICKSTART_DRY_RUN=1 stops after saying so),
# scripts/install_deps.sh keeps apt's output in a log unless apt fails, and calls the wheel installers (stand-ins
# here: no case reaches the network) where nvcc runs. Registered in CMakeLists.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
fake="$(mktemp -d)"
trap 'rm -rf "$fake"' EXIT
failures=0
check() {  # check NAME OUTPUT GREP-PATTERN
  if grep -q -- "$3" <<<"$2"; then echo "ok   $1"; else echo "FAIL $1: no '$3' in:"; echo "$2"; failures=$((failures + 1)); fi
}
stand_in() {  # stand_in NAME BODY
  printf '#!/usr/bin/env bash\n%s\n' "$2" >"$fake/$1"
  chmod +x "$fake/$1"
}

stand_in nvcc 'exit 0'
stand_in nvidia-smi 'exit 9'  # the driver's tool without a GPU: it fails
out="$(PATH="$fake:$PATH" QUICKSTART_DRY_RUN=1 timeout 20 scripts/quickstart.sh 2>&1)"
check "nvcc without a GPU builds the CPU engine" "$out" "building the CPU engine: nvcc found but no GPU"
check "nvcc without a GPU configures FLOWMOE_CUDA=OFF" "$out" "DFLOWMOE_CUDA=OFF"

stand_in nvidia-smi 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"'
out="$(PATH="$fake:$PATH" QUICKSTART_DRY_RUN=1 timeout 20 scripts/quickstart.sh 2>&1)"
check "nvcc and a GPU build CUDA" "$out" "building with CUDA: nvcc and a GPU found"
check "nvcc and a GPU configure FLOWMOE_CUDA=ON" "$out" "DFLOWMOE_CUDA=ON"

out="$(PATH="$fake:$PATH" FLOWMOE_CUDA=OFF QUICKSTART_DRY_RUN=1 timeout 20 scripts/quickstart.sh 2>&1)"
check "FLOWMOE_CUDA decides when set" "$out" "DFLOWMOE_CUDA=OFF"

# install_deps.sh runs from a copy beside stand-ins for the wheel installers it calls where nvcc runs
# (install_cutlass.sh, install_cudnn.sh), so no case reaches the network, whatever CUDA this machine has.
mkdir "$fake/scripts"
cp scripts/install_deps.sh "$fake/scripts/"
printf '#!/usr/bin/env bash\necho "[cutlass] stand-in"\n' >"$fake/scripts/install_cutlass.sh"
printf '#!/usr/bin/env bash\necho "[cudnn] stand-in"\n' >"$fake/scripts/install_cudnn.sh"
chmod +x "$fake/scripts/"*.sh
install_deps="$fake/scripts/install_deps.sh"

# install_deps.sh with one package missing: apt's 300 lines stay in the log; a failing apt shows them.
stand_in dpkg '[ "${2:-}" = gnuplot-nox ] && exit 1; exit 0'
stand_in sudo 'exec "$@"'
stand_in apt-get 'for i in $(seq 300); do echo "apt line $i"; done; [ "${1:-}" != install ] || exit "${APT_STATUS:-0}"'
stand_in nvcc 'exit 1'
out="$(PATH="$fake:$PATH" TMPDIR="$fake" APT_STATUS=100 timeout 60 "$install_deps" 2>&1)"
status=$?
check "a failing apt-get shows its output" "$out" "apt line 300"
check "a failing apt-get is named" "$out" "apt-get failed"
[ "$status" -ne 0 ] && echo "ok   a failing apt-get fails the script" ||
  { echo "FAIL a failing apt-get exited 0"; failures=$((failures + 1)); }
out="$(PATH="$fake:$PATH" TMPDIR="$fake" APT_STATUS=0 timeout 60 "$install_deps" 2>&1 | grep -v '^\[cutlass\]\|^\[cudnn\]')"
check "apt's output goes to a log" "$out" "installing 1 Debian packages (gnuplot-nox); apt's output:"
if [ "$(wc -l <<<"$out")" -le 2 ]; then echo "ok   a successful apt-get prints no apt lines"; else
  echo "FAIL a successful apt-get printed:"; echo "$out"; failures=$((failures + 1)); fi
# Where nvcc runs, the CUTLASS headers and cuDNN are installed after the Debian packages.
stand_in nvcc 'exit 0'
out="$(PATH="$fake:$PATH" TMPDIR="$fake" APT_STATUS=0 timeout 60 "$install_deps" 2>&1)"
check "nvcc installs the CUTLASS headers" "$out" "\[cutlass\] stand-in"
check "nvcc installs cuDNN" "$out" "\[cudnn\] stand-in"
[ "$failures" -eq 0 ] || { echo "$failures failed"; exit 1; }
