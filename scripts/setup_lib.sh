# Sourced by scripts/setup.sh and scripts/setup_mcore019.sh: what both venv builds share.

# quiet CMD...: runs a pip command with its output appended to $PIP_LOG (set by the caller), not
# the terminal: pip's resolver prints "ERROR: ... sglang requires <CUDA package>, which is not
# installed" for the CUDA kernels a CPU machine leaves out on purpose (requirements/sglang-cpu.txt),
# and a newcomer reads that as a failure. On a real failure the log's tail is printed.
quiet() {
  local rc=0 out
  out="$(mktemp)"
  "$@" >"$out" 2>&1 || rc=$?
  cat "$out" >>"$PIP_LOG"
  if (( rc != 0 )); then
    echo "[setup] this failed (exit $rc): $*" >&2
    grep -v -E "is ignored: it is neither|^$" "$out" | tail -n 30 >&2
    echo "[setup] pip's whole output: $PIP_LOG" >&2
  fi
  rm -f "$out"
  return "$rc"
}

# Python code run right after a build: the warnings megatron-core and torch print at import on a
# machine without CUDA, Transformer Engine and apex are expected there (the run prints what it
# resolved instead); silence them so the check prints one line.
QUIET_IMPORTS='import logging, warnings
warnings.filterwarnings("ignore", message=r".*(Apex is|Transformer Engine and Apex are) not installed")
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)'

# need_disk TAG VENV GIB: stops before pip starts when VENV's filesystem has less than GIB GiB free
# (GIB for a fresh build, 2 when VENV already exists and is only brought up to date). A full disk
# otherwise shows up minutes later as pip's "[Errno 28] No space left on device" and a half-built venv.
need_disk() {
  local tag="$1" venv="$2" need="$3" dir free
  [[ -x "$venv/bin/python" ]] && need=2
  dir="$venv"
  while [[ ! -d "$dir" ]]; do dir="$(dirname "$dir")"; done
  free="$(df -Pk "$dir" | awk 'NR == 2 {print int($4 / 1048576)}')"
  if (( free < need )); then
    echo "[$tag] not enough disk for $venv: its filesystem has $free GiB free, the build needs about" \
         "$need GiB (torch's CUDA libraries alone take 4 GiB). Free some space (df -h $dir) and run again." >&2
    exit 1
  fi
}
