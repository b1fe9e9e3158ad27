#!/usr/bin/env bash
# ensure_pip TAG WHY: installs python3-pip with apt-get where `python3 -m pip` does not run, saying so as
# "[TAG] installing python3-pip (WHY)". Sourced by the scripts that fetch pinned PyPI wheels
# (install_cutlass.sh, install_cudnn.sh) when they run on their own; install_deps.sh installs it first.
ensure_pip() {
  python3 -m pip --version >/dev/null 2>&1 && return 0
  echo "[$1] installing python3-pip ($2)"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends python3-pip
}
