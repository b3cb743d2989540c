#!/usr/bin/env bash
# A file too large for one device call (the Transformer Engine core wheel: 276 MB, where a call
# carries at most 64 MiB with the working tree) travels cut into parts, one part a folder, and is
# put back together on the other side with its checksum checked.
#   bash scripts/gpu/parts.sh split FILE PART_MIB PREFIX   # PREFIX0/ PREFIX1/ ...: part.NN, NAME, SHA256, PARTS
#   bash scripts/gpu/parts.sh collect DIR PREFIX           # each PREFIXk/ here into DIR (parts pile up there)
#   bash scripts/gpu/parts.sh join DIR OUT_DIR             # DIR's parts -> OUT_DIR/NAME, checksum checked
# Exit 1 with one line when a part is missing, parts of two files are mixed, or the checksum differs.
set -uo pipefail
shopt -s nullglob
die() { echo "parts: $*" >&2; exit 1; }

split_file() {  # FILE PART_MIB PREFIX
  local file=$1 mib=$2 prefix=$3 tmp sha n k
  [[ -f "$file" ]] || die "split: no file $file"
  [[ "$mib" =~ ^[1-9][0-9]*$ ]] || die "split: part size $mib: expected a whole number of MiB"
  [[ -n "$(basename "$prefix")" && "$prefix" != */ ]] || die "split: prefix '$prefix': expected a folder name's start, as .gpu_p"
  sha="$(sha256sum "$file" | cut -c1-64)"
  tmp="$(mktemp -d)"
  split -b "${mib}M" -d -a 2 "$file" "$tmp/part." || die "split: could not cut $file"
  n=$(find "$tmp" -name 'part.*' | wc -l)
  rm -rf "${prefix}"[0-9]*/  # the parts of an earlier file
  for k in $(seq 0 $((n - 1))); do
    mkdir -p "$prefix$k" && mv "$tmp/part.$(printf '%02d' "$k")" "$prefix$k/" || die "split: could not fill $prefix$k"
    basename "$file" > "$prefix$k/NAME"; echo "$n" > "$prefix$k/PARTS"; echo "$sha" > "$prefix$k/SHA256"
  done
  rmdir "$tmp"
  echo "$n"
}

collect() {  # DIR PREFIX: copies whatever parts arrived with this call, says what is still missing
  local dir=$1 prefix=$2 found=0 src
  mkdir -p "$dir" || die "collect: cannot make $dir"
  for src in "${prefix}"[0-9]*/; do
    [[ -f "$src/NAME" ]] || continue
    if [[ -f "$dir/NAME" ]] && ! cmp -s "$dir/SHA256" "$src/SHA256"; then
      die "collect: $src holds a part of $(cat "$src/NAME"), $dir parts of another file ($(cat "$dir/NAME")): empty $dir"
    fi
    cp "$src"/* "$dir/" && found=$((found + 1))
  done
  echo "parts: $found folder(s) collected into $dir; $(missing "$dir")"
}

missing() {  # DIR: "all N parts here" or which are still to come
  local dir=$1 n k gaps=""
  [[ -f "$dir/PARTS" ]] || { echo "no part here yet"; return; }
  n=$(cat "$dir/PARTS")
  for k in $(seq 0 $((n - 1))); do [[ -f "$dir/part.$(printf '%02d' "$k")" ]] || gaps+=" $k"; done
  [[ -z "$gaps" ]] && echo "all $n parts here" || echo "parts still to come:$gaps (of 0-$((n - 1)))"
}

join_parts() {  # DIR OUT_DIR
  local dir=$1 out=$2 name state got
  [[ -f "$dir/NAME" && -f "$dir/SHA256" && -f "$dir/PARTS" ]] || die "join: $dir holds no parts (NAME, SHA256, PARTS)"
  state="$(missing "$dir")"
  [[ "$state" == all* ]] || die "join: $dir: $state"
  name="$(cat "$dir/NAME")"
  mkdir -p "$out" || die "join: cannot make $out"
  cat "$dir"/part.* > "$out/$name"
  got="$(sha256sum "$out/$name" | cut -c1-64)"
  [[ "$got" == "$(cat "$dir/SHA256")" ]] || { rm -f "$out/$name"; die "join: $name: checksum $got, expected $(cat "$dir/SHA256")"; }
  echo "$out/$name"
}

case "${1:-}" in
  split) [[ $# -eq 4 ]] || die "split FILE PART_MIB PREFIX"; split_file "$2" "$3" "$4" ;;
  collect) [[ $# -eq 3 ]] || die "collect DIR PREFIX"; collect "$2" "$3" ;;
  join) [[ $# -eq 3 ]] || die "join DIR OUT_DIR"; join_parts "$2" "$3" ;;
  *) die "expected split, collect or join (the header of ${BASH_SOURCE[0]})" ;;
esac
