#!/usr/bin/env python3
"""Build llama.cpp's `llama-server` once and cache it, for the tests and benchmarks.

The source is the llama.cpp tree vendored in the PyPI sdist of llama-cpp-python==0.3.36
(MIT), fetched with `pip download --no-deps --no-binary :all:` (no other download is
possible here).  Only that tree's `llama-server` target is built, statically
(BUILD_SHARED_LIBS=OFF), so the binary is self-contained:

    <data_dir>/llama.cpp/0.3.36-cpu/bin/llama-server          (CPU build)
    <data_dir>/llama.cpp/0.3.36-cuda-sm90/bin/llama-server    (CUDA build for sm_90)

data_dir: --data-dir, else $WARMUP_AGENT_DATA_DIR, else $XDG_CACHE_HOME/warmup-agent, else
~/.cache/warmup-agent (the agent's own default).  A second run finds the binary and exits
at once.  The binary's path is the last line of stdout.

CUDA: --cuda on builds for CUDA; --cuda auto (the default) only when nvcc is found AND
`nvidia-smi -L` lists a GPU (a CPU machine with the toolkit but no GPU builds for CPU).

A machine without internet: on a connected one run `--source-tarball OUT.tar.gz` (a
stripped copy of the tree, about 8 MB: no models, docs, tests, examples or web UI
sources), carry it over, and there run `--from-tarball OUT.tar.gz`.

Needs cmake, a C++17 compiler (ninja if present) and, for CUDA, nvcc.  Stdlib only.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
SDIST_PREFIX = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
DEFAULT_CUDA_ARCH = "90"

# Dropped from the tree: not needed by the llama-server target's CMake (checked by building
# from the stripped copy).  Paths are relative to the llama.cpp root; a folder drops its
# whole subtree.  tools/ui keeps only its CMakeLists.txt: without package.json the UI step
# skips npm and, with LLAMA_USE_PREBUILT_UI=OFF, builds the server without an embedded UI.
STRIP_DIRS = ("models", "docs", "media", "benches", "tests", "examples", ".github",
              ".devops", "ci", "pocs", "skills", "tools/ui/src", "tools/ui/tests",
              "tools/ui/static", "tools/ui/scripts", "tools/server/tests",
              "tools/server/bench")
STRIP_FILES = (".git",)  # the sdist's submodule pointer, to a directory that is not there


class BuildError(Exception):
    """A step failed; str() is the one-line message."""


def default_data_dir() -> Path:
    """Same rule as warmup_agent.config (not imported: it needs PyYAML; this script is stdlib)."""
    env = os.environ.get("WARMUP_AGENT_DATA_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "warmup-agent"


def log(msg: str) -> None:
    print(f"build_llama_server: {msg}", file=sys.stderr, flush=True)


def gpu_present() -> bool:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def want_cuda(mode: str) -> bool:
    if mode == "on":
        return True
    if mode == "off":
        return False
    return shutil.which("nvcc") is not None and gpu_present()


def variant_name(cuda: bool, arch: str) -> str:
    return f"{VERSION}-cuda-sm{arch}" if cuda else f"{VERSION}-cpu"


def _stripped(rel: str) -> bool:
    if rel in STRIP_FILES:
        return True
    return any(rel == d or rel.startswith(d + "/") for d in STRIP_DIRS)


def _extract(tar: tarfile.TarFile, prefix: str, dest: Path, where: Path) -> int:
    """Extract the members under prefix (stripped of it, minus STRIP_*) into dest."""
    members = []
    for m in tar.getmembers():
        if not m.name.startswith(prefix):
            continue
        rel = m.name[len(prefix):].rstrip("/")
        if not rel or _stripped(rel) or not (m.isfile() or m.isdir() or m.issym()):
            continue
        m.name = rel
        members.append(m)
    if not members:
        raise BuildError(f"extract: no files under {prefix!r} in {where}")
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, members=members, filter="data")
    else:  # Python < 3.11.4
        tar.extractall(dest, members=members)  # noqa: S202 (our own pinned sdist)
    return len(members)


def fetch_sdist(work: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
           f"{PACKAGE}=={VERSION}", "-d", str(work)]
    log("download: " + " ".join(cmd[2:]))
    run_step("download", cmd)
    found = sorted(work.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise BuildError(f"download: pip left no llama_cpp_python sdist in {work}")
    return found[0]


def prepare_source(root: Path, from_tarball: Path | None, sdist: Path | None = None) -> Path:
    """The stripped llama.cpp tree, extracted once to <root>/<version>-src."""
    src = root / f"{VERSION}-src"
    if (src / "CMakeLists.txt").is_file() and (src / ".complete").is_file():
        return src
    shutil.rmtree(src, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{VERSION}-src.", dir=root))
    try:
        if from_tarball is not None:
            try:
                with tarfile.open(from_tarball) as tar:
                    n = _extract(tar, "llama.cpp/", tmp, from_tarball)
            except (OSError, tarfile.TarError) as e:
                raise BuildError(f"extract: cannot read {from_tarball}: {e}") from None
        else:
            with tempfile.TemporaryDirectory(prefix="llama-sdist.") as dl:
                if sdist is None:
                    sdist = fetch_sdist(Path(dl))
                try:
                    with tarfile.open(sdist) as tar:
                        n = _extract(tar, SDIST_PREFIX, tmp, sdist)
                except (OSError, tarfile.TarError) as e:
                    raise BuildError(f"extract: cannot read {sdist}: {e}") from None
        log(f"source: {n} entries (stripped) -> {src}")
        (tmp / ".complete").write_text(f"{PACKAGE}=={VERSION}\n")
        try:
            tmp.rename(src)
        except OSError:
            # another build of the same version extracted it meanwhile (two at once on one
            # cache: test-setup beside a --source-tarball run); theirs is as good as ours
            if not (src / ".complete").is_file():
                raise
            log(f"source: {src} was extracted meanwhile by another build; using it")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return src


def write_source_tarball(src: Path, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    try:
        with tarfile.open(tmp, "w:gz", compresslevel=9) as tar:
            tar.add(src, arcname="llama.cpp",
                    filter=lambda ti: None if ti.name.endswith("/.complete") else ti)
    except OSError as e:
        raise BuildError(f"source-tarball: cannot write {out}: {e}") from None
    tmp.replace(out)


def run_step(step: str, cmd: list[str], cwd: Path | None = None,
             env: dict[str, str] | None = None, log_file: Path | None = None) -> None:
    try:
        if log_file is None:
            proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=sys.stderr)
        else:
            with open(log_file, "w") as fh:
                proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT)
    except OSError as e:
        raise BuildError(f"{step}: cannot run {cmd[0]}: {e}") from None
    if proc.returncode != 0:
        where = f" (log: {log_file})" if log_file else ""
        if log_file is not None:
            tail = log_file.read_text(errors="replace").splitlines()[-25:]
            sys.stderr.write("\n".join(tail) + "\n")
        raise BuildError(f"{step}: {Path(cmd[0]).name} exited with {proc.returncode}{where}")


def build(src: Path, out_dir: Path, cuda: bool, arch: str, jobs: int, nice: int) -> Path:
    for tool in ("cmake",) + (("nvcc",) if cuda else ()):
        if shutil.which(tool) is None:
            raise BuildError(f"configure: {tool} not found on PATH")
    bdir = out_dir / "build"
    bdir.mkdir(parents=True, exist_ok=True)
    args = ["cmake", "-S", str(src), "-B", str(bdir)]
    if shutil.which("ninja"):
        args += ["-G", "Ninja"]
    args += ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
             "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF"]
    if cuda:
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={arch}"]
    # git must not find an enclosing repository (the build-info step asks it for a commit)
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(src.parent)}
    log("configure: " + " ".join(args[5:]))
    run_step("configure", args, env=env, log_file=out_dir / "configure.log")
    cmd = ["cmake", "--build", str(bdir), "--target", "llama-server", "-j", str(jobs)]
    if nice and shutil.which("nice"):
        cmd = ["nice", "-n", str(nice)] + cmd
    log(f"compile: llama-server with {jobs} jobs (log: {out_dir / 'build.log'})")
    run_step("compile", cmd, env=env, log_file=out_dir / "build.log")
    built = bdir / "bin" / "llama-server"
    if not built.is_file():
        raise BuildError(f"compile: {built} missing after a successful build")
    return built


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", type=Path, default=None,
                    help="cache root (default: $WARMUP_AGENT_DATA_DIR, else $XDG_CACHE_HOME/warmup-agent, else ~/.cache/warmup-agent)")
    ap.add_argument("--cuda", choices=("auto", "on", "off"), default="auto",
                    help="CUDA build: auto (default) = only when nvcc is found and nvidia-smi -L lists a GPU")
    ap.add_argument("--cuda-arch", default=DEFAULT_CUDA_ARCH,
                    help=f"CMAKE_CUDA_ARCHITECTURES for a CUDA build (default {DEFAULT_CUDA_ARCH}: H100/H200)")
    ap.add_argument("--jobs", "-j", type=int, default=os.cpu_count() or 1,
                    help="parallel compile jobs (default: the number of cores)")
    ap.add_argument("--nice", type=int, default=10, help="nice level of the compile (default 10; 0: none)")
    ap.add_argument("--from-tarball", type=Path, metavar="T.tar.gz",
                    help="build from a stripped tree written by --source-tarball (no download)")
    ap.add_argument("--sdist", type=Path, metavar="SDIST.tar.gz",
                    help=f"use this already downloaded {PACKAGE} {VERSION} sdist instead of pip download")
    ap.add_argument("--source-tarball", type=Path, metavar="OUT.tar.gz",
                    help="write the stripped tree to OUT.tar.gz and exit (does not build)")
    ap.add_argument("--force", action="store_true", help="rebuild even when the binary is cached")
    a = ap.parse_args(argv)

    root = (a.data_dir or default_data_dir()) / "llama.cpp"
    started = time.monotonic()
    try:
        root.mkdir(parents=True, exist_ok=True)
        if a.source_tarball is not None:
            src = prepare_source(root, a.from_tarball, a.sdist)
            write_source_tarball(src, a.source_tarball)
            size = a.source_tarball.stat().st_size / 1e6
            log(f"source tarball: {size:.1f} MB")
            print(a.source_tarball)
            return 0
        cuda = want_cuda(a.cuda)
        if cuda and not a.cuda_arch.isdigit():
            raise BuildError(f"configure: --cuda-arch must be digits like 90, got {a.cuda_arch!r}")
        out_dir = root / variant_name(cuda, a.cuda_arch)
        binary = out_dir / "bin" / "llama-server"
        if binary.is_file() and os.access(binary, os.X_OK) and not a.force:
            log("cached")
            print(binary)
            return 0
        log(f"building {variant_name(cuda, a.cuda_arch)} (cuda={a.cuda}: "
            f"{'CUDA sm_' + a.cuda_arch if cuda else 'CPU'})")
        src = prepare_source(root, a.from_tarball, a.sdist)
        built = build(src, out_dir, cuda, a.cuda_arch, max(1, a.jobs), a.nice)
        binary.parent.mkdir(parents=True, exist_ok=True)
        tmp = binary.with_name(binary.name + ".part")
        shutil.copy2(built, tmp)
        tmp.replace(binary)
        shutil.rmtree(out_dir / "build", ignore_errors=True)
    except BuildError as e:
        print("build_llama_server: error: " + " ".join(str(e).split()), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("build_llama_server: error: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        print(f"build_llama_server: error: {e}", file=sys.stderr)
        return 1
    elapsed = time.monotonic() - started
    log(f"built in {elapsed / 60:.1f} min ({elapsed:.0f} s)")
    print(binary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
