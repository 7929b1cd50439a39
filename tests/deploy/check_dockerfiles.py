#!/usr/bin/python3
"""Keeps deploy/docker/Dockerfile.{cpu,gpu} building the way developers build.

    check_dockerfiles.py SOURCE_DIR PDSERVE_BIN

No Docker engine is needed: the Dockerfiles are parsed, not built.

Both Dockerfiles:
- The build stage installs its packages only through `./pdserve.sh deps`
  (so its apt package list is exactly pdserve.sh's DEB_PACKAGES; no other
  apt-get install there) and builds only through `./pdserve.sh build` (no
  direct cmake/ninja/make), with pdserve.sh copied before it runs.
- The runtime stage starts from a fresh base image, copies the binary from the
  build stage, ends as a numeric non-root USER and has pdserve as ENTRYPOINT.
- A <Dockerfile>.dockerignore keeps local build trees out of the context.
Dockerfile.cpu: Debian bookworm (what pdserve.sh targets), and its runtime
  apt list covers the packages owning every shared library PDSERVE_BIN links
  directly (found with readelf/ldd/dpkg, when this machine is bookworm too),
  and lists nothing else.
Dockerfile.gpu: an nvidia/cuda devel image to build and runtime image to run,
  a CUDA_ARCHITECTURES build arg defaulting to "80;90" that reaches CMake.
"""
import os
import pathlib
import re
import shlex
import subprocess
import sys

SRC = pathlib.Path(sys.argv[1]).resolve()
PDSERVE_BIN = sys.argv[2]
DOCKER = SRC / "deploy/docker"

# Always present in a debian:bookworm(-slim) image.
BASE_IMAGE_PACKAGES = {"libc6", "libgcc-s1", "libstdc++6", "zlib1g"}

failures = []


def fail(msg):
    failures.append(msg)
    print(f"FAIL {msg}")


def deb_packages():
    """pdserve.sh's DEB_PACKAGES, evaluated by bash itself."""
    script = (f'eval "$(sed -n \'/^DEB_PACKAGES=(/,/^)/p\' {shlex.quote(str(SRC / "pdserve.sh"))})"; '
              'printf "%s\\n" "${DEB_PACKAGES[@]}"')
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.split()
    if not out:
        fail("could not read DEB_PACKAGES from pdserve.sh")
    return out


def parse(path):
    """Dockerfile -> list of stages: {from, name, instructions: [(KEYWORD, text)]}; plus global ARGs."""
    lines, cur = [], ""
    for raw in path.read_text().splitlines():
        s = raw.strip()
        if not cur and (not s or s.startswith("#")):
            continue
        if cur and s.startswith("#"):
            continue
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        cur += s
        lines.append(cur)
        cur = ""
    stages, global_args = [], {}
    for line in lines:
        kw, _, rest = line.partition(" ")
        kw = kw.upper()
        if kw == "FROM":
            m = re.match(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", rest, re.I)
            stages.append({"from": m.group(1), "name": m.group(2), "ins": []})
        elif not stages:
            if kw == "ARG":
                k, _, v = rest.partition("=")
                global_args[k.strip()] = v.strip().strip('"')
        else:
            stages[-1]["ins"].append((kw, rest.strip()))
    return stages, global_args


def expand(image, args):
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), image)


def apt_install_args(text):
    """Package names of every `apt-get install` in a RUN line."""
    lex = shlex.shlex(text, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    commands, cur = [], []
    for tok in lex:
        if tok in {"&&", "||", ";", "|", "&", "(", ")"}:
            commands.append(cur)
            cur = []
        else:
            cur.append(tok)
    commands.append(cur)
    pkgs = []
    for words in commands:
        if "apt-get" in words and "install" in words:
            pkgs += [w for w in words[words.index("install") + 1:] if not w.startswith("-")]
    return pkgs


def check_common(path):
    name = path.name
    stages, gargs = parse(path)
    if len(stages) < 2:
        fail(f"{name}: needs a build stage and a runtime stage")
        return None, None, gargs
    build, runtime = stages[0], stages[-1]
    runs = [t for k, t in build["ins"] if k == "RUN"]
    deps_at = [i for i, (k, t) in enumerate(build["ins"]) if k == "RUN" and re.search(r"(^|\s|&&)\./pdserve\.sh deps(\s|$|&&)", t)]
    build_at = [i for i, (k, t) in enumerate(build["ins"]) if k == "RUN" and re.search(r"(^|\s|&&)\./pdserve\.sh build(\s|$|&&)", t)]
    copy_sh = [i for i, (k, t) in enumerate(build["ins"]) if k == "COPY" and re.search(r"\bpdserve\.sh\b|^\.\s", t)]
    if not deps_at:
        fail(f"{name}: the build stage must install packages with ./pdserve.sh deps")
    if not build_at:
        fail(f"{name}: the build stage must build with ./pdserve.sh build")
    if deps_at and (not copy_sh or copy_sh[0] > deps_at[0]):
        fail(f"{name}: pdserve.sh must be copied before ./pdserve.sh deps runs")
    for t in runs:
        if apt_install_args(t):
            fail(f"{name}: the build stage installs packages outside pdserve.sh deps: {t}")
        if re.search(r"(^|\s|&&)(cmake|ninja|make)\s", t):
            fail(f"{name}: the build stage runs the build tools directly; use ./pdserve.sh build: {t}")
    if runtime["from"].lower() == (build["name"] or "").lower():
        fail(f"{name}: the runtime stage must start from a fresh base image, not the build stage")
    copies = [t for k, t in runtime["ins"] if k == "COPY"]
    if not any(re.search(rf"--from={re.escape(build['name'] or '0')}\s+\S*/bin/pdserve\s", t + " ") for t in copies):
        fail(f"{name}: the runtime stage must COPY --from={build['name']} .../bin/pdserve")
    users = [t for k, t in runtime["ins"] if k == "USER"]
    if not users or not re.fullmatch(r"[1-9]\d*(:\d+)?", users[-1]):
        fail(f"{name}: the runtime stage must end as a numeric non-root USER (got {users[-1] if users else 'none'})")
    entry = [t for k, t in runtime["ins"] if k == "ENTRYPOINT"]
    if not entry or "pdserve" not in entry[-1]:
        fail(f"{name}: ENTRYPOINT must run pdserve")
    ignore = path.with_name(path.name + ".dockerignore")
    if not ignore.exists() or not re.search(r"^build\b", ignore.read_text(), re.M):
        fail(f"{name}: {ignore.name} must exclude build/ (a copied CMake cache breaks the build)")
    runtime_pkgs = [p for k, t in runtime["ins"] if k == "RUN" for p in apt_install_args(t)]
    print(f"ok: {name}: build stage {expand(build['from'], gargs)} runs ./pdserve.sh deps + build; "
          f"runtime stage {expand(runtime['from'], gargs)}")
    return build, runtime_pkgs, gargs


def dpkg_owners(paths):
    """{path: package} for every path dpkg knows, in one `dpkg -S` call."""
    paths = list(dict.fromkeys(paths))
    if not paths:
        return {}
    r = subprocess.run(["dpkg", "-S", *paths], capture_output=True, text=True)
    owners = {}
    for line in r.stdout.splitlines():
        if line.startswith("diversion by"):
            continue
        pkgs, _, path = line.partition(": ")
        owners[path.strip()] = pkgs.split(",")[0].split(":")[0].strip()
    return owners


def linked_libraries(binary):
    """[(soname, resolved path)] of the libraries `binary` links directly."""
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]",
                        subprocess.run(["readelf", "-d", binary], capture_output=True, text=True, check=True).stdout)
    paths = dict(re.findall(r"^\s*(\S+) => (/\S+)", subprocess.run(["ldd", binary], capture_output=True,
                                                                    text=True, check=True).stdout, re.M))
    for lib in needed:
        # The dynamic loader itself (libc6's) is listed without "=>".
        if lib not in paths and not lib.startswith("ld-linux"):
            fail(f"ldd does not resolve {lib} of {binary}")
    return [(lib, paths[lib]) for lib in needed if lib in paths]


def needed_packages(binary):
    """Debian packages owning the shared libraries `binary` links directly."""
    libs = linked_libraries(binary)
    known = dpkg_owners([p for _, path in libs for p in (path, os.path.realpath(path))])
    owners, unowned = {}, []
    for lib, path in libs:
        pkg = known.get(path) or known.get(os.path.realpath(path))
        if pkg:
            owners.setdefault(pkg, []).append(lib)
        else:
            unowned.append(f"{lib} ({path})")
    return owners, unowned


# Libraries from the compiler toolchain (build-essential) and libc.
TOOLCHAIN_LIBS = re.compile(r"lib(c|m|dl|rt|pthread|gcc_s|stdc\+\+|gomp|atomic|quadmath)\.so\.")


def symlink_chain(path):
    """path, then each symlink hop (alternatives links belong to no package)."""
    chain = [path]
    while os.path.islink(chain[-1]) and len(chain) < 8:
        chain.append(os.path.normpath(os.path.join(os.path.dirname(chain[-1]), os.readlink(chain[-1]))))
    return chain


def installed_closure(roots):
    """Installed packages reachable from `roots` through Depends/Pre-Depends."""
    out = subprocess.run(["dpkg-query", "-W", "-f", "${Package}\t${Status}\t${Depends}, ${Pre-Depends}\t${Provides}\n"],
                         capture_output=True, text=True).stdout
    deps, providers = {}, {}
    for line in out.splitlines():
        pkg, status, dep, prov = (line.split("\t") + ["", "", ""])[:4]
        if "installed" not in status.split():
            continue
        deps[pkg] = [re.split(r"[\s(:]", alt.strip())[0] for group in dep.split(",") for alt in group.split("|") if alt.strip()]
        providers.setdefault(pkg, set()).add(pkg)
        for v in prov.split(","):
            if v.strip():
                providers.setdefault(re.split(r"[\s(:]", v.strip())[0], set()).add(pkg)
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        for pkg in providers.get(name, ()):
            if pkg not in seen:
                seen.add(pkg)
                todo.extend(deps.get(pkg, []))
    return seen


def check_dev_packages(binary, debs):
    """Each library the binary links must come with a development package
    that `pdserve.sh deps` installs (directly or as a dependency): otherwise a
    fresh machine, and the Docker build stage, cannot build pdserve."""
    chains = {}
    for lib, path in linked_libraries(binary):
        if TOOLCHAIN_LIBS.match(lib):
            continue
        linker_name = lib[:lib.index(".so") + 3]
        libdir = os.path.dirname(path)
        dirs = dict.fromkeys([libdir, libdir if libdir.startswith("/usr/") else "/usr" + libdir])
        chains[lib] = (linker_name, [p for d in dirs for p in symlink_chain(os.path.join(d, linker_name))])
    known = dpkg_owners([p for _, chain in chains.values() for p in chain])
    closure = installed_closure(debs)
    ok = []
    for lib, (linker_name, chain) in chains.items():
        dev = next((known[p] for p in chain if p in known), None)
        if not dev:
            print(f"note: no package owns {linker_name} (for {lib}); not checked")
        elif dev not in closure:
            fail(f"pdserve.sh DEB_PACKAGES lacks {dev} (it provides {linker_name}, which pdserve links): "
                 "./pdserve.sh deps on a fresh machine, and the Docker build stage, cannot build pdserve")
        else:
            ok.append(dev)
    if ok:
        print(f"ok: pdserve.sh deps brings the development packages of every linked library: {' '.join(sorted(set(ok)))}")


def main():
    debs = deb_packages()
    print(f"pdserve.sh DEB_PACKAGES ({len(debs)}): {' '.join(debs)}")

    # ------------------------------------------------------------ CPU
    cpu = DOCKER / "Dockerfile.cpu"
    build, runtime_pkgs, gargs = check_common(cpu)
    if build is not None:
        image = expand(build["from"], gargs)
        if not re.fullmatch(r"debian:bookworm(-slim)?(@sha256:[0-9a-f]+)?", image):
            fail(f"Dockerfile.cpu: build from Debian bookworm, as pdserve.sh deps expects (got {image})")
        if "PDSERVE_CUDA=OFF" not in " ".join(t for _, t in build["ins"]):
            fail("Dockerfile.cpu: set PDSERVE_CUDA=OFF for the CPU build")
        os_release = pathlib.Path("/etc/os-release").read_text() if pathlib.Path("/etc/os-release").exists() else ""
        if "VERSION_CODENAME=bookworm" in os_release and os.path.exists(PDSERVE_BIN):
            check_dev_packages(PDSERVE_BIN, debs)
            owners, unowned = needed_packages(PDSERVE_BIN)
            want = set(owners) - BASE_IMAGE_PACKAGES
            missing = sorted(want - set(runtime_pkgs))
            extra = sorted(set(runtime_pkgs) - want)
            for p in missing:
                fail(f"Dockerfile.cpu: runtime stage lacks {p} (provides {', '.join(owners[p])})")
            for p in extra:
                fail(f"Dockerfile.cpu: runtime stage installs {p}, which {PDSERVE_BIN} does not link")
            if unowned:
                print(f"note: libraries owned by no Debian package (not in the CPU image): {', '.join(unowned)}")
            if not missing and not extra:
                print(f"ok: Dockerfile.cpu runtime packages = the owners of what {PDSERVE_BIN} links: {' '.join(sorted(want))}")
        else:
            print("note: this machine is not Debian bookworm; runtime package list not compared with the binary")

    # ------------------------------------------------------------ GPU
    gpu = DOCKER / "Dockerfile.gpu"
    build, runtime_pkgs, gargs = check_common(gpu)
    if build is not None:
        stages, _ = parse(gpu)
        b_img, r_img = expand(stages[0]["from"], gargs), expand(stages[-1]["from"], gargs)
        if not re.fullmatch(r"nvidia/cuda:[\w.]+-(cudnn-)?devel-ubuntu[\d.]+", b_img):
            fail(f"Dockerfile.gpu: build stage must use an nvidia/cuda devel image (got {b_img})")
        if not re.fullmatch(r"nvidia/cuda:[\w.]+-(cudnn-)?runtime-ubuntu[\d.]+", r_img):
            fail(f"Dockerfile.gpu: runtime stage must use an nvidia/cuda runtime image, which has NCCL (got {r_img})")
        text = "\n".join(t for _, t in build["ins"])
        m = re.search(r'^CUDA_ARCHITECTURES="?([^"\s]*)"?', "\n".join(t for k, t in build["ins"] if k == "ARG"), re.M)
        if not m or m.group(1) != "80;90":
            fail('Dockerfile.gpu: needs ARG CUDA_ARCHITECTURES="80;90" in the build stage')
        if not re.search(r"CUDAARCHS=\"?\$\{?CUDA_ARCHITECTURES\}?", text):
            fail("Dockerfile.gpu: CUDA_ARCHITECTURES must reach CMake (ENV CUDAARCHS=${CUDA_ARCHITECTURES})")
        if "PDSERVE_CUDA=ON" not in text:
            fail("Dockerfile.gpu: set PDSERVE_CUDA=ON so that a missing nvcc fails the build")
        print(f"ok: Dockerfile.gpu: {b_img} -> {r_img}, CUDA_ARCHITECTURES default 80;90")

    if failures:
        print(f"check_dockerfiles: {len(failures)} problem(s)")
        return 1
    print("check_dockerfiles: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
