#!/usr/bin/env bash
# Run here, on a machine with the package registry, before a GPU visit (docs/gpu.md, "The
# acceptance run"): downloads what the GPU machine lacks (it has Python 3.12, torch 2.11 cu130,
# transformers, nvcc, cmake, ninja, pybind11; no megatron-core, no Transformer Engine, no package
# registry) into folders that git ignores, each small enough to travel in one device call beside the
# working tree (CARRY_MIB in all):
#   .gpu/             whl/: megatron-core, flash-linear-attention (Qwen3-Next's kernels), math-verify;
#                     te_small/: Transformer Engine's small wheels and its torch extension's source,
#                     built on the GPU machine against its torch (about 20 MB): the last set-up call
#   .gpu_p0/ ...      Transformer Engine's core wheel (about 276 MB) cut into PART_MIB parts, one a
#                     folder (part.NN, NAME, SHA256, PARTS: scripts/gpu/parts.sh): one a call
#   bash scripts/gpu/prepare.sh                # megatron-core 0.19.2, TE 2.20.2 (about a minute)
#   bash scripts/gpu/prepare.sh --dry-run      # what it would fetch and the part layout; fetches nothing
#   MCORE=0.16.1 bash scripts/gpu/prepare.sh   # the other end of the supported megatron-core range
# The GPU machine installs them with scripts/gpu/device_setup.sh.
set -uo pipefail
MCORE="${MCORE:-0.19.2}" TE="${TE:-2.20.2}" FLA="${FLA:-0.6.0}" PART_MIB="${PART_MIB:-58}"
CARRY_MIB=64                  # what one device call carries: the working tree and the carried folders
TE_CORE_BYTES=276000000       # transformer-engine-cu13 2.20.2's wheel: the dry run's layout
GPU_DIR_BYTES=20000000        # .gpu/ as downloaded: the dry run's layout
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
die() { echo "prepare: $*" >&2; exit 1; }
DRY=0
case "${1:-}" in --dry-run) DRY=1 ;; "") ;; *) die "unknown option $1 (--dry-run, or nothing)" ;; esac
[[ "$PART_MIB" =~ ^[1-9][0-9]*$ ]] || die "PART_MIB=$PART_MIB: expected a whole number of MiB"
cd "$ROOT" || exit 1

SMALL=("megatron-core==$MCORE" "flash-linear-attention==$FLA" "fla-core==$FLA" math-verify
       latex2sympy2_extended "antlr4-python3-runtime==4.13.2")
TE_SMALL=("transformer-engine==$TE" nvdlfw-inspect "nvidia-cudnn-frontend>=1.29" pydantic pydantic-core
          annotated-types typing-inspection)
TE_TORCH="transformer-engine-torch==$TE"  # a source package
TE_CORE="transformer-engine-cu13==$TE"
# wheels for the GPU machine's Python, whatever this machine runs
FOR_GPU=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
         --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
         --platform manylinux2014_x86_64)
FOLDERS=(.gpu $(for k in $(seq 0 9); do echo ".gpu_p$k"; done))

mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
tree_bytes() {  # what travels with every call: tracked and untracked-not-ignored files
  git ls-files -z -co --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{ s += $1 } END { print s + 0 }'
}
# layout CORE_BYTES GPU_BYTES: one line per device call of the set-up; 1 if a call is over CARRY_MIB
layout() {
  local core=$1 gpu=$2 part=$((PART_MIB * 1048576)) tree n k size carried over=0
  tree=$(tree_bytes)
  n=$(( (core + part - 1) / part ))
  for k in $(seq 0 $((n - 1))); do
    size=$(( k < n - 1 ? part : core - (n - 1) * part ))
    carried=$((size + tree)); [[ $k == $((n - 1)) ]] && carried=$((carried + gpu))
    printf '  call %d: .gpu_p%d (part.%02d, %s MiB)%s + the working tree (%s MiB) = %s MiB of %d' $((k + 1)) "$k" "$k" \
      "$(mib "$size")" "$([[ $k == $((n - 1)) ]] && echo " + .gpu ($(mib "$gpu") MiB)")" "$(mib "$tree")" "$(mib "$carried")" "$CARRY_MIB"
    if (( carried > CARRY_MIB * 1048576 )); then echo "  PROBLEM: over the limit"; over=1; else echo; fi
  done
  return $over
}

for d in "${FOLDERS[@]}"; do
  git check-ignore -q "$d/" || die "$d/ is not git-ignored (.gitignore): the device call would carry it with the working tree"
done

if [[ $DRY == 1 ]]; then
  echo "prepare --dry-run: would download, as wheels for CPython 3.12 on manylinux x86_64 ($ROOT):"
  echo "  .gpu/whl/:      ${SMALL[*]}"
  echo "  .gpu/te_small/: ${TE_SMALL[*]}, and $TE_TORCH (source, built on the GPU machine)"
  echo "  then cut into $PART_MIB MiB parts: $TE_CORE (about $(mib $TE_CORE_BYTES) MiB)"
  echo "the set-up's device calls (scripts/gpu/device_setup.sh; sizes estimated):"
  layout $TE_CORE_BYTES $GPU_DIR_BYTES || { echo "dry run: a call is over $CARRY_MIB MiB: lower PART_MIB"; exit 1; }
  echo "dry run: nothing fetched"
  exit 0
fi

fetch() { python3 -m pip download -q --no-deps "$@"; }
mkdir -p .gpu/whl .gpu/te_small || exit 1
fetch "${FOR_GPU[@]}" -d .gpu/whl "${SMALL[@]}" || die "the small wheels did not download (pip's message above)"
fetch "${FOR_GPU[@]}" -d .gpu/te_small "${TE_SMALL[@]}" || die "Transformer Engine's small wheels did not download"
fetch -d .gpu/te_small "$TE_TORCH" || die "$TE_TORCH's source did not download"
cut_already() {  # the TE core wheel of this version, every part in its folder
  local n k
  [[ "$(cat .gpu_p0/NAME 2>/dev/null)" == transformer_engine_cu13-"$TE"-* ]] && n=$(cat .gpu_p0/PARTS) || return 1
  for k in $(seq 0 $((n - 1))); do [[ -f ".gpu_p$k/part.$(printf '%02d' "$k")" ]] || return 1; done
}
if cut_already; then
  echo "prepare: $(cat .gpu_p0/NAME) is already cut into .gpu_p*/"
else
  tmp="$(mktemp -d)"
  fetch "${FOR_GPU[@]}" -d "$tmp" "$TE_CORE" || die "$TE_CORE did not download"
  rm -rf .gpu_p[0-9]/
  wheel="$(ls "$tmp"/transformer_engine_cu13-*.whl)"
  n="$(bash scripts/gpu/parts.sh split "$wheel" "$PART_MIB" .gpu_p)" || exit 1
  (( n <= ${#FOLDERS[@]} - 1 )) || die "$n parts: more than the ignored .gpu_p0-9: raise PART_MIB"
  rm -rf "$tmp"
fi
core=$(cat .gpu_p[0-9]/part.* | wc -c)
echo "prepare: .gpu/ $(mib "$(du -sb .gpu | cut -f1)") MiB; the set-up's device calls:"
layout "$core" "$(du -sb .gpu | cut -f1)" || die "a call is over $CARRY_MIB MiB: run again with a smaller PART_MIB"
