#!/usr/bin/env bash
# The GPU tier on a Hopper machine, once per FlashInfer version, with a short table last.
#
#   scripts/gpu_tier.sh [VERSION ...]        (default: 0.6.18.post1 0.7.4)
#
# A restored JIT cache did not skip the builds on the H200 (December 2026: 62 s restored against
# 61 s cold for the three variants on 0.6.18.post1, 70 s against 60 s on 0.7.4), so
# JIT_CACHE_IN is off unless given.
#
# For each version: install it from .whl (eval "$(bash .gpu/install-wheels.sh .whl V)"), restore
# a JIT cache tarball if one is given (JIT_CACHE_IN=DIR holding jit-V.tar.gz), build or load
# every kernel variant once and time it (harness.prebuild), run `pytest -n auto -m gpu` with
# junit xml, then save the JIT cache as a tarball and time a restore of it into an empty cache.
# Environment: OUT (default ./out) for logs, junit, reports and tarballs; CPU_TIER=1 also runs
# the CPU tier once; WORKERS (default auto); TIER_TIMEOUT seconds per version (default 420);
# JIT_RESTORE_CHECK=0 skips the timed restore; PREBUILD=0 skips the timed one-by-one build
# (the workers then build what they need). BASELINE=1: the first version records a
# baseline (--record-baseline OUT/baseline-V1), each later one is compared with it
# (--compare-baseline, report in OUT/compare-V). RECORD_FIXTURES=1: after the tier, record the
# fixtures' outputs for this version into OUT/fixtures (python3 -m scripts.record_fixtures).
# BENCH=1: then the benchmark (python3 -m bench.run $BENCH_ARGS, default --quick) into
# OUT/bench-V, skipped once the script has run DEADLINE seconds (default 420).
# PACK=1: at the end logs and reports go into OUT/artifacts.tar.gz, fixtures into
# OUT/fixtures-{0,1}.tar, each benchmark into OUT/bench-V.tar.gz (few files come back from a
# lent machine); the JIT tarballs are dropped.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/out}
mkdir -p "$out"
if [ $# -gt 0 ]; then versions=("$@"); else versions=(0.6.18.post1 0.7.4); fi
workers=${WORKERS:-auto}
export PYTHONUNBUFFERED=1
base_pythonpath=${PYTHONPATH:-}
summary=$(mktemp)

if [ "${CPU_TIER:-0}" = 1 ]; then
  start=$(date +%s)
  python3 -m pytest -q -n "$workers" tests/cpu -p no:cacheprovider 2>&1 | tail -4
  echo "cpu tier: $(( $(date +%s) - start )) s"
fi

for v in "${versions[@]}"; do
  echo "=== flashinfer $v ==="
  export PYTHONPATH=$base_pythonpath
  eval "$(bash .gpu/install-wheels.sh .whl "$v")" || { echo "install of $v failed"; continue; }
  export PYTHONPATH="$PWD:$PYTHONPATH"
  cache="$FLASHINFER_WORKSPACE_BASE"
  mkdir -p "$cache"
  if [ -n "${JIT_CACHE_IN:-}" ] && [ -f "$JIT_CACHE_IN/jit-$v.tar.gz" ]; then
    tar -xzf "$JIT_CACHE_IN/jit-$v.tar.gz" -C "$cache"
    # Outputs newer than the freshly installed sources, or ninja rebuilds everything.
    find "$cache" -type f -exec touch {} +
    echo "restored JIT cache from $JIT_CACHE_IN/jit-$v.tar.gz"
  fi
  start=$(date +%s)
  prebuild_log=$(mktemp)
  if [ "${PREBUILD:-1}" = 1 ]; then
    timeout 240 python3 -m harness.prebuild 2>&1 | tee "$prebuild_log" | grep -E "^jit|Error"
  fi
  baseline_args=()
  if [ "${BASELINE:-0}" = 1 ]; then
    if [ -z "${first_version:-}" ]; then
      first_version=$v
      baseline_args=("--record-baseline=$out/baseline-$v")
    else
      baseline_args=("--compare-baseline=$out/baseline-$first_version" "--baseline-out=$out/compare-$v")
    fi
  fi
  SPARSE_MLA_GPU_REPORT="$out/report-$v.json" timeout "${TIER_TIMEOUT:-420}" \
    python3 -m pytest -n "$workers" -m gpu -p no:cacheprovider "${baseline_args[@]}" \
    --junitxml="$out/junit-$v.xml" --durations=5 -rfEx 2>&1 | tee "$out/log-$v.txt" | tail -45
  rc=${PIPESTATUS[0]}
  wall=$(( $(date +%s) - start ))
  if [ "${RECORD_FIXTURES:-0}" = 1 ]; then
    timeout 180 python3 -m scripts.record_fixtures --dir "$out/fixtures" 2>&1 | tee "$out/fixtures-$v.txt" | tail -3
  fi
  if [ "${BENCH:-0}" = 1 ]; then
    if [ "$SECONDS" -lt "${DEADLINE:-420}" ]; then
      # shellcheck disable=SC2086
      timeout "${BENCH_TIMEOUT:-120}" python3 -m bench.run --out "$out/bench-$v" ${BENCH_ARGS:---quick} \
        > "$out/bench-$v.log" 2>&1
      echo "bench $v: exit $? ($(tail -1 "$out/bench-$v.log" | cut -c1-100))"
    else
      echo "bench $v: skipped, the script has run $SECONDS s (DEADLINE ${DEADLINE:-420} s)"
    fi
  fi
  tar -czf "$out/jit-$v.tar.gz" -C "$cache" . 2>/dev/null
  size=$(du -m "$out/jit-$v.tar.gz" | cut -f1)
  restore_line=""
  if [ "${JIT_RESTORE_CHECK:-1}" = 1 ]; then
    # Does a restored cache skip the builds? Restore into an empty folder and time the variants.
    restored=$(mktemp -d)
    tar -xzf "$out/jit-$v.tar.gz" -C "$restored" && find "$restored" -type f -exec touch {} +
    restore_line=$(FLASHINFER_WORKSPACE_BASE=$restored timeout 120 python3 -m harness.prebuild 2>&1 | grep "jit total")
    rm -rf "$restored"
  fi
  [ "$size" -le 15 ] || rm -f "$out/jit-$v.tar.gz"
  python3 - "$v" "$out/junit-$v.xml" "$wall" "$rc" "$size" "$restore_line" "$prebuild_log" >>"$summary" <<'EOF'
import sys, xml.etree.ElementTree as ET
v, path, wall, rc, size, restore, prebuild = sys.argv[1:]
counts = dict(passed=0, failed=0, xfailed=0, skipped=0)
times = []
try:
    root = ET.parse(path).getroot()
    for case in root.iter("testcase"):
        name = case.get("name")
        times.append((float(case.get("time", 0)), name))
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
        elif (s := case.find("skipped")) is not None:
            counts["xfailed" if "xfail" in (s.get("type", "") + s.get("message", "")) else "skipped"] += 1
        else:
            counts["passed"] += 1
except (OSError, ET.ParseError) as exc:
    print(f"{v}: no junit ({exc}); pytest exit {rc}")
    sys.exit(0)
jit = next((l.split()[-2] for l in open(prebuild) if l.startswith("jit total")), "?")
slow = ", ".join(f"{n[:60]} {t:.1f}s" for t, n in sorted(times, reverse=True)[:3])
print(f"{v:<14}{counts['passed']:>7}{counts['failed']:>7}{counts['xfailed']:>8}{counts['skipped']:>8}{wall:>7}s"
      f"{jit:>8}s{restore.split()[-2] if restore else '?':>9}s{size:>5}MB  exit {rc}  slowest: {slow}")
EOF
done

if [ "${PACK:-0}" = 1 ]; then
  # Few files come back from a lent machine: logs and reports in one tarball (without the
  # baselines' output tensors), the fixtures in two tarballs.
  (
    cd "$out" || exit 1
    tar -czf /tmp/artifacts.tar.gz --exclude='*.safetensors' --exclude='jit-*.tar.gz' --exclude=fixtures \
      --exclude='bench-[0-9]*[0-9]' .
    if [ -d fixtures ]; then
      ls fixtures/*.safetensors | sort > /tmp/fixture-list
      half=$(( ($(wc -l < /tmp/fixture-list) + 1) / 2 ))
      head -n "$half" /tmp/fixture-list | tar -cf /tmp/fixtures-0.tar -T -
      tail -n +"$((half + 1))" /tmp/fixture-list | tar -cf /tmp/fixtures-1.tar -T -
    fi
    for b in bench-*/; do [ -d "$b" ] && tar -czf "/tmp/${b%/}.tar.gz" "$b"; done
    find . -mindepth 1 -maxdepth 1 -exec rm -rf {} +
    mv /tmp/artifacts.tar.gz /tmp/fixtures-*.tar /tmp/bench-*.tar.gz . 2>/dev/null
  )
fi
for f in "$out"/compare-*/report.md; do
  [ -f "$f" ] && { echo; echo "== $f"; head -12 "$f"; }
done
echo
echo "version        passed failed xfailed skipped   wall  jit-cold  jit-restored  tarball   slowest cases"
cat "$summary"
rm -f "$summary"
