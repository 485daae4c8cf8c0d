#!/bin/sh
# Copy a folder to a dated archive and keep the newest seven.
set -eu
src=${1:?usage: backup.sh FOLDER DEST}
dest=${2:?usage: backup.sh FOLDER DEST}
stamp=$(date +%Y%m%d-%H%M%S)
mkdir -p "$dest"
tar -czf "$dest/backup-$stamp.tar.gz" -C "$(dirname "$src")" "$(basename "$src")"
ls -1t "$dest"/backup-*.tar.gz | tail -n +8 | while read -r old; do
    rm -f -- "$old"
done
echo "wrote $dest/backup-$stamp.tar.gz"
