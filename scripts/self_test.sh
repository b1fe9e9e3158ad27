# The self-tests of the checking scripts (check_docs.sh, check_includes.sh --self-test), sourced by them:
# `expect NAME STATUS PATTERN` runs "$check" --root "$tmp" and says ok when it exits STATUS and prints PATTERN,
# else FAIL with its output; `failures` counts the FAILs.
failures=0
expect() {
  local out status=0
  out="$(timeout 20 "$check" --root "$tmp" 2>&1)" || status=$?
  if [[ $status -eq $2 ]] && grep -qF -- "$3" <<<"$out"; then
    echo "ok   $1"
  else
    echo "FAIL $1: exit $status, expected $2 and '$3' in:"
    echo "$out"
    failures=$((failures + 1))
  fi
}
