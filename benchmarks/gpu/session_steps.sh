# Sourced by GPU session scripts: `step NAME TIMEOUT CMD...` runs CMD with min(TIMEOUT, the time left before $END),
# logs to $R/NAME.log, appends its exit status and duration to $OUT/summary.txt and tars $R into
# $OUT/logs.tar.gz (8 files come back from the device at most); a step with under 20 s left is skipped.
# The caller sets OUT, R (log folder) and END (epoch seconds).
step() {
  local name=$1 to=$2; shift 2
  local left=$(( END - $(date +%s) )); [ "$to" -gt "$left" ] && to=$left
  if [ "$to" -lt 20 ]; then echo "== $name skipped (no time)" | tee -a "$OUT/summary.txt"; return; fi
  local t0=$(date +%s)
  timeout "$to" "$@" > "$R/$name.log" 2>&1
  echo "== $name rc=$? ($(( $(date +%s) - t0 )) s, limit $to s)" | tee -a "$OUT/summary.txt"
  tar czf "$OUT/logs.tar.gz" -C "$R" .
}
