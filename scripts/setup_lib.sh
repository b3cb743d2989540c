# Sourced by scripts/setup.sh and scripts/setup_mcore019.sh: what both venv builds share.

# quiet CMD...: runs a pip command; drops the noise of this machine's system-wide pip.conf
# (local-disk wheel locations) and keeps pip's exit status.
quiet() { "$@" 2>&1 | { grep -v -E "is ignored: it is neither|^$" || true; }; return "${PIPESTATUS[0]}"; }

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
