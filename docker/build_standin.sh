#!/bin/sh
# Build and run the sidecar image (docker/agent.Dockerfile) where no registry can be
# reached: a manual check, not part of CI (it installs buildah and debootstrap from Debian,
# downloads a Debian root filesystem, ~3 minutes, ~600 MB).
#
# The base is a STAND-IN: Debian bookworm with its own python3 and pip (made with
# debootstrap), tagged locally as the Dockerfile's FROM (python:3.12-slim-bookworm), so
# the Dockerfile is built unmodified; the real base has Python 3.12 in /usr/local.  The
# built image is then run the way the chart runs it: root filesystem read-only, uid 1000,
# /tmp and /var/cache/warmup-agent as tmpfs, PID 1 of its own PID namespace, with the
# image's default configuration, warming the OpenAI-compatible server at $1.
#
#   docker/build_standin.sh http://127.0.0.1:8000      # as root; a server must answer there
# Extra buildah arguments go in BUILD_ARGS (e.g. -v HOST_CA:/etc/ssl/certs/ca-certificates.crt:ro
# behind a TLS-intercepting proxy).
set -eu
URL=${1:?usage: docker/build_standin.sh SERVER_URL}
cd "$(dirname "$0")/.."
VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)
WORK=${WORK:-/tmp/warmup-agent-standin}
B="buildah --storage-driver vfs"
command -v buildah >/dev/null && command -v debootstrap >/dev/null ||
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends buildah debootstrap
mkdir -p "$WORK"
if ! $B inspect --type image docker.io/library/python:3.12-slim-bookworm >/dev/null 2>&1; then
    rm -rf "$WORK/rootfs"
    debootstrap --variant=minbase --include=python3,python3-pip,python-is-python3,ca-certificates \
        bookworm "$WORK/rootfs" http://deb.debian.org/debian
    rm -f "$WORK"/rootfs/usr/lib/python3*/EXTERNALLY-MANAGED   # pip installs system-wide, as in python:*-slim
    base=$($B from scratch)
    $B copy "$base" "$WORK/rootfs/" / >/dev/null
    $B config --env PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$base"
    $B commit -q "$base" docker.io/library/python:3.12-slim-bookworm
    $B rm "$base" >/dev/null
fi
# shellcheck disable=SC2086
$B build --pull-never --isolation chroot ${BUILD_ARGS:-} -f docker/agent.Dockerfile \
    --build-arg "VERSION=$VERSION" -t "warmup-agent:$VERSION" .
$B inspect --type image "warmup-agent:$VERSION" | python3 -c \
    'import json, sys; c = json.load(sys.stdin)["OCIv1"]["config"]; print("user", c["User"], "entrypoint", c["Entrypoint"], "cmd", c["Cmd"]); print(json.dumps(c["Labels"], indent=1))'
ctr=$($B from --pull-never "warmup-agent:$VERSION")
root=$($B mount "$ctr")
echo "image root filesystem: $(du -sm "$root" | cut -f1) MB"
# The container: the image's ENV and default CMD, the server URL and --once added.
set +e
unshare --mount --pid --fork sh -c '
set -e
R=$1; URL=$2
mount --make-rprivate /
mount --bind "$R" "$R"; mount -o remount,bind,ro "$R"
mount -t proc proc "$R/proc"; mount --bind /dev "$R/dev"
mount -t tmpfs -o mode=1777 tmpfs "$R/tmp"
mount -t tmpfs -o uid=1000,gid=1000 tmpfs "$R/var/cache/warmup-agent"
exec chroot --userspec=1000:1000 "$R" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp XDG_CACHE_HOME=/var/cache/warmup-agent \
    HF_HOME=/var/cache/warmup-agent/huggingface WARMUP_AGENT_OPENAI_URL="$URL" \
    warmup-agent run --config /etc/warmup-agent/sidecar.yaml --once --no-progress --listen 127.0.0.1:0
' sh "$root" "$URL"
rc=$?
$B umount "$ctr" >/dev/null; $B rm "$ctr" >/dev/null
echo "warmup-agent in the image (read-only root, uid 1000, PID 1) exited $rc"
exit $rc
