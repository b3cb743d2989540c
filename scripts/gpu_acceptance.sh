#!/usr/bin/env bash
# The GPU visit's acceptance run: every GPU-only check in order, each under its own `timeout`, each
# writing its log and one row of a summary table, going on when a step fails; into one folder, five
# files (the device tool brings back eight at most): summary.md / .tsv (this run), summary_all.md /
# .tsv (the latest result of every row here) and logs.tar.gz (logs/ID.log and rows/ID.tsv). The
# table is printed last (docs/gpu.md, "The acceptance run", has the set-up and the device-tool calls).
#   bash scripts/gpu_acceptance.sh                        # on the GPU machine, after the set-up; into $OUT
#   bash scripts/gpu_acceptance.sh --out DIR              # the folder for the logs and the table
#   bash scripts/gpu_acceptance.sh --only 1.5,2           # rerun some rows (their ids in the table)
#   bash scripts/gpu_acceptance.sh --only failed          # rerun the rows that failed in the last run here
#   bash scripts/gpu_acceptance.sh --only 1.7 --scale 2   # a row that ran out of time, with twice its budget
#   bash scripts/gpu_acceptance.sh --dry-run              # on CPU: every command resolved, its flags parsed by
#                                                         # the tool's own parser, every module of ours it reaches
#                                                         # imported (function-level imports too), its files and
#                                                         # families checked, --out writable
#   bash scripts/gpu_acceptance.sh --dry-run --no-imports # the same without the imports: a second instead of five
#   bash scripts/gpu_acceptance.sh --key gpu_check LOG    # the key figure the table shows for a row's log
# --python PY: the interpreter (default $PYTHON, else .venv/bin/python, else python3: the GPU
# machine's, where scripts/gpu/device_setup.sh installs megatron-core and TE). --gpu-kind
# a100|h100|h200 (default: nvidia-smi's name). --root DIR: the checkout to run (default: this
# script's). Exit 1 if a row that ran failed.
# Rows 1.x and 5 run at once (correctness on tiny models: 9 processes share the GPU and 16 cores);
# rows 2-4 measure time and memory, so each runs alone. The budgets add up to BUDGET_CAP seconds: with
# the ~3 min set-up that is ~10 min of a 15-min visit, leaving time to rerun the failed rows once.
set -uo pipefail
BUDGET_CAP=450
SCALE_MAX=10  # x10 takes the smallest budget (30 s) to 300 s, the larger ones to the device tool's 600 s a call
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUTDIR="${OUT:-}" PY="${PYTHON:-}" ONLY="" DRY=0 IMPORTS=1 SCALE=1 GPU_KIND="" KEY=()
die() { echo "gpu_acceptance: $*" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) OUTDIR="${2:?--out needs a folder}"; shift 2 ;;
    --python) PY="${2:?--python needs an interpreter}"; shift 2 ;;
    --only) ONLY="${2:?--only needs row ids or 'failed'}"; shift 2 ;;
    --scale) SCALE="${2:?--scale needs a factor}"; shift 2 ;;
    --gpu-kind) GPU_KIND="${2:?--gpu-kind needs a100, h100 or h200}"; shift 2 ;;
    --root) ROOT="$(cd "${2:?--root needs a folder}" && pwd)" || exit 2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --no-imports) IMPORTS=0; shift ;;
    --key) KEY=("${2:?--key needs a kind}" "${3:?--key needs a log}"); shift 3 ;;
    -h|--help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (--help lists them)" ;;
  esac
done
cd "$ROOT" || exit 2
[[ -n "$PY" ]] || { PY="$ROOT/.venv/bin/python"; [[ -x "$PY" ]] || PY=python3; }
command -v "$PY" >/dev/null || die "no python at $PY (--python PY)"
export PYTHON="$PY"  # scripts/gpu_check.sh runs the same interpreter
[[ "$SCALE" =~ ^([0-9]+[.]?[0-9]*|[.][0-9]+)$ ]] && awk -v s="$SCALE" -v m="$SCALE_MAX" 'BEGIN { exit !(s > 0 && s <= m) }' ||
  die "--scale $SCALE: expected a number greater than 0 and at most $SCALE_MAX (a budget's factor)"
if [[ -z "$GPU_KIND" ]]; then
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" in
    *H200*) GPU_KIND=h200 ;; *A100*) GPU_KIND=a100 ;; *) GPU_KIND=h100 ;;
  esac
fi
STATE="${TMPDIR:-/tmp}/gspo-gpu-acceptance"  # the last run's table, for --only failed
RUN="$STATE/run"  # this run's logs/ and rows/, packed into $OUTDIR/logs.tar.gz after every row
if [[ $DRY == 1 ]]; then WORK="$(mktemp -d)"; trap 'rm -rf "$WORK"' EXIT; else WORK="$STATE/work"; fi

# The rows: id, group (one group's rows run at once), budget s, kind (how its key figure is read),
# what it checks, then the command. Commands run from the checkout's root.
IDS=()
declare -A GROUP BUDGET KIND WHAT ARGV
row() {
  local id=$1; GROUP[$id]=$2 BUDGET[$id]=$3 KIND[$id]=$4 WHAT[$id]=$5; shift 6
  IDS+=("$id"); ARGV[$id]="$(printf '%s\t' "$@")"
}
ENV_PY='import importlib, platform, sys
import torch
ok = torch.cuda.is_available()
parts = [torch.cuda.get_device_name(0) if ok else "no CUDA device", f"python {platform.python_version()}",
         f"torch {torch.__version__}"]
for name, module, versioned in (("megatron-core", "megatron.core", "megatron.core"),
                                ("TE", "transformer_engine.pytorch", "transformer_engine"),
                                ("flash-linear-attention", "fla", "fla"), ("transformers", "transformers", "transformers")):
    try:
        importlib.import_module(module)
        parts.append(f"{name} {sys.modules[versioned].__version__}")
    except Exception as e:  # what is missing is the finding
        parts.append(f"{name} not importable ({type(e).__name__}: {str(e)[:80]})")
        ok = ok and name != "megatron-core"
print("env: " + ", ".join(parts))
sys.exit(0 if ok else 1)'
CHECK=(bash scripts/gpu_check.sh --no-bench)
row 0 pre 30 env "GPU, versions; CUDA and megatron-core importable" -- "$PY" -c "$ENV_PY"
# Budgets: the H200's times (2026-12-04, docs/results.md) with room. Rows 1.1-1.6 took 135-152 s and
# now also run transformers in float64 (and two more actors where ours is the side that is off).
# Qwen3-Next's rows compile and autotune flash-linear-attention's Triton kernels on first use, in 8
# processes at once (1.7 reached its first backward at 165 s; 1.4 ran out of 150 s): transformers'
# reference itself, without causal_conv1d, is 1.5-2.8 s a dtype at the row's shapes (on CPU). On
# Hopper with torch 2.11's Triton 3.6 both are one SKIP row (the start check's refusal) in seconds.
# The local-spec rows first: they need no TE (with TE, each checkpoint also loads into a TE actor).
for f in qwen3_moe:1:170 deepseek_v3:2:170 gpt_oss:3:170 qwen3_next:4:200; do
  IFS=: read -r arch n budget <<< "$f"
  row "1.$n" 1 "$budget" gpu_check "$arch, local spec, fp32 + bf16" -- \
    "${CHECK[@]}" --arch "$arch" --rows local --out "$WORK/1.$n"
done
# TE rows: grouped GEMM, fusions and packed THD micro-batches on (the TE defaults on CUDA); gpt-oss
# builds the local spec only (attention sinks); qwen3_next needs flash-linear-attention
for f in qwen3_moe:5:200 deepseek_v3:6:200 qwen3_next:7:200; do
  IFS=: read -r arch n budget <<< "$f"
  row "1.$n" 1 "$budget" gpu_check "$arch, TE spec, fp32 + bf16, grouped GEMM" -- \
    "${CHECK[@]}" --arch "$arch" --rows te --out "$WORK/1.$n"
done
row 1.8 1 120 offload "optimizer offload (HybridDeviceOptimizer) against Adam on the GPU" -- \
  "${CHECK[@]}" --arch qwen3_moe --rows offload --out "$WORK/1.8"
row 1.9 1 150 lora "LoRA: TE fused norm-linear and grouped-GEMM experts against the local spec" -- \
  "$PY" tools/gpu_check_lora.py --out "$WORK/1.9"
row 1.10 1 0 owed "LoRA served by SGLang's Triton MoE-LoRA kernels (--lora-backend triton_v2)" -- \
  "owed: needs an SGLang server on a GPU (sgl-kernel, flashinfer), which the GPU machine lacks;" \
  "the CPU stand-in serves it in torch (tests/lora/test_lora_serving.py)"
row 2 mfu 100 mfu "packed rows: MFU from real tokens, GPU busy, top ten ops" -- \
  "$PY" benchmarks/mfu.py --device cuda --only 5 6 7 --reps 2
row 3 logprobs 45 logprobs "fused log-probs: peak memory and time against straightforward" -- \
  "$PY" benchmarks/logprobs_memory.py --device cuda --dtype bf16 --vocab 151936
row 4 plan 55 plan "planner: predicted vs measured peak memory and step time (mfu.py's model)" -- \
  "$PY" -m gspo_megatron.cli plan examples/qwen3_235b_a22b.yaml --gpus 1 --gpu "$GPU_KIND" \
  --model "$WORK/plan_model/config.json" --layout tensor=1 --tokens 16384 --check
# a correctness check on a tiny model: it runs with rows 1.x (its seconds are indicative)
row 5 1 90 sync "weight sync between two processes on one GPU (tensor transport, CUDA IPC): full, delta, bit-identical" -- \
  "$PY" tools/gpu_check_sync.py

# --only: which rows
SELECTED=()
if [[ -z "$ONLY" ]]; then SELECTED=("${IDS[@]}")
elif [[ "$ONLY" == failed ]]; then
  compgen -G "$STATE/rows/*.tsv" >/dev/null || die "--only failed: no earlier run here ($STATE/rows)"
  mapfile -t SELECTED < <(for id in "${IDS[@]}"; do [[ -f "$STATE/rows/$id.tsv" ]] && cat "$STATE/rows/$id.tsv"; done |
                          awk -F'\t' '$2 != "0" && $2 != "owed" { print $1 }')
  [[ ${#SELECTED[@]} -gt 0 ]] || { echo "gpu_acceptance: no row failed in the last run"; exit 0; }
else
  for id in ${ONLY//,/ }; do [[ -n "${GROUP[$id]+x}" ]] || die "--only: no row $id (rows: ${IDS[*]})"; done
  for id in "${IDS[@]}"; do [[ ",${ONLY// /,}," == *",$id,"* ]] && SELECTED+=("$id"); done  # in row order
fi
budget_of() { awk -v b="${BUDGET[$1]}" -v s="$SCALE" 'BEGIN { t = int(b * s + 0.5); print (b && t < 1) ? 1 : t }'; }
total_budget() {  # a group's rows run at once: the group costs its largest budget
  local id; declare -A most=()
  for id in "${SELECTED[@]}"; do
    local b; b=$(budget_of "$id"); [[ $b -gt ${most[${GROUP[$id]}]:-0} ]] && most[${GROUP[$id]}]=$b
  done
  local t=0; for b in "${most[@]}"; do t=$((t + b)); done; echo "$t"
}
display() { local -a a; IFS=$'\t' read -r -a a <<< "${ARGV[$1]}"; [[ ${KIND[$1]} == env ]] && a=("$PY" -c "<versions>")
  [[ ${KIND[$1]} == owed ]] && { echo "-"; return; }; echo "${a[*]}"; }
write_plan_model() {  # the planner measures the model benchmarks/mfu.py measures
  mkdir -p "$WORK/plan_model" && "$PY" -c 'import json, sys
sys.path.insert(0, "benchmarks")
from mfu import QWEN3_30B_LAYERS
json.dump(QWEN3_30B_LAYERS, open(sys.argv[1], "w"), indent=1)' "$WORK/plan_model/config.json"
}

# The key figure of a row, read from its log (the tools' own tables); else the log's last line.
key_of() {
  local kind=$1 log=$2 key=""
  case "$kind" in
    env) key="$(grep -m1 '^env: ' "$log" | cut -c6-)" ;;
    gpu_check) key="$(awk -F'|' '/\| (PASS|FAIL) \|$/ {
        s = $2; d = $3; gsub(/^ +| +$/, "", s); gsub(/^ +| +$/, "", d); split($4, lp, " ")
        if ($(NF-1) ~ /PASS/) pass++; else { failed++; f = f (f ? ", " : "") s " " d }
        if (s == "local" || s == "te") v = v (v ? ", " : "") s " " d " " lp[1]
        if ($4 ~ /; fp64: / && $4 !~ /outlier none/) { o = $4; sub(/.*; fp64: /, "", o); sub(/ +$/, "", o); x = x "; " s " " d " vs fp64: " o } }
      /\| SKIP: .*\|$/ && !skip { skip = $(NF-1); sub(/^ +/, "", skip); sub(/ +$/, "", skip) }
      /^memory after close: / && !m { m = $0; sub(/^memory after close: /, "", m) }
      END { if (pass + failed) printf "PASS %d, FAIL %d%s; log-prob max diff %s%s%s", pass, failed,
              f ? " (" f ")" : "", v ? v : "-", x, m ? "; after close " m : ""
            else if (skip) print skip }' "$log")" ;;
    sync) key="$(grep -m1 '^sync on one device ' "$log" | sed 's/^sync on one device //')" ;;
    offload) key="$(grep -m1 '^optimizer offload' "$log" | sed 's/^optimizer offload[^:]*: //')" ;;
    lora) key="$(awk -F'|' '/\| (PASS|FAIL) \|$/ { if ($5 ~ /PASS/) pass++; else { failed++; f = f (f ? ", " : "") $2 $3 }
        d = d (d ? ", " : "") $2 $4 } END { if (pass + failed) printf "PASS %d, FAIL %d%s; diffs%s", pass, failed,
        f ? " (" f ")" : "", d }' "$log" | tr -s ' ')" ;;
    mfu) key="$(awk -F'|' '/^\| / && $2 ~ /packed/ { b = "16384"; if (match($2, /token budget [0-9]+/)) b = substr($2, RSTART + 13, RLENGTH - 13)
        v = ($3 ~ /out of memory/) ? "out of memory" : $5 "MFU," $6 "GPU busy"; gsub(/  +/, " ", v); sub(/^ /, "", v)
        printf "%s%s: %s", sep, b, v; sep = "; " }' "$log")" ;;
    logprobs) key="$(awk -F'|' '/^ *[0-9]+ +[0-9]+ \|/ { split($1, a, " "); split($2, f, " "); split($4, r, " ")
        printf "%s%s%s tokens: fused peak %s GiB, time %s", sep, a[1] == v ? "" : "vocab " a[1] ": ", a[2], f[1],
          r[1] == "-" ? "(straightforward skipped)" : r[1] "x straightforward"; sep = "; "; v = a[1] }' "$log")" ;;
    plan) key="$(awk -F'|' '/^\| 0 \| / { gsub(/^ +| +$/, "", $7); gsub(/^ +| +$/, "", $8)
        printf "peak GiB predicted / measured %s; step s %s", $7, $8 }' "$log")" ;;
  esac
  # else the last exception's line (a traceback's end), else the last line
  [[ -n "$key" ]] || key="$(grep -E '[A-Za-z_][A-Za-z0-9_.]*(Error|Exception): ' "$log" | tail -1 | cut -c1-200)"
  [[ -n "$key" ]] || key="$(grep -v '^[[:space:]]*$' "$log" | tail -1 | cut -c1-200)"
  echo "${key//|//}"
}
if [[ ${#KEY[@]} -gt 0 ]]; then
  kinds=" "; for id in "${IDS[@]}"; do [[ ${KIND[$id]} == owed || "$kinds" == *" ${KIND[$id]} "* ]] || kinds+="${KIND[$id]} "; done
  [[ "$kinds" == *" ${KEY[0]} "* ]] || die "--key ${KEY[0]}: not a kind of row (kinds:${kinds% })"
  [[ -f "${KEY[1]}" && -r "${KEY[1]}" ]] || die "--key ${KEY[0]} ${KEY[1]}: no such log file"
  key_of "${KEY[@]}"; exit 0
fi

# One row's result: rows/ID.tsv (id, rc, seconds, budget, key figure, command) here and in $STATE
# (the latest result of each row on this machine), then the tables again (a killed run keeps them).
write_row() {
  local line; line="$(printf '%s\t%s\t%s\t%s\t%s\t%s' "$1" "$2" "$3" "$(budget_of "$1")" "$4" "$(display "$1")")"
  echo "$line" > "$RUN/rows/$1.tsv"; mkdir -p "$STATE/rows" && echo "$line" > "$STATE/rows/$1.tsv"
  tables "$RUN/rows" "$OUTDIR/summary"; tables "$STATE/rows" "$OUTDIR/summary_all"; pack
}
# The device tool brings back at most 8 files of a call's $OUT: the logs and rows go as one archive
# beside the summaries (5 files), written whole under a name of its own, then moved in (rows that
# run at once each pack; the last pack, after every row, has them all).
pack() {
  local part; part="$(mktemp "$OUTDIR/logs.tar.gz.part.XXXXXX")" &&
    tar czf "$part" -C "$RUN" logs rows && mv "$part" "$OUTDIR/logs.tar.gz"
}
tables() {  # rows dir -> PREFIX.tsv and PREFIX.md, in row order; written whole, then moved in
  local id i rc s b key cmd tsv md
  tsv="$(mktemp "$2.tsv.XXXXXX")" md="$(mktemp "$2.md.XXXXXX")"
  printf '| step | checks | command | rc | seconds | budget s | key figure |\n|---|---|---|---|---|---|---|\n' > "$md"
  for id in "${IDS[@]}"; do
    [[ -f "$1/$id.tsv" ]] || continue
    cat "$1/$id.tsv" >> "$tsv"
    IFS=$'\t' read -r i rc s b key cmd < "$1/$id.tsv"
    echo "| $i | ${WHAT[$id]} | \`$cmd\` | $rc | $s | $b | $key |" >> "$md"
  done
  mv "$tsv" "$2.tsv"; mv "$md" "$2.md"
}

run_row() {
  local id=$1 budget log="$RUN/logs/$1.log" t0 rc key
  local -a a; IFS=$'\t' read -r -a a <<< "${ARGV[$id]}"
  budget=$(budget_of "$id")
  if [[ ${KIND[$id]} == owed ]]; then write_row "$id" owed - "${a[*]}"; return; fi
  write_row "$id" running - "started"
  echo "[acceptance] $id: ${WHAT[$id]} (budget $budget s)"
  rm -rf "${WORK:?}/$id"
  [[ ${KIND[$id]} == plan ]] && write_plan_model
  [[ ${KIND[$id]} == env ]] && a=("$PY" -c "$ENV_PY")
  t0=$SECONDS
  local -a threads=()  # the rows that share the machine: 2 threads each
  [[ ${GROUP[$id]} == 1 ]] && threads=(env "OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}")
  timeout -k 5 "$budget" "${threads[@]}" "${a[@]}" < /dev/null > "$log" 2>&1
  rc=$?
  key="$(key_of "${KIND[$id]}" "$log")"
  if [[ $rc == 124 || $rc == 137 ]]; then rc=timeout key="ran out of its $budget s; $key"; fi
  write_row "$id" "$rc" "$((SECONDS - t0))" "$key"
  echo "[acceptance] $id: rc $rc in $((SECONDS - t0)) s: $key"
}

if [[ $DRY == 1 ]]; then
  problems=0
  echo "gpu_acceptance --dry-run: python $PY ($("$PY" -c 'import platform; print(platform.python_version())')), root $ROOT, GPU kind $GPU_KIND"
  write_plan_model || { echo "PROBLEM: row 4: the planner's model (benchmarks/mfu.py QWEN3_30B_LAYERS) was not written"; problems=1; }
  "$PY" -c 'import sys; compile(sys.argv[1], "env", "exec")' "$ENV_PY" || { echo "PROBLEM: row 0: its Python does not compile"; problems=1; }
  if [[ -n "$OUTDIR" ]]; then  # the run writes there: the folder, or the nearest folder above that exists
    at="$OUTDIR"; while [[ ! -e "$at" && "$at" != "$(dirname "$at")" ]]; do at="$(dirname "$at")"; done
    probe="$(mktemp -d "$at/.gpu_acceptance_probe.XXXXXX" 2>/dev/null)" && rmdir "$probe" ||
      { echo "PROBLEM: --out $OUTDIR: not writable ($at is $([[ -d "$at" ]] && echo "a folder that refuses a new entry" || echo "not a folder"))"; problems=1; }
  fi
  tasks="$WORK/tasks.tsv"
  for id in "${SELECTED[@]}"; do
    [[ ${KIND[$id]} == env || ${KIND[$id]} == owed ]] || printf '%s\t%s\t%s\n' "$id" "${KIND[$id]}" "${ARGV[$id]}" >> "$tasks"
  done
  # Each command's arguments through the tool's own argparse parser, stopped once parsed (nothing
  # runs), every module of ours the tool reaches imported, then what the row reads: the families,
  # mfu.py's packed configurations, the planner's files.
  [[ -f "$tasks" ]] && { "$PY" - "$tasks" "$IMPORTS" <<'PY' || problems=1
import argparse, contextlib, io, os, re, runpy, sys
from pathlib import Path

sys.path.insert(0, os.getcwd())
class Parsed(BaseException):
    def __init__(self, ns):
        self.ns = ns
_parse_args = argparse.ArgumentParser.parse_args
def parse_only(self, args=None, namespace=None):
    raise Parsed(_parse_args(self, args, namespace))
argparse.ArgumentParser.parse_args = parse_only
problems = []

def parse(rid, target, argv, module=False):
    if not module and not Path(target).is_file():
        return problems.append(f"row {rid}: {target} does not exist")
    sys.argv, err = [target, *argv], io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_module(target, run_name="__main__", alter_sys=True) if module else \
                runpy.run_path(target, run_name="__main__")
    except Parsed as p:
        return p.ns
    except SystemExit as e:
        last = (err.getvalue().strip().splitlines() or [f"exit {e.code}"])[-1]
        return problems.append(f"row {rid}: {target} {' '.join(argv)}: {last}")
    except Exception as e:  # noqa: BLE001 - an import that broke is a finding too
        return problems.append(f"row {rid}: {target}: {type(e).__name__}: {e}")
    problems.append(f"row {rid}: {target} ran without parsing its arguments")

from gspo_megatron.run.expected_warnings import quiet_expected_warnings
from tools.resolve_imports import Resolver, source_of
quiet_expected_warnings()
resolver, reached, imports = Resolver(), {}, sys.argv[2] == "1"
lines = Path(sys.argv[1]).read_text().splitlines()
for line in lines:
    rid, kind, *argv = [a for a in line.split("\t") if a]
    if argv[0] == "bash":  # a wrapper: the Python tool it execs with the same arguments
        wrapper, argv = argv[1], argv[2:]
        exec_line = re.search(r'^exec "\$PY" (\S+) "\$@"$', Path(wrapper).read_text(), re.M) \
            if Path(wrapper).is_file() else None
        if exec_line is None:
            problems.append(f"row {rid}: {wrapper} does not exec a Python tool with its arguments")
            continue
        target, module = exec_line.group(1), False
    elif argv[1] == "-m":
        target, module, argv = argv[2], True, argv[3:]
    else:
        target, module, argv = argv[1], False, argv[2:]
    ns = parse(rid, target, argv, module)
    # every module the row runs, the imports inside its functions included (a GPU runs them first)
    source = source_of(target) if module else Path(target)
    if imports and source is not None and source.is_file():
        if target not in reached:
            reached[target] = resolver.check([source], follow=True)
        problems += [f"row {rid}: {p}" for p in reached[target]]
    if ns is None:
        continue
    if hasattr(ns, "arch"):
        from model_specs.families import FAMILIES
        if ns.arch not in FAMILIES:
            problems.append(f"row {rid}: --arch {ns.arch}: not a family of model_specs/families/ FAMILIES")
    if kind == "mfu":
        configs = runpy.run_path(target, run_name="mfu_configurations")["configurations"](ns.device)
        for k in ns.only or range(len(configs)):
            if not 0 <= k < len(configs) or not configs[k][2].get("pack_sequences"):
                what = repr(configs[k][0]) if 0 <= k < len(configs) else f"none of {len(configs)}"
                problems.append(f"row {rid}: {target} --only {k}: not a packed configuration ({what})")
    if kind == "plan":
        from gspo_errors import GspoError
        from gspo_megatron.config import load_config
        from gspo_megatron.planner.command import _layout_fields
        from gspo_megatron.planner.plan import load_model
        try:
            load_config(ns.config, ns.overrides)
            load_model(ns.model)
            _layout_fields(ns.layout)
        except GspoError as e:
            problems.append(f"row {rid}: {e}")
        if not ns.check:
            problems.append(f"row {rid}: gspo-megatron plan without --check measures nothing")
print(f"parsed the arguments of {len(lines)} commands with their tools' own parsers; " + (
      f"imported {sum(not isinstance(m, BaseException) for m in resolver.loaded.values())} modules of ours "
      "they reach" if imports else "imported nothing (--no-imports)"))
for module, why in sorted(resolver.from_source.items()):
    print(f"resolved from its source, not importable here ({why}): {module}")
for p in problems:
    print(f"PROBLEM: {p}")
sys.exit(1 if problems else 0)
PY
  }
  printf '\n| step | runs with | budget s | checks | command |\n|---|---|---|---|---|\n'
  for id in "${SELECTED[@]}"; do
    with="alone"; [[ ${GROUP[$id]} == 1 ]] && with="rows 1.x and 5 at once"; [[ ${KIND[$id]} == owed ]] && with="not run"
    echo "| $id | $with | $(budget_of "$id") | ${WHAT[$id]} | \`$(display "$id")\` |"
  done
  total=$(total_budget)
  echo "total: $total s of device time (cap $BUDGET_CAP s; the device tool's timeout_s: this + 60)"
  [[ $total -le $BUDGET_CAP ]] || { echo "PROBLEM: the budgets add up to $total s, over the cap of $BUDGET_CAP s"; problems=1; }
  [[ $problems == 0 ]] && echo "dry run: every command resolved, no problem" || echo "dry run: problems above"
  exit "$problems"
fi

[[ -n "$OUTDIR" ]] || die "no output folder: set \$OUT or pass --out DIR"
rm -rf "${RUN:?}"; mkdir -p "$OUTDIR" "$RUN/logs" "$RUN/rows" "$WORK" || exit 2
echo "gpu_acceptance: $(git rev-parse --short HEAD 2>/dev/null || echo 'no git'), python $PY, GPU kind $GPU_KIND," \
     "rows ${SELECTED[*]}, budgets $(total_budget) s in all, into $OUTDIR"
failed=0 done_groups=" "
for id in "${SELECTED[@]}"; do
  g=${GROUP[$id]}
  [[ "$done_groups" == *" $g "* ]] && continue
  done_groups+="$g "
  members=(); for m in "${SELECTED[@]}"; do [[ ${GROUP[$m]} == "$g" ]] && members+=("$m"); done
  if [[ ${#members[@]} -eq 1 ]]; then run_row "$id"; else
    pids=(); for m in "${members[@]}"; do run_row "$m" & pids+=($!); done
    wait "${pids[@]}"
  fi
done
pack
echo
cat "$OUTDIR/summary.md"
for id in "${SELECTED[@]}"; do
  IFS=$'\t' read -r _ rc _ < "$RUN/rows/$id.tsv"
  [[ $rc == 0 || $rc == owed ]] && continue
  failed=1
  echo; echo "--- $id ($rc), the end of logs/$id.log (logs.tar.gz):"; grep -v '^[[:space:]]*$' "$RUN/logs/$id.log" | tail -4 | cut -c1-240
done
exit "$failed"
