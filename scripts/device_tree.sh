#!/usr/bin/env bash
# A call to a lent machine carries the working tree (tracked files) plus what `carry` names, 64 MiB in all;
# the tracked results/ and shipped drafter take 41 MiB of it. `slim` untracks them in the index only (and
# ignores them through .git/info/exclude), so a call can carry the 94 MiB target in two parts; `restore` puts
# the index and the exclude file back. Nothing on disk changes. Never commit while slim.
#   scripts/device_tree.sh slim | restore | status
set -euo pipefail
cd "$(dirname "$0")/.."
PATHS=(results src/dspark/drafters/shipped)
EXCLUDE=.git/info/exclude
case ${1:-status} in
  slim)
    git diff --cached --quiet || { echo "the index has staged changes: commit or unstage them first"; exit 1; }
    git rm -r -q --cached "${PATHS[@]}"
    for p in "${PATHS[@]}"; do echo "/$p/" >> "$EXCLUDE"; done
    echo "slim: $(git ls-files | xargs du -ck | tail -1 | cut -f1) KiB tracked" ;;
  restore)
    git reset -q -- "${PATHS[@]}"
    for p in "${PATHS[@]}"; do grep -vxF "/$p/" "$EXCLUDE" > "$EXCLUDE.tmp" || true; mv "$EXCLUDE.tmp" "$EXCLUDE"; done
    git status --short | head -5; echo "restored: $(git ls-files | wc -l) files tracked" ;;
  status) git ls-files | xargs du -ck | tail -1 ;;
  *) echo "usage: scripts/device_tree.sh slim | restore | status"; exit 2 ;;
esac
