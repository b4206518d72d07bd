#!/bin/sh
# Build the two images of docker/ from the repository root, tagged with the project
# version (pyproject.toml), and with --push push them.
#
#   docker/build.sh                                   # warmup-agent:VERSION, warmup-agent-vllm:VERSION
#   REGISTRY=registry.example.com/ml docker/build.sh --push
#   DOCKER=podman docker/build.sh                      # or buildah bud, any client with `build`/`push`
set -eu
cd "$(dirname "$0")/.."
VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)
DOCKER=${DOCKER:-docker}
PREFIX=${REGISTRY:+$REGISTRY/}
for image in agent:warmup-agent vllm:warmup-agent-vllm; do
    file=docker/${image%%:*}.Dockerfile
    ref=${PREFIX}${image#*:}:${VERSION}
    "$DOCKER" build -f "$file" --build-arg "VERSION=$VERSION" -t "$ref" .
    if [ "${1:-}" = --push ]; then
        "$DOCKER" push "$ref"
    fi
done
