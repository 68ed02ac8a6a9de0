#!/usr/bin/env bash
# Real weights reach the device in <= 60 MiB parts, one per call (a call carries at most 64 MiB).
# Each part is kept as its own file (a repeated call is harmless); once every part is there, they
# are concatenated in name order and the sha256 is checked before the file takes its catalog name.
#   bash bench/device/put_part.sh PART_FILE  CATALOG_FILENAME  NUM_PARTS  SHA256
set -euo pipefail
source "$(dirname "$0")/env.sh"
part=$1 name=$2 count=$3 sha=$4
cp "$part" "$SPECSERVE_CACHE/parts/$name.$(basename "$part")"
have=$(ls "$SPECSERVE_CACHE/parts/$name".* | wc -l)
echo "$name: $have / $count parts"
if [ "$have" -eq "$count" ]; then
  cat $(ls "$SPECSERVE_CACHE/parts/$name".* | sort) > "$SPECSERVE_CACHE/models/$name.partial"
  echo "$sha  $SPECSERVE_CACHE/models/$name.partial" | sha256sum -c -
  mv "$SPECSERVE_CACHE/models/$name.partial" "$SPECSERVE_CACHE/models/$name"
  rm -f "$SPECSERVE_CACHE/parts/$name".*
  ls -l "$SPECSERVE_CACHE/models"
fi
